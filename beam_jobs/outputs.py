"""The output directory of the sharding job: overwrite rules, rejected records, the manifest.

Order of writes (``manifest.json`` is the commit marker, so it is always last)::

    prepare_output   refuse an existing dataset, or with --overwrite delete in this order:
                     manifest.json, manifest.json.inprogress, lane=*/, _rejected/
    WriteLaneFiles   lane=LLLLL/part-PPPPP.parquet      (each: .inprogress, then rename)
    WriteRejected    _rejected/rejected-FFFFF.jsonl     (FFFFF = input file index)
    CommitManifest   checks the reject fraction, then manifest.json (.inprogress, rename)

When the reject fraction exceeds ``--max-reject-fraction``, or a lane received no document
(the loader cannot read a dataset with an empty lane), the job fails in ``CommitManifest``:
lane files and ``_rejected/`` stay for inspection, but without a manifest the directory is
not a dataset, and a re-run needs ``--overwrite``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Iterable, Iterator, Optional, Sequence

import apache_beam as beam

from beam_jobs import job_files
from beam_jobs.job_files import INPROGRESS_SUFFIX
from beam_jobs.transform_steps import add_entry_counts
from loader.chat.record import ChatRecord
from loader.errors import OutputExistsError, ShardJobError
from loader.errors import JOB_ERROR_PREFIX  # noqa: F401  (also importable from here)
from loader.io.backends import is_remote
from loader.io.manifest import DOCUMENT_REJECT_REASONS, MANIFEST_NAME, REJECTED_DIR, FileEntry, Manifest
from loader.io.storage_options import StorageOptions
from loader.vision.record import ImagesRecord

logger = logging.getLogger(__name__)

DEDUP_DIR = "_dedup"  # --dedup: the list of removed documents (beam_jobs.dedup)

REJECTED_FILE_FORMAT = "rejected-{file_index:05d}.jsonl"


def is_local(path: str) -> bool:
    return not is_remote(path)


def join_output(output: str, relative_path: str) -> str:
    if is_local(output):
        return os.path.join(output, *relative_path.split("/"))
    return output.rstrip("/") + "/" + relative_path


def write_atomically(path: str, data: bytes, storage_options: StorageOptions) -> None:
    """``data`` under ``path``, never half-written under that name (:func:`beam_jobs.job_files.write_atomically`)."""
    job_files.write_atomically(path, data, storage_options)


# ---------------------------------------------------------------------------------------
# Existing output.


def existing_dataset_parts(output: str, storage_options: StorageOptions = StorageOptions()) -> list[str]:
    """What of a (possibly partial) dataset exists at ``output``, as relative names."""
    if is_local(output):
        if not os.path.isdir(output):
            return []
        names = sorted(os.listdir(output))
        return [n for n in names if n in (MANIFEST_NAME, MANIFEST_NAME + INPROGRESS_SUFFIX, REJECTED_DIR, DEDUP_DIR)
                or n.startswith("lane=")]
    found = []
    for pattern in (MANIFEST_NAME, MANIFEST_NAME + INPROGRESS_SUFFIX, "lane=*/*", REJECTED_DIR + "/*", DEDUP_DIR + "/*"):
        found += [path[len(output.rstrip("/")) + 1:] for path in job_files.match(join_output(output, pattern), storage_options)]
    return sorted(found)


def prepare_output(output: str, overwrite: bool, *, storage_options: StorageOptions = StorageOptions()) -> None:
    """Refuse to write into an existing dataset unless ``overwrite``; then clear it.

    The old manifest goes first, so an interrupted clean-up never leaves a manifest that
    points at deleted files.
    """
    existing = existing_dataset_parts(output, storage_options)
    if not existing:
        return
    if not overwrite:
        shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
        raise OutputExistsError(
            f"--output {output} already holds a dataset or part of one ({shown}); "
            "pass --overwrite to replace it, or choose another --output."
        )
    logger.info("--overwrite: removing the old dataset at %s", output)
    ordered = sorted(existing, key=lambda name: (not name.startswith(MANIFEST_NAME), name))
    for name in ordered:
        path = join_output(output, name)
        if is_local(output):
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        else:
            job_files.delete(path, storage_options)


# ---------------------------------------------------------------------------------------
# Rejected records.


def rejection_to_json(rejection: tuple) -> str:
    _file_index, input_path, record_index, reason, detail, excerpt = rejection
    return json.dumps(
        {"input_file": input_path, "record_index": record_index, "reason": reason,
         "detail": detail, "excerpt": excerpt},
        ensure_ascii=False,
    )


class WriteRejectedFn(beam.DoFn):
    """``(file_index, rejections)`` -> ``_rejected/rejected-FFFFF.jsonl`` sorted by record index."""

    def __init__(self, output: str, *, storage_options: StorageOptions = StorageOptions()):
        self.output = output
        self.storage_options = storage_options

    def process(self, element: tuple) -> Iterator[str]:
        file_index, rejections = element
        ordered = sorted(rejections, key=lambda r: (r[2], r[3], r[4]))
        body = "".join(rejection_to_json(r) + "\n" for r in ordered)
        # Lone surrogates can only come from the excerpt of a bad record; keep them visible.
        relative_path = f"{REJECTED_DIR}/{REJECTED_FILE_FORMAT.format(file_index=file_index)}"
        write_atomically(join_output(self.output, relative_path), body.encode("utf-8", "backslashreplace"),
                         self.storage_options)
        yield relative_path


# ---------------------------------------------------------------------------------------
# The manifest.


def _by_reason(rejected: dict[str, int]) -> str:
    return ", ".join(f"{reason}={count}" for reason, count in sorted(rejected.items()) if count)


def check_reject_fraction(documents: int, rejected: dict[str, int], max_reject_fraction: float) -> None:
    total_rejected = sum(rejected.values())
    records = documents + total_rejected
    if records == 0:
        raise ShardJobError("the input holds no records (every input file is empty); nothing to shard.")
    if documents == 0:
        raise ShardJobError(
            f"none of the {records} input records is a valid document ({_by_reason(rejected)}); see "
            "_rejected/*.jsonl in the output and check --text-field / --format. No manifest.json was written."
        )
    fraction = total_rejected / records
    if fraction > max_reject_fraction:
        raise ShardJobError(
            f"{total_rejected} of {records} input records were rejected ({fraction:.2%}: {_by_reason(rejected)}), "
            f"more than --max-reject-fraction={max_reject_fraction}. See _rejected/*.jsonl in the "
            "output for each record's file, index and reason; fix the input or the field options "
            "(--text-field, --id-field, --format), or raise --max-reject-fraction. No manifest.json was written."
        )


def divisors_descending(number: int) -> list[int]:
    small = [d for d in range(1, int(number ** 0.5) + 1) if number % d == 0]
    return sorted(set(small) | {number // d for d in small}, reverse=True)


def check_every_lane_has_documents(lanes_with_documents: Iterable[int], num_lanes: int, documents: int) -> None:
    """Fail unless each of the ``num_lanes`` lanes holds a document, suggesting a lane count that works.

    The loader serves global sequence ``i`` from lane ``i mod L``, so an empty lane can never
    serve its sequences: it is refused there, and a dataset with one is never committed.
    The suggestion is exact, not a guess: a document's lane under a divisor ``d`` of ``L`` is
    ``H mod d = (H mod L) mod d``, so the lanes that would be filled under ``d`` follow from
    the ones filled under ``L``.
    """
    filled = set(lanes_with_documents)
    if len(filled) == num_lanes:
        return
    if not filled:
        raise ShardJobError(
            f"no lane received a document ({documents} documents in all): every record was rejected or dropped by "
            "a transform (see the manifest's rejects and the job's summary); check the input, the filters and "
            "--max-reject-fraction. No manifest.json was written.")
    suggestion = next(d for d in divisors_descending(num_lanes) if len({lane % d for lane in filled}) == d)
    raise ShardJobError(
        f"only {len(filled)} of the {num_lanes} lanes received a document ({documents} documents in all), "
        f"and the loader needs a document in every lane (lane i mod L serves global sequence i). "
        f"Re-run with --num-lanes {suggestion} --overwrite (the largest divisor of {num_lanes} whose every "
        "lane gets a document with this input and --seed), or shard more documents. "
        "No manifest.json was written."
    )


def commit_manifest(
    file_entries: list[dict],
    *,
    output: str,
    seed: int,
    num_lanes: int,
    source_name: str,
    schema: list[dict[str, str]],
    tokenizer: Optional[dict],
    max_reject_fraction: float,
    files_per_lane: int,
    reject_counts: dict[str, int],
    rejected_files: Iterable[str],
    reject_reasons: Sequence[str] = DOCUMENT_REJECT_REASONS,
    chat: Optional[dict] = None,
    curation: Optional[dict] = None,
    images: Optional[dict] = None,
    lane_assignment: Optional[str] = None,
    storage_options: StorageOptions = StorageOptions(),
    kind: Optional[str] = None,
) -> dict:
    """Check the reject fraction, then write ``manifest.json`` atomically. Returns its dict.

    ``rejected_files`` is unused except as a side input: it makes this step wait until
    every rejected-records file is written. ``reject_reasons``: the reasons this job can emit,
    each recorded with its count (zeros included): the document reasons for a text job, every
    reason of :data:`loader.io.manifest.REJECT_REASONS` for a chat job. ``chat``: the manifest's
    ``chat`` entry of a chat job (:class:`loader.io.manifest.ChatRecord` as a dict).
    ``curation``: the ``transforms`` / ``dedup`` entries of :mod:`beam_jobs.curation`, written
    into the manifest next to ``rejected`` (documents they dropped are not rejects; the reject
    fraction is over every record read).
    ``images``: the manifest's ``images`` entry of an image job
    (:class:`loader.vision.record.ImagesRecord` as a dict); its count is summed here from the
    entries' ``images`` (what ``WriteLaneFiles`` adds to each entry of an image job).
    """
    del rejected_files
    # lane_assignment: "balanced" where the job dealt documents by rank (beam_jobs.lane_balance)
    # kind: the named lane kind of a --kind job (loader.kinds.base), the manifest's "kind" entry
    if chat is not None and chat.get("tokenized"):  # the longest conversation, exactly (loader.chat.block)
        chat = {**chat, "longest_tokens": max((int(e.get("longest_tokens", 0)) for e in file_entries), default=0) or None}
    # pre-tokenized text: its longest document, exactly (loader.overlong); chat records it in its entry
    longest = max((int(e.get("longest_tokens", 0)) for e in file_entries), default=0) or None \
        if tokenizer is not None and chat is None and images is None and kind is None else None
    if images is not None:
        images = {**images, "images": sum(int(entry.get("images", 0)) for entry in file_entries)}
    files = [FileEntry.from_dict(entry, f"file entry {entry.get('path')}") for entry in file_entries]
    curation = dict(curation or {})
    tombstones = sum(int(entry.get("tombstones", 0)) for entry in file_entries)  # --transform: dropped rows
    if "transforms" in curation:
        curation["transforms"] = [dict(t) for t in curation["transforms"]]
        add_entry_counts(curation["transforms"], file_entries)  # the tokens-stage counts, per file
        if tombstones != sum(t["dropped"] for t in curation["transforms"]):
            raise ShardJobError(f"internal error: {tombstones} tombstones in the lane files, but the transforms "
                                f"dropped {sum(t['dropped'] for t in curation['transforms'])} documents")
    documents = sum(f.rows for f in files) - tombstones
    rejected = {reason: int(reject_counts.get(reason, 0)) for reason in reject_reasons}
    unknown = set(reject_counts) - set(reject_reasons)
    if unknown:
        raise ShardJobError(f"internal error: unknown reject reasons {sorted(unknown)}")
    curated_away = sum(t["dropped"] for t in curation.get("transforms", ())) + curation.get("dedup", {}).get("removed", 0)
    check_reject_fraction(documents + curated_away, rejected, max_reject_fraction)
    # a lane of tombstones only holds no document: the loader could never read a token from it
    check_every_lane_has_documents((f.lane for f, entry in zip(files, file_entries)
                                    if f.rows - int(entry.get("tombstones", 0)) > 0), num_lanes, documents)
    manifest = Manifest(
        seed=seed,
        num_lanes=num_lanes,
        source_name=source_name,
        schema=schema,
        files=sorted(files, key=lambda f: (f.lane, f.part)),
        documents=documents,
        rejected=rejected,
        tokenizer=tokenizer,
        files_per_lane=files_per_lane,
        chat=ChatRecord.from_dict(chat) if chat is not None else None,
        images=ImagesRecord.from_dict(images) if images is not None else None,
        tombstones=tombstones,
        transforms=tuple(curation.get("transforms", ())) if tombstones or "transforms" in curation else (),
        lane_assignment=lane_assignment,
        kind=kind,
        longest_tokens=longest,
    ).with_fingerprint()
    data = manifest.to_dict()
    data.update(curation)  # counts only: not part of the dataset fingerprint (the files are)
    text = manifest.to_json() if not curation else json.dumps(data, indent=1, sort_keys=False) + "\n"
    write_atomically(join_output(output, MANIFEST_NAME), text.encode("utf-8"), storage_options)
    logger.info("committed %s: %d documents in %d files, fingerprint %s",
                join_output(output, MANIFEST_NAME), documents, len(files), manifest.dataset_fingerprint)
    return data
