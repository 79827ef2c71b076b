"""``zephon record-longest DATASET``: record a pre-tokenized dataset's longest document in its manifest.

A pre-tokenized text dataset records its longest document in tokens as the manifest's
``longest_tokens``, a chat dataset tokenized offline as ``chat.longest_tokens``; with it the
loader knows exactly whether every document fits a ``best_fit`` sequence
(docs/guides/finite-epochs.md, "Documents longer than a sequence"). A dataset sharded before the
entry existed has none. This command reads every lane file's ``num_tokens`` column (checking
each file against its manifest SHA-256 first), takes the maximum over the documents, and
rewrites ``manifest.json`` with the entry added, nothing else changed. The entry is outside the
dataset fingerprint, so the dataset's fingerprint and every checkpoint of it stay valid.

Run it where nothing reads the manifest at the same moment (it is replaced atomically, as the
Beam job writes it). ``--check`` only prints the value (and compares it with a recorded one).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
from typing import Optional, Sequence

import numpy as np
import pyarrow.parquet as pq

from loader.cli import run_command
from loader.errors import ManifestError
from loader.io import storage
from loader.io.manifest import MANIFEST_NAME, Manifest
from loader.io.names import TOMBSTONE_COLUMN
from loader.io.storage_options import StorageOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon record-longest",
        description="Record a pre-tokenized dataset's longest document in tokens in its manifest "
                    "(longest_tokens, or chat.longest_tokens), read from its lane files, without re-sharding. "
                    "The dataset fingerprint does not change.")
    parser.add_argument("dataset", help="the dataset directory (local, gs:// or s3://)")
    parser.add_argument("--check", action="store_true",
                        help="print the longest document and compare it with the recorded one; write nothing")
    return parser


def longest_document(dataset: str, manifest: Manifest, options: Optional[StorageOptions] = None) -> int:
    """Tokens of the dataset's longest document (tombstones hold none), from its lane files."""
    longest = 0
    columns = ["num_tokens"] + ([TOMBSTONE_COLUMN] if manifest.has_tombstones else [])
    for entry in manifest.files:
        location = storage.join(dataset, entry.path)
        data = storage.read_bytes(location, options)
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ManifestError(f"{location}: its SHA-256 is not the manifest's {entry.sha256[:16]}...: the lane file "
                                "changed since the dataset was sharded; restore it or re-shard")
        # One file, read on this thread: pq.read_table's dataset scanner starts Arrow's thread
        # pools, which can abort the process at exit (apache/arrow#34314).
        table = pq.ParquetFile(io.BytesIO(data)).read(columns=columns, use_threads=False)
        tokens = table["num_tokens"].to_numpy(zero_copy_only=False)
        if manifest.has_tombstones:
            tokens = tokens[table[TOMBSTONE_COLUMN].to_numpy(zero_copy_only=False) < 0]
        longest = max(longest, int(np.max(tokens, initial=0)))
    return longest


def _recorded(manifest: Manifest) -> Optional[int]:
    return manifest.chat.longest_tokens if manifest.chat is not None else manifest.longest_tokens


def command(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    location = storage.join(args.dataset, MANIFEST_NAME)
    if not storage.exists(location):
        raise ManifestError(f"{location} does not exist: {args.dataset} is not a Zephon dataset")
    raw = storage.read_bytes(location).decode("utf-8")
    manifest = Manifest.from_json(raw, location)
    if not manifest.pretokenized or manifest.kind is not None or manifest.images is not None:
        raise ManifestError(f"{location}: the dataset is not pre-tokenized text or chat (no 'tokenizer', or an image "
                            "or named-kind dataset): there are no token counts to record; text tokenized by the loader "
                            "is cut by best_fit as it reads it")
    longest = longest_document(args.dataset, manifest)
    if longest < 1:
        raise ManifestError(f"{location}: no document holds a token; nothing to record")
    recorded = _recorded(manifest)
    field = "chat.longest_tokens" if manifest.chat is not None else "longest_tokens"
    if recorded is not None and recorded != longest:
        raise ManifestError(f"{location}: {field} is {recorded}, but the longest document of the lane files has "
                            f"{longest} tokens: the manifest was edited; restore it or re-shard")
    print(f"{args.dataset}: longest document {longest} tokens"
          + (f" ({field} recorded)" if recorded is not None else ""))
    if recorded is not None or args.check:
        return 0
    data = json.loads(raw)
    if manifest.chat is not None:
        data["chat"]["longest_tokens"] = longest
    else:
        data["longest_tokens"] = longest
    text = json.dumps(data, indent=1, sort_keys=False) + "\n"
    updated = Manifest.from_json(text, location)  # the entry parses, the fingerprint still holds
    if updated.dataset_fingerprint != manifest.dataset_fingerprint or _recorded(updated) != longest:
        raise ManifestError(f"{location}: internal error: recording {field} changed the manifest's content")
    storage.write_atomically(location, text.encode("utf-8"))
    print(f"recorded {field} = {longest} in {location} (dataset fingerprint unchanged)")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_command("record-longest", argv)
