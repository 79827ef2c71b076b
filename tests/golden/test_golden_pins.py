"""Golden pins: literal values of everything a user persists or compares between runs.

Every other test of the suite compares the code with itself (W=1 against W=4, a resume
against an uninterrupted run, online against offline tokenization), so a refactor that
changes every lane, every batch or every checkpoint *the same way* passes all of them while
re-sharding users' data and breaking their saved runs. The values below were computed once
from the code of commit 4c2250e (in a clean worktree, by calling this file's value functions:
``hash_values``, ``permutation_values``, ``mixing_values``, ``dataset_content``, ``dataset_bytes``,
``fingerprint_run``, ``batch_field_digests``, ``checkpoint_values``) and pasted here as
literals; each test recomputes its value from the code under test and compares:

* stable hashes: lane and order keys of fixed keys, file buckets, the hash encoding, and the
  epoch permutations (beside the ones ``tests/loader/order/test_hashing.py`` already pins);
* mixing decisions of a three-source schedule with phase changes;
* a small fixed corpus as lane files: written by the suite's factory
  (``tests/dataset_factory.write_dataset``) and by the Beam job (``beam_jobs.shard``, in
  memory): schema, layout, content read back, file SHA-256s and the dataset fingerprint;
* batch fingerprints (the ``zephon fingerprints`` lines) of fixed configs: both packings,
  with and without BOS, a two-source mix in sequence and token units, text lanes tokenized
  online and the same lanes pre-tokenized, up to a step past every lane's epoch edge;
* a digest of every batch field (labels, position_ids, cu_seqlens, token_source_ids,
  source_ids, global_indices, ...) of a few configs;
* the JSON bytes of merged checkpoints of both packings and a mix.

**A pin never changes silently.** An intended change to any value here is a format change:
bump the format version (``loader.io.manifest.FORMAT_VERSION`` for hashes and lane files,
``loader.checkpoint.state.STATE_VERSION`` for checkpoints), add a migration, and change the pin in the
same commit, saying so in the commit message. A pin that moves in any other commit is a bug
of that commit, not of the pin.

Two kinds of value depend on library versions, not only on Zephon's code: Parquet bytes
carry the pyarrow version (``created_by``), and the tokenizer fingerprint is a hash of
``tokenizers``' own serialisation. Those pins (file SHA-256s, dataset fingerprints, full
checkpoint bytes) first check that the libraries are the versions they were made with
(:data:`PINNED_LIBRARIES`) and fail with a message if not; beside each of them sits a pin
that no library version can move (lane content read back, checkpoint bytes with the
fingerprints masked), so a library upgrade that trips the first kind shows at once whether
anything else moved. Upgrading pyarrow or tokenizers changes the dataset fingerprint of a
re-sharded dataset, and so refuses resuming old checkpoints on it: that is why it trips a pin.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional

import numpy as np
import pyarrow
import pyarrow.parquet as pq
import pytest
import tokenizers
from tokenizers import Tokenizer

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from loader.commands.fingerprints import collect_fingerprints
from loader.order.hashing import file_bucket, lane_of_key, order_key_of, stable_hash64, stable_permutation
from loader.io.manifest import MANIFEST_NAME, read_manifest
from loader.order.mixing import MixingSchedule, MixturePhase, batch_source_counts, exact_weights
from loader.pipeline import ZephonLoader
from loader.checkpoint.state import dumps
from loader.stages.tokenizer import tokenizer_fingerprint
from tests.dataset_factory import synthetic_texts, write_dataset

# ---------------------------------------------------------------------------------------
# The fixed inputs. Changing any of these changes the pins: they are part of the test.

NUM_LANES = 4
DATA_SEED = 3  # the Beam job's / factory's seed: lanes and order keys
LOADER_SEED = 11  # the loader's seed: epoch permutations, mixing
SEQ_LEN = 64
GLOBAL_BATCH = 8
MICRO_BATCH = 2
OPEN_BINS = 4
MAIN_DOCS = dict(count=40, seed=7, max_words=30)  # synthetic_texts arguments
OTHER_DOCS = dict(count=24, seed=8, max_words=30)
FIRST_STEPS = 6  # steps 0..5 are pinned one by one
LATER_STEP = 40  # and this one, past every lane's first epoch edge in every config
# The Beam job as the pins ran it; multi_processing gave the same pins when they were made
# (13-18 s here, so not repeated in this file; tests/beam_jobs/test_shard.py compares modes).
BEAM_IN_MEMORY = ("--runner=FnApiRunner", "--direct_running_mode=in_memory")
PINNED_LIBRARIES = {"pyarrow": "25.0.1", "tokenizers": "0.23.3"}


def require_pinned_libraries(*names: str) -> None:
    """Fail (never skip) when a library that goes into the bytes of a pin has another version."""
    versions = {"pyarrow": pyarrow.__version__, "tokenizers": tokenizers.__version__}
    differing = {n: (PINNED_LIBRARIES[n], versions[n]) for n in names if versions[n] != PINNED_LIBRARIES[n]}
    assert not differing, (
        f"these pins were made with {PINNED_LIBRARIES}, this run has "
        f"{ {n: v for n, (_, v) in differing.items()} }: Parquet bytes (created_by) and the tokenizer "
        "fingerprint depend on them, so a re-sharded dataset gets another dataset fingerprint and old "
        "checkpoints refuse it. If the upgrade is intended, re-pin these values and PINNED_LIBRARIES in "
        "the commit that upgrades, and check that every library-independent pin of this file still passes."
    )


# ---------------------------------------------------------------------------------------
# Stable hashes (tests/loader/order/test_hashing.py pins permutations of n = 5, 16, 40, 4096 and
# the mixing block of n = 512; these add other sizes and every seed-part shape the loader uses).

HASH_KEYS = ("doc-0000000", "prose-17", "", "über/数据.jsonl#3", "🙂 x")
HASH_SEEDS = (0, 3, 2**40 + 1)
LANE_COUNTS = (1, 7, 16, 17, 512)
FILES_PER_LANE = (1, 3, 8)


def hash_values() -> dict[str, Any]:
    lanes, orders, buckets = {}, {}, {}
    for seed in HASH_SEEDS:
        for key in HASH_KEYS:
            lanes[(seed, key)] = [lane_of_key(seed, key, n) for n in LANE_COUNTS]
            orders[(seed, key)] = order_key_of(seed, key)
            buckets[(seed, key)] = [file_bucket(order_key_of(seed, key), n) for n in FILES_PER_LANE]
    encodings = [stable_hash64(*parts) for parts in
                 [(), ("a",), (b"a",), (0,), (1,), (2**64 + 5,), ("ab", "c"), ("a", "bc"), (7, "lane", "k")]]
    return {"lanes": lanes, "orders": orders, "buckets": buckets, "encodings": encodings}


# Guards where every document lives: lane_of_key(seed, key, L) for L in LANE_COUNTS. A change
# re-shards every dataset (the Beam job and the loader must agree on it).
PINNED_LANES = {
    (0, "doc-0000000"): [0, 2, 2, 12, 50],
    (0, "prose-17"): [0, 0, 12, 1, 220],
    (0, ""): [0, 1, 5, 9, 5],
    (0, "über/数据.jsonl#3"): [0, 1, 2, 8, 2],
    (0, "🙂 x"): [0, 3, 11, 7, 251],
    (3, "doc-0000000"): [0, 0, 7, 10, 87],
    (3, "prose-17"): [0, 6, 0, 15, 80],
    (3, ""): [0, 2, 14, 3, 62],
    (3, "über/数据.jsonl#3"): [0, 4, 7, 6, 199],
    (3, "🙂 x"): [0, 0, 7, 5, 471],
    (1099511627777, "doc-0000000"): [0, 0, 12, 9, 252],
    (1099511627777, "prose-17"): [0, 6, 5, 13, 309],
    (1099511627777, ""): [0, 6, 5, 0, 181],
    (1099511627777, "über/数据.jsonl#3"): [0, 1, 7, 1, 327],
    (1099511627777, "🙂 x"): [0, 6, 8, 5, 392],
}

# Guards the order of documents inside a lane (rows are sorted by order_key_of(seed, key)) and
# which part file of its lane a document goes to (file_bucket(order key, F), F in FILES_PER_LANE).
PINNED_ORDER_KEYS = {
    (0, "doc-0000000"): 4596815098709547757,
    (0, "prose-17"): 7031611278628825873,
    (0, ""): 2157444360270444030,
    (0, "über/数据.jsonl#3"): 9560026452745421144,
    (0, "🙂 x"): 12072331966382263560,
    (3, "doc-0000000"): 12872689516620976879,
    (3, "prose-17"): 17506185402938687109,
    (3, ""): 8770248832874380323,
    (3, "über/数据.jsonl#3"): 13998151440854317677,
    (3, "🙂 x"): 14865446410348700927,
    (1099511627777, "doc-0000000"): 10278521532292881362,
    (1099511627777, "prose-17"): 14625332312776572101,
    (1099511627777, ""): 12051706396197176897,
    (1099511627777, "über/数据.jsonl#3"): 3943340855794731366,
    (1099511627777, "🙂 x"): 5650761087703986071,
}
PINNED_BUCKETS = {
    (0, "doc-0000000"): [0, 0, 1],
    (0, "prose-17"): [0, 1, 3],
    (0, ""): [0, 0, 0],
    (0, "über/数据.jsonl#3"): [0, 1, 4],
    (0, "🙂 x"): [0, 1, 5],
    (3, "doc-0000000"): [0, 2, 5],
    (3, "prose-17"): [0, 2, 7],
    (3, ""): [0, 1, 3],
    (3, "über/数据.jsonl#3"): [0, 2, 6],
    (3, "🙂 x"): [0, 2, 6],
    (1099511627777, "doc-0000000"): [0, 1, 4],
    (1099511627777, "prose-17"): [0, 2, 6],
    (1099511627777, ""): [0, 1, 5],
    (1099511627777, "über/数据.jsonl#3"): [0, 0, 1],
    (1099511627777, "🙂 x"): [0, 0, 2],
}

# Guards the byte encoding of hash parts (type tags, length prefixes, blake2b personalisation):
# stable_hash64 of (), ("a",), (b"a",), (0,), (1,), (2**64+5,), ("ab","c"), ("a","bc"), (7,"lane","k").
PINNED_ENCODINGS = [
    2046544683409218039, 2517091066017705704, 10066868438682636352, 1270571524293223629, 6360699542760071919,
    8158539985846219051, 3459737068732426116, 16239622168708026890, 5103251262502119074,
]


def test_lane_order_and_bucket_hashes_keep_their_values() -> None:
    got = hash_values()
    assert got["lanes"] == PINNED_LANES
    assert got["orders"] == PINNED_ORDER_KEYS
    assert got["buckets"] == PINNED_BUCKETS
    assert got["encodings"] == PINNED_ENCODINGS
    assert len(set(got["encodings"])) == len(got["encodings"])  # the parts really are told apart


def permutation_values() -> dict[str, Any]:
    # The seed-part shapes of loader/io/lane_reader.py: files, row groups of a file, rows of a row group.
    rows_512 = stable_permutation(512, 11, "rows", "synthetic", 3, 2, 1, 0)
    return {
        "files_1": stable_permutation(1, 11, "files", "synthetic", 0, 1).tolist(),
        "files_7": stable_permutation(7, 11, "files", "synthetic", 2, 1).tolist(),
        "files_16": stable_permutation(16, 11, "files", "web", 63, 9).tolist(),
        "row_groups_17": stable_permutation(17, 11, "row_groups", "synthetic", 1, 3, 0).tolist(),
        "rows_512_head": rows_512[:12].tolist(),
        "rows_512_sha256": hashlib.sha256(rows_512.astype("<i8").tobytes()).hexdigest(),
    }


# Guards the order in which epochs > 0 replay a lane's files, row groups and rows: n = 1, 7,
# 16 (the last pure-Python size), 17 (the first vectorised size) and 512 (digest of int64 LE).
PINNED_PERMUTATIONS = {
    "files_1": [0],
    "files_7": [6, 2, 1, 5, 0, 3, 4],
    "files_16": [12, 8, 10, 14, 13, 3, 9, 15, 5, 0, 4, 6, 1, 11, 2, 7],
    "row_groups_17": [1, 13, 3, 0, 4, 12, 7, 8, 11, 15, 2, 6, 5, 10, 16, 9, 14],
    "rows_512_head": [208, 189, 309, 206, 240, 66, 283, 112, 376, 330, 326, 278],
    "rows_512_sha256": "a90a3d50a530771b47b7e5bfc16271f198aafd6ba4e8f21d414804e41d84f7cf",
}


def test_epoch_permutations_keep_their_values() -> None:
    got = permutation_values()
    assert got == PINNED_PERMUTATIONS
    assert sorted(got["files_16"]) == list(range(16)) and sorted(got["row_groups_17"]) == list(range(17))


# ---------------------------------------------------------------------------------------
# Mixing decisions.

MIX_PHASES = ((0, (5, 3, 2)), (3, (1, 1, 1)), (5, (0.2, 0, 0.8)))  # (start step, weights)
MIX_BATCH = 16


def mixing_values() -> dict[str, Any]:
    phases = [MixturePhase(step, exact_weights(weights)) for step, weights in MIX_PHASES]
    schedule = MixingSchedule(phases, MIX_BATCH, LOADER_SEED)
    long_run = np.array([schedule.source_of(i) for i in range(256 * MIX_BATCH)], dtype=np.int8)
    fresh = MixingSchedule(phases, MIX_BATCH, LOADER_SEED)  # the answer must not depend on call order
    return {
        "first_100": [fresh.source_of(i) for i in range(100)],
        "first_256_steps_sha256": hashlib.sha256(long_run.tobytes()).hexdigest(),
        "fallback": [schedule.fallback_source(i, (True, False, True), i // MIX_BATCH) for i in range(0, 200, 10)],
        "counts_b28": [batch_source_counts(exact_weights((0.55, 0.3, 0.15)), 28, t) for t in range(10)],
    }


# Guards which source each global index comes from (source_of), for a three-source schedule
# whose phases start at steps 0, 3 and 5 (B = 16, so index 48 is the first phase change and
# 80 the second, with a zero weight); the digest covers 256 steps (int8 per index).
# "fallback" guards the renormalised draw when a source stopped in a lane, "counts_b28" the
# per-batch apportionment (floor or ceil of w * B) of 0.55/0.3/0.15 at B = 28.
PINNED_MIXING = {
    "first_100": [
        1, 0, 1, 2, 0, 0, 0, 0, 1, 0, 1, 0, 2, 0, 1, 2, 2, 0, 2, 1, 2, 1, 0, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 2,
        1, 0, 0, 1, 0, 2, 0, 2, 2, 0, 0, 1, 0, 1, 1, 2, 0, 0, 1, 1, 1, 2, 0, 2, 2, 2, 1, 0, 1, 0, 2, 1, 2, 0, 0, 0,
        0, 1, 0, 1, 1, 2, 2, 2, 2, 2, 2, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 2, 2, 0, 2, 2,
    ],
    "first_256_steps_sha256": "ec7f34b81235dccc9a4a87eda1769fa14a10c4ad13bbaf225cb5993301b01884",
    "fallback": [0, 2, 2, 0, 2, 2, 0, 0, 0, 2, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2],
    "counts_b28": [
        [15, 9, 4],
        [16, 8, 4],
        [15, 8, 5],
        [15, 9, 4],
        [16, 8, 4],
        [15, 9, 4],
        [16, 8, 4],
        [15, 8, 5],
        [15, 9, 4],
        [16, 8, 4],
    ],
}


def test_mixing_decisions_keep_their_values() -> None:
    got = mixing_values()
    assert got == PINNED_MIXING
    assert got["first_100"][48:80].count(1) > 0 and 1 not in got["first_100"][80:]  # the phases really apply


# ---------------------------------------------------------------------------------------
# The fixed corpus as lane files.


def main_texts() -> list[str]:
    return synthetic_texts(**MAIN_DOCS)


def build_datasets(base: str) -> dict[str, str]:
    """The pinned factory datasets under ``base``: name -> directory."""
    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    texts, other = main_texts(), synthetic_texts(**OTHER_DOCS)
    paths = {name: os.path.join(base, name) for name in ("text", "pretokenized", "other_text")}
    layout = dict(num_lanes=NUM_LANES, seed=DATA_SEED, files_per_lane=2, row_group_rows=4)
    write_dataset(paths["text"], texts, **layout)
    write_dataset(paths["pretokenized"], texts, tokenizer=tokenizer, **layout)
    write_dataset(paths["other_text"], other, num_lanes=NUM_LANES, seed=DATA_SEED, files_per_lane=1,
                  row_group_rows=3, source_name="other", keys=[f"other-{k:05d}" for k in range(len(other))])
    return paths


def build_beam_dataset(base: str, runner_args: tuple[str, ...] = BEAM_IN_MEMORY) -> str:
    """The main corpus through the Beam job (pre-tokenized, the factory's keys) under ``base``.

    Its rows are the factory's; its row groups follow content (one per file here, two files per lane).
    """
    source = os.path.join(base, "input", "docs.jsonl")
    os.makedirs(os.path.dirname(source))
    with open(source, "w", encoding="utf-8") as fh:
        for k, text in enumerate(main_texts()):
            fh.write(json.dumps({"id": f"doc-{k:07d}", "text": text}, ensure_ascii=False) + "\n")
    out = os.path.join(base, "beam")
    shard.run(["--input", source, "--output", out, "--id-field", "id", "--source-name", "synthetic",
               "--num-lanes", str(NUM_LANES), "--seed", str(DATA_SEED), "--target-file-mb", "0.001",
               "--tokenizer", default_tokenizer_path(), *runner_args])
    return out


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    return build_datasets(str(tmp_path_factory.mktemp("golden")))


@pytest.fixture(scope="module")
def beam_dataset(tmp_path_factory) -> str:
    return build_beam_dataset(str(tmp_path_factory.mktemp("golden_beam")))


def _field_bytes(value: Any) -> bytes:
    """A length-prefixed encoding of one cell of a lane file (pyarrow-independent)."""
    if isinstance(value, str):
        body = b"s" + value.encode("utf-8")
    elif isinstance(value, bytes):  # input_ids: little-endian int32 already
        body = b"b" + value
    elif isinstance(value, list):  # input_ids as list<int32>
        body = b"b" + np.asarray(value, dtype="<i4").tobytes()
    elif isinstance(value, int):
        body = b"i" + str(value).encode()
    else:
        raise TypeError(f"unexpected lane file value {value!r:.60}")
    return len(body).to_bytes(8, "little") + body


def dataset_content(path: str) -> dict[str, Any]:
    """What a dataset holds, independent of how Parquet encodes it."""
    manifest = read_manifest(path)
    content = hashlib.sha256()
    layout = []
    for lane in range(manifest.num_lanes):
        content.update(f"lane {lane}\n".encode())
        for entry in manifest.lane_files(lane):
            parquet = pq.ParquetFile(os.path.join(path, entry.path))
            groups = [parquet.metadata.row_group(g).num_rows for g in range(parquet.metadata.num_row_groups)]
            layout.append((entry.path, entry.rows, entry.tokens, groups))
            table = parquet.read()
            for row in table.to_pylist():
                for name in table.column_names:
                    content.update(name.encode() + b"=" + _field_bytes(row[name]))
    return {
        "schema": [(f["name"], f["type"]) for f in manifest.schema],
        "layout": layout,
        "content_sha256": content.hexdigest(),
        "documents": manifest.documents,
    }


def dataset_bytes(path: str) -> dict[str, Any]:
    """The library-version-bound pins of a dataset: file bytes and fingerprints."""
    manifest = read_manifest(path)
    with open(os.path.join(path, MANIFEST_NAME), "rb") as fh:
        manifest_sha256 = hashlib.sha256(fh.read()).hexdigest()
    first = pq.ParquetFile(os.path.join(path, manifest.files[0].path))
    return {
        "dataset_fingerprint": manifest.dataset_fingerprint,
        "manifest_sha256": manifest_sha256,
        "file_sha256_16": {f.path: f.sha256[:16] for f in manifest.files},
        "created_by": first.metadata.created_by,
    }


# Guards the lane file format as the loader reads it: column names and types (manifest
# schema), which file of which lane each row is in, row and token counts, row-group sizes
# (epoch permutations shuffle row groups, so these are part of the stream), and every cell of
# every row in lane order (content_sha256: key, order_key, text, input_ids, num_tokens).
# None of it depends on the pyarrow version.
PINNED_CONTENT = {
    "text": {
        "schema": [("key", "string"), ("order_key", "uint64"), ("text", "string")],
        "layout": [
            ("lane=00000/part-00000.parquet", 6, None, [4, 2]),
            ("lane=00000/part-00001.parquet", 1, None, [1]),
            ("lane=00001/part-00000.parquet", 3, None, [3]),
            ("lane=00001/part-00001.parquet", 6, None, [4, 2]),
            ("lane=00002/part-00000.parquet", 7, None, [4, 3]),
            ("lane=00002/part-00001.parquet", 10, None, [4, 4, 2]),
            ("lane=00003/part-00000.parquet", 3, None, [3]),
            ("lane=00003/part-00001.parquet", 4, None, [4]),
        ],
        "content_sha256": "fe49df3bf5a25ec6f2efd854cf3767d178ce639718a219f917e31e227d089780",
        "documents": 40,
    },
    "pretokenized": {
        "schema": [
            ("key", "string"),
            ("order_key", "uint64"),
            ("text", "string"),
            ("input_ids", "binary"),
            ("num_tokens", "int32"),
        ],
        "layout": [
            ("lane=00000/part-00000.parquet", 6, 273, [4, 2]),
            ("lane=00000/part-00001.parquet", 1, 28, [1]),
            ("lane=00001/part-00000.parquet", 3, 317, [3]),
            ("lane=00001/part-00001.parquet", 6, 579, [4, 2]),
            ("lane=00002/part-00000.parquet", 7, 772, [4, 3]),
            ("lane=00002/part-00001.parquet", 10, 424, [4, 4, 2]),
            ("lane=00003/part-00000.parquet", 3, 183, [3]),
            ("lane=00003/part-00001.parquet", 4, 168, [4]),
        ],
        "content_sha256": "19d7e261b1dd42b3412ffc6b6368f6cc719894e86ba20c925ba725aa952cf8b9",
        "documents": 40,
    },
    "other_text": {
        "schema": [("key", "string"), ("order_key", "uint64"), ("text", "string")],
        "layout": [
            ("lane=00000/part-00000.parquet", 6, None, [3, 3]),
            ("lane=00001/part-00000.parquet", 5, None, [3, 2]),
            ("lane=00002/part-00000.parquet", 7, None, [3, 3, 1]),
            ("lane=00003/part-00000.parquet", 6, None, [3, 3]),
        ],
        "content_sha256": "2ab3572d07e15f199362b7104261f2c6999f1153a424f3790e6745b92ec4568b",
        "documents": 24,
    },
    "beam": {
        "schema": [
            ("key", "string"),
            ("order_key", "uint64"),
            ("text", "string"),
            ("input_ids", "binary"),
            ("num_tokens", "int32"),
        ],
        "layout": [
            ("lane=00000/part-00000.parquet", 6, 273, [6]),
            ("lane=00000/part-00001.parquet", 1, 28, [1]),
            ("lane=00001/part-00000.parquet", 3, 317, [3]),
            ("lane=00001/part-00001.parquet", 6, 579, [6]),
            ("lane=00002/part-00000.parquet", 7, 772, [7]),
            ("lane=00002/part-00001.parquet", 10, 424, [10]),
            ("lane=00003/part-00000.parquet", 3, 183, [3]),
            ("lane=00003/part-00001.parquet", 4, 168, [4]),
        ],
        "content_sha256": "19d7e261b1dd42b3412ffc6b6368f6cc719894e86ba20c925ba725aa952cf8b9",
        "documents": 40,
    },
}


@pytest.mark.beam
def test_lane_files_hold_the_pinned_content(datasets, beam_dataset) -> None:
    got = {name: dataset_content(path) for name, path in {**datasets, "beam": beam_dataset}.items()}
    assert got == PINNED_CONTENT
    # The Beam job and the factory hold the same rows in the same lanes (the factory's files
    # read like the job's): one pinned content digest for both, different row groups.
    assert got["beam"]["content_sha256"] == got["pretokenized"]["content_sha256"]
    assert [g for *_, g in got["beam"]["layout"]] != [g for *_, g in got["pretokenized"]["layout"]]


# Guards the exact bytes on disk (pyarrow 25.0.1): each Beam lane file's SHA-256 (first 16 hex
# digits), the manifest.json bytes, and the dataset fingerprint of every dataset (which hashes
# every file's SHA-256, the schema, the seed, L and the tokenizer fingerprint). Checkpoints
# store the dataset fingerprint and refuse a dataset whose fingerprint differs.
PINNED_BYTES = {
    "text": {
        "dataset_fingerprint": "4c697109f6706c131d7923259d6595e36fc2d2e98b49fb061212701bf9fe2a2d",
        "manifest_sha256": "5f110fcfc8f465ab6f6e4228ce243859cafbb735176e9849e1770ccc4f0b9480",
        "created_by": "parquet-cpp-arrow version 25.0.1",
    },
    "pretokenized": {
        "dataset_fingerprint": "f5e62887e6cf59b8ad030e764cec33a58361690638cdeeff0da4c9530ce2bf1b",
        "manifest_sha256": "532d49ad24cb2b0a4e7dc5be9dd849ecac8536cecfa1fcc7aabec15a7bdade2e",
        "created_by": "parquet-cpp-arrow version 25.0.1",
    },
    "other_text": {
        "dataset_fingerprint": "ba6f2c07a78464fb26bc972ad0368dca27319623f6c8adfbf4dfa6929c03f1ba",
        "manifest_sha256": "0a763ce24ce02b1ee0b95ae1f3f45ae9c233135b371dceeff306b657af8b34eb",
        "created_by": "parquet-cpp-arrow version 25.0.1",
    },
    "beam": {
        "dataset_fingerprint": "0b05bdfa40c465f319f8ba2ca88c803e3db7db7a1bf1b01932e0f985ba98f21f",
        # The one pin moved since d17fcff: pre-tokenized text manifests record longest_tokens (an
        # additive entry, outside the dataset fingerprint; without it the bytes are d17fcff's, as
        # test_the_manifest_pins_moved_only_by_longest_tokens shows).
        "manifest_sha256": "25f8747f3b12bfb722f4ba990706efc9d75c6c2cf0f85f5a4c637e2604f3dd4b",
        "file_sha256_16": {
            "lane=00000/part-00000.parquet": "fe76f8604e065395",
            "lane=00000/part-00001.parquet": "35b96dbb68665af8",
            "lane=00001/part-00000.parquet": "c68b410a66951540",
            "lane=00001/part-00001.parquet": "f3d76db86a4c9341",
            "lane=00002/part-00000.parquet": "e28bea0696d204a9",
            "lane=00002/part-00001.parquet": "9b01ff62413fd28e",
            "lane=00003/part-00000.parquet": "cd45c61dad4e2d1d",
            "lane=00003/part-00001.parquet": "82d999e8ef30c8b5",
        },
        "created_by": "parquet-cpp-arrow version 25.0.1",
    },
}


@pytest.mark.beam
def test_lane_file_bytes_and_dataset_fingerprints_keep_their_values(datasets, beam_dataset) -> None:
    require_pinned_libraries("pyarrow", "tokenizers")
    got = {name: dataset_bytes(path) for name, path in {**datasets, "beam": beam_dataset}.items()}
    for name in ("text", "pretokenized", "other_text"):  # the factory's files: fingerprints suffice
        got[name].pop("file_sha256_16")
    assert got == PINNED_BYTES


# manifest.json of the Beam dataset before it recorded longest_tokens (d17fcff).
MANIFEST_SHA256_BEFORE_LONGEST = "a0bd61f20bc4df2d744add739008bf2d1d2ea9972c372577fcc41ec816fb9eef"


def manifest_without_longest(path: str) -> tuple[int, str]:
    """``(longest recorded, SHA-256 of manifest.json without it)``: the entry removed, the rest
    serialised as the job writes it (``json.dumps(indent=1)``), after checking that this
    serialisation gives back the file's bytes with the entry (so nothing else could differ).
    """
    with open(os.path.join(path, MANIFEST_NAME), "rb") as fh:
        raw = fh.read()
    data = json.loads(raw)
    assert (json.dumps(data, indent=1) + "\n").encode() == raw
    longest = data.pop("longest_tokens")
    return longest, hashlib.sha256((json.dumps(data, indent=1) + "\n").encode()).hexdigest()


@pytest.mark.beam
def test_the_manifest_pins_moved_only_by_longest_tokens(beam_dataset) -> None:
    require_pinned_libraries("pyarrow", "tokenizers")
    longest, before = manifest_without_longest(beam_dataset)
    assert before == MANIFEST_SHA256_BEFORE_LONGEST
    manifest = read_manifest(beam_dataset)
    assert longest == manifest.longest_tokens == max(
        max(pq.read_table(os.path.join(beam_dataset, f.path), columns=["num_tokens"])["num_tokens"].to_pylist())
        for f in manifest.files)


# Guards the tokenizer fingerprint recorded in pre-tokenized manifests and in checkpoints
# (SHA-256 of tokenizers' serialisation of the shipped tokenizer.json).
PINNED_TOKENIZER_FINGERPRINT = "db68b1641bf7aa38456a559489ef25388443997c43a02b7feb5373711673621f"


def test_tokenizer_fingerprint_keeps_its_value() -> None:
    require_pinned_libraries("tokenizers")
    assert tokenizer_fingerprint(Tokenizer.from_file(default_tokenizer_path())) == PINNED_TOKENIZER_FINGERPRINT


# ---------------------------------------------------------------------------------------
# Batch fingerprints, batch fields and checkpoints of fixed configs.

# name -> (sources as (dataset, weight, source name), config overrides). Configs reading
# "text" are also run on "pretokenized" (the same lanes with input_ids): the same pins.
CONFIGS: dict[str, tuple[tuple[tuple[str, float, Optional[str]], ...], dict[str, Any]]] = {
    "concat": ((("text", 1.0, None),), dict(packing="concat")),
    "best_fit": ((("text", 1.0, None),), dict(packing="best_fit")),
    "concat_bos": ((("text", 1.0, None),), dict(packing="concat", add_bos=True)),
    "best_fit_bos": ((("text", 1.0, None),), dict(packing="best_fit", add_bos=True)),
    "mix_sequence": ((("text", 0.7, "main"), ("other_text", 0.3, "other")),
                     dict(packing="concat", schedule=[{"step": 4, "weights": {"main": 0.4, "other": 0.6}}])),
    "mix_token": ((("text", 0.6, "main"), ("other_text", 0.4, "other")),
                  dict(packing="best_fit", mixing_unit="token")),
    "beam_concat": ((("beam", 1.0, None),), dict(packing="concat")),
}


def golden_config(datasets: dict[str, str], name: str, *, pretokenized: bool = False) -> LoaderConfig:
    sources, overrides = CONFIGS[name]
    entries = []
    for dataset, weight, source_name in sources:
        if pretokenized and dataset == "text":
            dataset = "pretokenized"
        entry: dict[str, Any] = {"path": datasets[dataset], "weight": weight}
        if source_name is not None:
            entry["name"] = source_name
        entries.append(entry)
    fields = dict(datasets=entries, seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                  seed=LOADER_SEED, tokenizer=default_tokenizer_path(), best_fit_open_bins=OPEN_BINS,
                  num_workers=0, prefetch=2)
    fields.update(overrides)
    return LoaderConfig(**fields)


def fingerprint_run(config: LoaderConfig) -> tuple[list[str], dict]:
    """The fingerprint lines of steps 0..LATER_STEP and the merged state before step LATER_STEP."""
    results, state = collect_fingerprints(config, world_size=1, end_step=LATER_STEP + 1,
                                          save_state_step=LATER_STEP)
    return [r.line() for r in results], state


def pinned_lines(lines: list[str]) -> dict[str, Any]:
    return {"first": lines[:FIRST_STEPS], "later": lines[LATER_STEP]}


def lane_epochs(state: dict) -> dict[str, list[int]]:
    """Per lane, the epoch of every source's read cursor (``{"epoch", "block", ...}``) in its state."""

    def cursors(node: Any) -> list[int]:
        if isinstance(node, dict):
            own = [node["epoch"]] if {"epoch", "block"} <= set(node) else []
            return own + [e for key in sorted(node) for e in cursors(node[key])]
        if isinstance(node, list):
            return [e for item in node for e in cursors(item)]
        return []

    return {lane: cursors(lane_state) for lane, lane_state in state["lanes"].items()}


class FingerprintRuns(dict):
    """(config name, pretokenized) -> :func:`fingerprint_run`, computed on first use."""

    def __init__(self, paths: dict[str, str]) -> None:
        super().__init__()
        self.paths = paths

    def __missing__(self, key: tuple[str, bool]) -> tuple[list[str], dict]:
        name, pretokenized = key
        self[key] = fingerprint_run(golden_config(self.paths, name, pretokenized=pretokenized))
        return self[key]


@pytest.fixture(scope="module")
def runs(datasets) -> FingerprintRuns:
    return FingerprintRuns(dict(datasets))


# Guards the global batches (the `zephon fingerprints` lines: "STEP SHA256 [name=count ...]")
# of steps 0..5 and of step LATER_STEP, which every lane of every source reaches in a later
# epoch (checked below): packing, BOS/EOS placement, labels, epoch permutations, mixing.
PINNED_FINGERPRINTS = {
    "beam_concat": {
        "first": [
            "0 a6e573f7cdae680c56abff5b01a8f8789d7dbd36f076f3ac0e0338849a1740e8",
            "1 35c7bca2cd76cac776cc95d9b796a05f0fc4f82a6054e28ca263422fb2d8b915",
            "2 9d826663fff32a2cadc467ec3d5dcfe1c14cdc2fa2a0b6b93f94dd977e5c1267",
            "3 d6bd7f0e6c656a3c701ec666d6b6c9429e700c5506993769519c03e689003ca3",
            "4 9a8fb38e3b5f501636c63401edd827d2f33df2f8e8861d5e3b5df99cd99d2640",
            "5 3c169a0191d672d6c41091b72a3005192b3c41a656783e75699e3f58fe09eb8a",
        ],
        "later": "40 81a3d12b8329c43db6aba261c9e30c028fc5655355799b8d4f1a3a3b2d13abbc",
    },
    "best_fit": {
        "first": [
            "0 8ff4bbbc855381d002ff42f01daa6e7a61a5d57a386f8830f313e1a0bf97057a",
            "1 1445ff881bc66dbcce3614bf74a66822507205b6ac76165b2e1b343d801f1dfd",
            "2 bd982e7f8bc9f7d4a9206c1759a62ad60e1267bd7339bdd02585f0292b2bf304",
            "3 810db5060b092bdc6a19736c64d3f79fd3a09202a2fb14c06465aec8968c8ec6",
            "4 6a2756cd7a51e99c789f5c48172e6084c654a0c9c3154315daa62cbfcbb90567",
            "5 b4546e8ef86f77ab141beef236d0262c33af289c8367f0d11a73b37868b9005c",
        ],
        "later": "40 95f5920e5e53fa79f68d9290c15778084e564c977908a8150fdbf1e79f356fbe",
    },
    "best_fit_bos": {
        "first": [
            "0 34d85455689acab900d8736502fd28f369b6bdafb6bcc2cf4b9076defc696b8a",
            "1 af7f677547e63fe04de5d6cba6ec4ade8e700892166066adb3b214ab14415927",
            "2 222f1d3ccc5e0c3a3be06078f0b5ba3af04d183709e11ee4be0dcd4f3174e7e8",
            "3 9d1d65ecdb36c34044336f12a92c70a767c8578b90dc6afbf68a08233fd70a59",
            "4 79781b95aff10806e20f694d8fbcb969c212266a24ace358b67b46ebdda729ea",
            "5 1bc5be43f95bfefd01d6fe048aa1ac47fd4867a82af7bdb611508982effba01f",
        ],
        "later": "40 0ca3bead34bbbefbcf6c0b95d1538ab54ecc3f808a67ca107b53a687545c2d5d",
    },
    "concat": {
        "first": [
            "0 a6e573f7cdae680c56abff5b01a8f8789d7dbd36f076f3ac0e0338849a1740e8",
            "1 35c7bca2cd76cac776cc95d9b796a05f0fc4f82a6054e28ca263422fb2d8b915",
            "2 0a9bba358d2e2b941dee4f8a254679fdd34be8faedc494a148fd67c2f0d5cfae",
            "3 91829db95edef1b1560bf5bab4325827232ae8fcffee38ab1f3f572b0e593a67",
            "4 9a8fb38e3b5f501636c63401edd827d2f33df2f8e8861d5e3b5df99cd99d2640",
            "5 1add3f39f3eb49a4f17e0755dfdb8b625ea9d64330fd6e5f7805c774c4c41ddc",
        ],
        "later": "40 c0a7571d42718b36335b0f2f14badf0569d8409b2d63240c7cb85eb6c5db07c7",
    },
    "concat_bos": {
        "first": [
            "0 c0f4b30c743283a95c2d08becb83836b113adce83f4274348ad1a0b9b06b63be",
            "1 0215e56d73c7ee0ae6574b738ed9690d72c2c0d88288ce881a7b26a8d643072c",
            "2 ac24ef6692da5d7abaf34305073048693ebe31e2f915b71dbfa5b99687d1a9a0",
            "3 394d114364e581059801eca7b1c67203eab35e4f7e5c39f059b226a64fb5ae21",
            "4 cd2f9e304e32d9e7f2f1a969620347419754c6e420e6fcf27607a7b970a526aa",
            "5 3b724fabf42adfd374abd76ee40032b7a0a9b04143972ded767582b57b2c3d9f",
        ],
        "later": "40 4cdce119b618726c95ed23b5b60f2bd4979f2017ba1eec4bc4a328bdc80b1487",
    },
    "mix_sequence": {
        "first": [
            "0 a674e75290c6c47c067234cb51c2311356e3e8fa883f46f0b653ffb89e1064a2 main=5 other=3",
            "1 fb336f737948907e9c414baba19943ef61f1f2126a3cdccae290687ca52560aa main=6 other=2",
            "2 56a2ff75fe53f47b028636584ea025e6a11f8c4fc078d35cd4579fec285c5406 main=5 other=3",
            "3 9a4a9b9a2798904e2a14ca0605a60c4d7b764ec325da3d1b5d25e01b2c92cade main=6 other=2",
            "4 bebb996191f8769bfb76cf54bb2d029e395b6873a33d281614c23d65a1d9b04c main=4 other=4",
            "5 e01049d944d1af17c64d1cbc1008d550dbd686a6b9c21dbe33e961b33bbe5e50 main=3 other=5",
        ],
        "later": "40 e7a78133a0b4d9dfe629ad504f2b50690215de3a638a8fec164dfa0b895538b7 main=3 other=5",
    },
    "mix_token": {
        "first": [
            "0 8ad887ec86cd01aed41778e5acd688037e6ad844babec83925515a012354102d main=6 other=2",
            "1 a28563a9ab73d2918059c5d6dbfa832d6bba382c19a359729c529a7cfc49215b main=4 other=4",
            "2 807faa4115f6272bd2ad1a0ab3d54bdbdbf3b0bfb218835b1f5973187ed0aab6 main=0 other=8",
            "3 aaed06be44ee0155293c9243caf260024e7f32dbc2cd789265fce98ba74621bf main=3 other=5",
            "4 19b901502cfccc4581a5ffda41dfb805c3dc4d7647e222be1946f568deb4ac25 main=3 other=5",
            "5 7269dc9d6105199e3cad27b95c4fa8961f3fe31c5c3b43fdc7272298d3e93180 main=3 other=5",
        ],
        "later": "40 9e739801c65551f52d46e8291903c240776072157dff1127886314117a984fc4 main=7 other=1",
    },
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.beam) if n.startswith("beam") else n
                                  for n in sorted(CONFIGS)])
def test_batch_fingerprints_keep_their_values(request, runs, name) -> None:
    if name.startswith("beam"):
        runs.paths["beam"] = request.getfixturevalue("beam_dataset")
    lines, state = runs[(name, False)]
    assert pinned_lines(lines) == PINNED_FINGERPRINTS[name]
    assert len(set(lines)) == len(lines)  # the steps really differ
    epochs = lane_epochs(state)
    # The state before step LATER_STEP: every source of every lane has started a later epoch.
    assert all(min(e) >= 1 for e in epochs.values()), f"LATER_STEP is not past every lane's epoch edge: {epochs}"
    if any(dataset == "text" for dataset, _, _ in CONFIGS[name][0]):
        pre_lines, _ = runs[(name, True)]
        assert pre_lines == lines, "the same lanes pre-tokenized must give the same batches as text lanes"


def batch_field_digests(config: LoaderConfig, *, world_size: int = 1, steps: int = LATER_STEP + 1) -> dict:
    """Per rank, a SHA-256 of every field of every micro-batch of ``steps`` steps, and its dtype.

    Per micro-batch a tensor field adds ``dtype shape;`` then its values as little-endian
    bytes; an int field (step, micro_step) adds its decimal value.
    """
    result = {}
    for rank in range(world_size):
        digests: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        with ZephonLoader(config, rank=rank, world_size=world_size) as loader:
            for _ in range(steps * loader.topology.micro_steps_per_step):
                for name, value in next(loader).items():
                    digest = digests.setdefault(name, hashlib.sha256())
                    if isinstance(value, int):
                        kinds[name] = "int"
                        digest.update(f"{value};".encode())
                    else:
                        array = value.numpy()
                        kinds[name] = array.dtype.name
                        digest.update(f"{array.dtype.name} {array.shape};".encode())
                        digest.update(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
        result[rank] = {name: (kinds[name], digest.hexdigest()[:32]) for name, digest in sorted(digests.items())}
    return result


FIELD_RUNS = {  # name -> (config, world size)
    "concat": ("concat", 1),
    "best_fit": ("best_fit", 1),
    "mix_token": ("mix_token", 1),  # the only config with token_source_ids
    "concat_w2": ("concat", 2),  # which micro-batches rank 0 and rank 1 receive
}

# Guards every field a trainer receives, per rank, over steps 0..LATER_STEP: the dtype and a
# digest (first 32 hex digits of SHA-256) of input_ids, labels, position_ids, cu_seqlens,
# token_source_ids, source_ids, global_indices, step and micro_step.
PINNED_FIELDS = {
    "best_fit": {
        0: {
            "cu_seqlens": ("int32", "73894050fb5dfbe04bfcaf704d5b2069"),
            "global_indices": ("int64", "a6fbdf897c5b87e143a09b9f35d0e70f"),
            "input_ids": ("int64", "a7454f1c7eadf8d5e0f459cb72bba2d2"),
            "labels": ("int64", "f297ea842499dad5cd7c89b0eb800bc0"),
            "micro_step": ("int", "1c4b546873400fabf50c4e3535cec81f"),
            "position_ids": ("int64", "7b305b8010b3c83c5067856191040982"),
            "source_ids": ("int64", "ecff1bc776cfade62d71aacac90820e0"),
            "step": ("int", "cb2f5c3725807d20ee8d288448675bba"),
        },
    },
    "concat": {
        0: {
            "cu_seqlens": ("int32", "6c691a0261b49dcc3dd73ba24b84fa90"),
            "global_indices": ("int64", "a6fbdf897c5b87e143a09b9f35d0e70f"),
            "input_ids": ("int64", "872e7f575f8279e089a1e2fb2032b851"),
            "labels": ("int64", "7f1c06e0d8c94bc6844cdc4249dc83b0"),
            "micro_step": ("int", "1c4b546873400fabf50c4e3535cec81f"),
            "position_ids": ("int64", "aaa8e1b8f4b8bcc082d056de788416d2"),
            "source_ids": ("int64", "ecff1bc776cfade62d71aacac90820e0"),
            "step": ("int", "cb2f5c3725807d20ee8d288448675bba"),
        },
    },
    "concat_w2": {
        0: {
            "cu_seqlens": ("int32", "6d336c893f93399f839e1aaad280ab8b"),
            "global_indices": ("int64", "bcaef63f9597a61498fe26c58393e6f1"),
            "input_ids": ("int64", "0f9af17deeaf85022094ef9a282383fb"),
            "labels": ("int64", "8c2c78a7e543ca8036bc962b47dd4077"),
            "micro_step": ("int", "d80fdda65ec9d1914ba1804d9da87da0"),
            "position_ids": ("int64", "eeb0827f96066f8f7d5de6b6e3c5ce94"),
            "source_ids": ("int64", "560d60db9f1114a3fedaf8f8de3b3e09"),
            "step": ("int", "3fd8617c63b274a250a83b2fd031a85e"),
        },
        1: {
            "cu_seqlens": ("int32", "ac28b66701b2784679804f7c3aa7338e"),
            "global_indices": ("int64", "61efa5f481d3d8e9370c0ddfeea70114"),
            "input_ids": ("int64", "554e6fdef84cd10c38bb2978179f70cc"),
            "labels": ("int64", "ec83fea56f19604344d0158f1bf130dc"),
            "micro_step": ("int", "d80fdda65ec9d1914ba1804d9da87da0"),
            "position_ids": ("int64", "6102f2e51ce5d175aad38b1acaea7882"),
            "source_ids": ("int64", "560d60db9f1114a3fedaf8f8de3b3e09"),
            "step": ("int", "3fd8617c63b274a250a83b2fd031a85e"),
        },
    },
    "mix_token": {
        0: {
            "cu_seqlens": ("int32", "352206bb48077de93ab731281506326c"),
            "global_indices": ("int64", "a6fbdf897c5b87e143a09b9f35d0e70f"),
            "input_ids": ("int64", "14cf0fef97d175a785ad94b3b237e109"),
            "labels": ("int64", "95b0fe03dd8749a6f5b62e1b6b9c842f"),
            "micro_step": ("int", "1c4b546873400fabf50c4e3535cec81f"),
            "position_ids": ("int64", "98832ab30c995bf3235f788d7e871452"),
            "source_ids": ("int64", "db77a1d20efa7f090d40990e4f9af875"),
            "step": ("int", "cb2f5c3725807d20ee8d288448675bba"),
            "token_source_ids": ("int64", "25bc24d3078aaac32e6e405dd39b0d39"),
        },
    },
}


@pytest.mark.parametrize("run", sorted(FIELD_RUNS))
def test_every_batch_field_keeps_its_values(datasets, run) -> None:
    name, world_size = FIELD_RUNS[run]
    assert batch_field_digests(golden_config(datasets, name), world_size=world_size) == PINNED_FIELDS[run]


def masked_state_bytes(state: dict) -> bytes:
    """``dumps(state)`` with the library-version-bound fingerprints replaced by placeholders."""
    masked = json.loads(dumps(state))
    masked["tokenizer_fingerprint"] = "<tokenizer>"
    for source in masked["sources"]:
        source["dataset_fingerprint"] = f"<{source['name']}>"
    return dumps(masked).encode()


def checkpoint_values(state: dict) -> dict[str, Any]:
    return {
        "bytes_sha256": hashlib.sha256(dumps(state).encode()).hexdigest(),
        "masked_sha256": hashlib.sha256(masked_state_bytes(state)).hexdigest(),
        "next_global_index": state["next_global_index"],
        "config": state["config"],
        "config_fingerprint": state["config_fingerprint"],
        "lane_epochs": lane_epochs(state),
        "lane_00000": state["lanes"]["00000"] if state["config"]["packing"] == "concat" else None,
    }


CHECKPOINT_CONFIGS = ("concat", "best_fit", "mix_sequence", "mix_token")

# Guards the checkpoint a user saves after LATER_STEP steps (merge_rank_states, then
# loader.checkpoint.state.dumps): masked_sha256 covers every byte but the library-bound fingerprints,
# bytes_sha256 every byte (pyarrow and tokenizers versions checked); the rest, for readability,
# names a few fields literally (a concat lane's state is a cursor; best-fit lanes hold tokens).
# Re-pinned with state version 2 (loader.checkpoint.migrations): the version-1 pins of commit
# 4c2250e are the bytes of these states with "version" 1 and every bin's piece_origins removed
# (test_version_2_changed_only_the_version_and_piece_origins), so nothing else moved. Re-pinned
# with state version 3: the version-2 pins of commit dbee1d1 are these states with "version" 2
# and every cursor's document removed (test_version_3_changed_only_the_version_and_documents).
PINNED_CHECKPOINTS = {
    "concat": {
        "bytes_sha256": "502b9ac8a6e5e4f4e378c7c271ed4c7798c0eae536932ca34860bf7cd4bd03de",
        "masked_sha256": "6d8b371e59ccf4df1f479419e31bed07958a01427981bb138e3c018d6cc5df33",
        "next_global_index": 320,
        "config": {
            "seed": 11,
            "seq_len": 64,
            "global_batch_size": 8,
            "packing": "concat",
            "best_fit_open_bins": None,
            "add_bos": False,
            "add_eos": True,
            "mixing_unit": None,
        },
        "config_fingerprint": "1feb918f063e6d73b18cce2cc1e3ffd66ddb735813ce95c689547f98d36b74f3",
        "lane_epochs": {"00000": [16], "00001": [5], "00002": [4], "00003": [14]},
        "lane_00000": {
            "outputs": 80,
            "sources": {
                "synthetic": {
                    "packer": {"stream": {"epoch": 16, "block": 1, "offset": 50, "exhausted": False,
                                          "document": {"index": 2, "token_start": 43, "char_start": 85}}},
                    "stopped": False,
                },
            },
        },
    },
    "best_fit": {
        "bytes_sha256": "828970f54bb37f8a045dbc819aca87a9adeb77b2909984df81e3516c63a540a8",
        "masked_sha256": "e3286a2fe272d3fa8521995032ee56fc120e50ea25473e0915d27c73cb4d18e4",
        "next_global_index": 320,
        "config": {
            "seed": 11,
            "seq_len": 64,
            "global_batch_size": 8,
            "packing": "best_fit",
            "best_fit_open_bins": 4,
            "add_bos": False,
            "add_eos": True,
            "mixing_unit": None,
        },
        "config_fingerprint": "15ef19c4fc9d8aeec3a0c67f7cbe3c6437d850d866e02d7f455954c687caf55c",
        "lane_epochs": {"00000": [16], "00001": [5], "00002": [4], "00003": [13]},
        "lane_00000": None,
    },
    "mix_sequence": {
        "bytes_sha256": "07fabd38f98f8db026fe9d8761f480c77c93e0e0285baed56185586ccb06d06f",
        "masked_sha256": "6a606a799dfc614692a7331b5b2af0213e416144e55a8acd370cdd3ace1c23e9",
        "next_global_index": 320,
        "config": {
            "seed": 11,
            "seq_len": 64,
            "global_batch_size": 8,
            "packing": "concat",
            "best_fit_open_bins": None,
            "add_bos": False,
            "add_eos": True,
            "mixing_unit": "sequence",
        },
        "config_fingerprint": "74762535ac48e4044775362d00891337bbcc3e8a0ae8b70768a6c5848bd14224",
        "lane_epochs": {"00000": [7, 3], "00001": [2, 5], "00002": [1, 3], "00003": [7, 5]},
        "lane_00000": {
            "outputs": 80,
            "sources": {
                "main": {
                    "packer": {"stream": {"epoch": 7, "block": 2, "offset": 105, "exhausted": False,
                                          "document": {"index": 2, "token_start": 94, "char_start": 201}}},
                    "stopped": False,
                },
                "other": {
                    "packer": {"stream": {"epoch": 3, "block": 0, "offset": 522, "exhausted": False,
                                          "document": {"index": 1, "token_start": 350, "char_start": 810}}},
                    "stopped": False,
                },
            },
        },
    },
    "mix_token": {
        "bytes_sha256": "6ec87bd6b9f886403206b3f9bac9c6a88698d6dfafb66552b6acd50d6a31acfc",
        "masked_sha256": "05ccd11acd0b27c1db67539010c3395aae6cffdeecb14a8e8dbfe3391ad38d42",
        "next_global_index": 320,
        "config": {
            "seed": 11,
            "seq_len": 64,
            "global_batch_size": 8,
            "packing": "best_fit",
            "best_fit_open_bins": 4,
            "add_bos": False,
            "add_eos": True,
            "mixing_unit": "token",
        },
        "config_fingerprint": "e034ad9bcf58dd32ea949e5771879c84cc0848cdacac2705530e23d1c5e1ad82",
        "lane_epochs": {"00000": [9, 2], "00001": [3, 3], "00002": [2, 1], "00003": [8, 4]},
        "lane_00000": None,
    },
}


@pytest.mark.parametrize("name", CHECKPOINT_CONFIGS)
def test_checkpoint_json_keeps_its_bytes(runs, name) -> None:
    _, state = runs[(name, False)]
    got = checkpoint_values(state)
    pinned = dict(PINNED_CHECKPOINTS[name])
    full_sha256 = pinned.pop("bytes_sha256")
    assert {k: v for k, v in got.items() if k != "bytes_sha256"} == pinned
    require_pinned_libraries("pyarrow", "tokenizers")
    assert got["bytes_sha256"] == full_sha256


# The version-1 pins (commit 4c2250e), before piece_origins: a version-2 state with "version" 1
# and its bins' piece_origins removed must still be these bytes.
PINNED_VERSION_1_MASKED = {
    "concat": "caccb2cbe79d27bdeab830013b58fcc945f6a83bfabaca84dc77cc0816be6989",
    "best_fit": "c2960cbe11926ff04d3551b45b7be3f72603e04180a4cc31885d2951ec7bd584",
    "mix_sequence": "3e47ea461e6e7b4bf636b9aa732461f0df757775f854df0d3855f1e426d99893",
    "mix_token": "4a8da232463a217532ca1e180dc9cf14616912aa4dd07f9a6c0a29a333a89fdf",
}


def without_documents(state: dict) -> tuple[dict, int]:
    """A copy of ``state`` with every cursor's ``document`` (version 3) removed, and how many."""
    copy = json.loads(dumps(state))
    removed = 0
    for lane in copy["lanes"].values():
        packers = [lane["mixed"]] if "mixed" in lane else [s["packer"] for s in lane["sources"].values()]
        for packer in packers:
            stream = packer["stream"]
            for cursor in stream["sources"] if "sources" in stream else [stream]:
                removed += cursor.pop("document", None) is not None
    return copy, removed


# The version-2 pins (commit dbee1d1), before text cursors said their document: a version-3
# state with "version" 2 and its cursors' documents removed must still be these bytes.
PINNED_VERSION_2_MASKED = {
    "concat": "fffa77e6fadfe79920e97128d2045a4b1ad5ccfa5e9711b814cb1e896631e8f7",
    "best_fit": "9fa2028e334ffd940da2dca41041d5fdb35a3592bda120760bc25852f3f8909e",
    "mix_sequence": "409569151350baa6f4e80841a241c3685945604298dba152bd69287c7fc01348",
    "mix_token": "181e008174f2f5147eb25e3f86b0897b2ccdb4ee1644d30a5da7459f02ffa0ca",
}


@pytest.mark.parametrize("name", CHECKPOINT_CONFIGS)
def test_version_3_changed_only_the_version_and_documents(runs, name) -> None:
    _, state = runs[(name, False)]
    assert state["version"] == 3
    as_v2, documents = without_documents(state)
    assert documents > 0  # the golden sources are text: their cursors say where they are
    as_v2["version"] = 2
    assert hashlib.sha256(masked_state_bytes(as_v2)).hexdigest() == PINNED_VERSION_2_MASKED[name]


@pytest.mark.parametrize("name", CHECKPOINT_CONFIGS)
def test_version_2_changed_only_the_version_and_piece_origins(runs, name) -> None:
    _, state = runs[(name, False)]
    as_v1, _ = without_documents(state)
    as_v1["version"] = 1
    origins = 0
    for lane in as_v1["lanes"].values():
        packers = [lane["mixed"]] if "mixed" in lane else [s["packer"] for s in lane["sources"].values()]
        for packer in packers:
            for bin_ in packer.get("bins", []):
                assert len(bin_.pop("piece_origins")) == len(bin_["piece_starts"])  # every bin says
                origins += 1
    assert (origins > 0) == (state["config"]["packing"] == "best_fit")
    assert hashlib.sha256(masked_state_bytes(as_v1)).hexdigest() == PINNED_VERSION_1_MASKED[name]
