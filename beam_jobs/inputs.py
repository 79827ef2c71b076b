"""Expanding ``--input`` globs into the list of files the sharding job reads.

The expansion runs once, in the launcher, before the pipeline is built: its result is a
sorted, de-duplicated list of :class:`InputFile` that becomes a ``beam.Create``, so reading
is parallel across files and the set of files is fixed for the whole job.

Input root and relative paths
-----------------------------
Without ``--id-field`` a document's key is ``"<relative path>#<record index>"``. The
relative path is taken from the *input root*: the longest common directory prefix of the
non-glob parts of the ``--input`` patterns. For example::

    --input data/web/*.jsonl data/books/part-*.parquet    root = <abs>/data/
    key of line 7 of data/web/a.jsonl                      "web/a.jsonl#7"

so the keys (and therefore lanes and order) do not depend on the machine's working
directory or the bucket's mount point, only on the layout below the root. Local patterns
are made absolute first; ``gs://`` and ``s3://`` patterns are used as given.

Formats
-------
``--format`` applies to every file. When it is omitted the format of each file is inferred
from its name (:data:`FORMAT_BY_SUFFIX`); a ``.gz`` / ``.zst`` / ``.zstd`` suffix selects
the compression for ``jsonl`` and ``text``, whatever the format.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from loader.errors import InputError
from loader.io.backends import UnsupportedSchemeError, is_remote
from loader.io.storage_options import StorageOptions

FORMATS = ("jsonl", "parquet", "text", "webdataset")  # webdataset: image jobs (beam_jobs.formats.webdataset)
COMPRESSIONS = ("none", "gzip", "zstd")

# Longest suffix first, so that ".jsonl.gz" wins over ".gz".
FORMAT_BY_SUFFIX = (
    (".jsonl.gz", "jsonl"),
    (".jsonl.zst", "jsonl"),
    (".jsonl.zstd", "jsonl"),
    (".json.gz", "jsonl"),
    (".json.zst", "jsonl"),
    (".txt.gz", "text"),
    (".txt.zst", "text"),
    (".jsonl", "jsonl"),
    (".json", "jsonl"),
    (".parquet", "parquet"),
    (".txt", "text"),
    (".tar", "webdataset"),
)
COMPRESSION_BY_SUFFIX = ((".gz", "gzip"), (".zst", "zstd"), (".zstd", "zstd"))

_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True, order=True)
class InputFile:
    """One input file. Ordered by ``path`` so that the file list is sorted deterministically."""

    path: str  # absolute local path, or a URL (gs://..., s3://...) as beam_jobs.job_files reads it
    relative_path: str  # relative to the input root, "/"-separated: part of document keys
    file_index: int  # position in the sorted file list; names the _rejected file
    format: str  # one of FORMATS
    compression: str  # one of COMPRESSIONS
    size_bytes: Optional[int] = None  # as listed in the launcher; not sent to workers


    def to_tuple(self) -> tuple[str, str, int, str, str]:
        """Plain tuple for Beam transport (fast coder; no pickling of a class); without the size."""
        return (self.path, self.relative_path, self.file_index, self.format, self.compression)

    @classmethod
    def from_tuple(cls, values: Sequence) -> "InputFile":
        return cls(*values)


def normalize_pattern(pattern: str) -> str:
    return pattern if is_remote(pattern) else os.path.abspath(os.path.expanduser(pattern))


def _static_dir(pattern: str) -> str:
    """The directory part of the pattern before its first glob character, ending in '/'."""
    match = _GLOB_CHARS.search(pattern)
    static = pattern if match is None else pattern[: match.start()]
    return static[: static.rfind("/") + 1]


def input_root(patterns: Sequence[str]) -> str:
    """Longest common directory prefix (ending in '/') of the non-glob part of the patterns."""
    dirs = [_static_dir(normalize_pattern(p)) for p in patterns]
    common = os.path.commonprefix(dirs)
    # commonprefix is character-wise: cut back to a whole directory component.
    return common[: common.rfind("/") + 1]


def infer_format(path: str, explicit_format: Optional[str]) -> str:
    if explicit_format is not None:
        return explicit_format
    lowered = path.lower()
    for suffix, fmt in FORMAT_BY_SUFFIX:
        if lowered.endswith(suffix):
            return fmt
    known = ", ".join(suffix for suffix, _ in FORMAT_BY_SUFFIX)
    raise InputError(
        f"cannot infer the format of input file {path} from its name (known suffixes: {known}); "
        f"pass --format with one of {', '.join(FORMATS)}."
    )


def infer_compression(path: str) -> str:
    lowered = path.lower()
    for suffix, compression in COMPRESSION_BY_SUFFIX:
        if lowered.endswith(suffix):
            return compression
    return "none"


def _match_pattern(pattern: str, storage_options: StorageOptions) -> dict[str, int]:
    from beam_jobs import job_files  # imports apache_beam: only when the job lists its inputs

    if not is_remote(pattern) and os.path.isdir(pattern):
        raise InputError(
            f"--input {pattern} is a directory; pass a glob such as {pattern.rstrip('/')}/*.jsonl "
            f"(or {pattern.rstrip('/')}/** for every file below it)."
        )
    try:
        sizes = job_files.match(pattern, storage_options)
    except UnsupportedSchemeError as exc:
        raise InputError(f"--input {exc}") from exc
    except Exception as exc:  # BeamIOError wraps the per-pattern cause; StorageError names the object
        raise InputError(f"--input {pattern}: listing failed ({exc})") from exc
    if not is_remote(pattern):
        sizes = {p: size for p, size in sizes.items() if os.path.isfile(p)}
    if not sizes:
        raise InputError(f"--input {pattern} matches no files; check the path and the glob.")
    return sizes


def expand_inputs(patterns: Sequence[str], explicit_format: Optional[str] = None, *,
                  storage_options: StorageOptions = StorageOptions()) -> list[InputFile]:
    """Every file matched by the patterns, sorted by path, each at most once.

    Raises :class:`InputError` naming the pattern when one matches nothing or only empty
    (0-byte) files, and naming the file when its format cannot be inferred. A single empty
    file among others is fine: it holds no records.
    """
    if not patterns:
        raise InputError("--input needs at least one path or glob")
    if explicit_format is not None and explicit_format not in FORMATS:
        raise InputError(f"--format must be one of {', '.join(FORMATS)} (got {explicit_format!r})")
    normalized = [normalize_pattern(p) for p in patterns]
    root = input_root(normalized)
    sizes = {path: size for pattern in normalized for path, size in _match_pattern(pattern, storage_options).items()}
    paths = sorted(sizes)
    if all(size == 0 for size in sizes.values()):
        raise InputError(f"--input {' '.join(patterns)} matches only empty files ({len(paths)}, e.g. {paths[0]}): "
                         "there is nothing to shard.")
    files = []
    for file_index, path in enumerate(paths):
        relative = path[len(root):] if path.startswith(root) else path
        files.append(
            InputFile(
                path=path,
                relative_path=relative.replace(os.sep, "/"),
                file_index=file_index,
                format=infer_format(path, explicit_format),
                compression=infer_compression(path),
                size_bytes=sizes[path],
            )
        )
    return files


COUNTED_JSONL_BYTES = 64 << 20  # local uncompressed JSONL up to this size: its lines are counted


def _non_blank_lines(path: str) -> int:
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def most_documents(files: Sequence[InputFile], text_field: str) -> Optional[int]:
    """An upper bound on the documents in ``files``, or None when one file's count has no bound.

    A text file is at most one document. An uncompressed JSONL file holds at most one per
    ``len('{"<text field>":"x"}') + 1`` bytes (the shortest line with a non-empty text); a
    local one of at most ``COUNTED_JSONL_BYTES`` at most one per non-blank line, counted
    (a small input, where a lane count too large for it is the usual mistake).
    Parquet and compressed JSONL files can hold any number for their size: no bound.
    """
    shortest_line = len(text_field.encode("utf-8")) + len('{"":"x"}') + 1
    total = 0
    for input_file in files:
        if input_file.size_bytes is None:
            return None
        if input_file.format == "text":
            total += 1 if input_file.size_bytes else 0
        elif input_file.format == "jsonl" and input_file.compression == "none":
            if not is_remote(input_file.path) and input_file.size_bytes <= COUNTED_JSONL_BYTES:
                total += _non_blank_lines(input_file.path)
            else:
                total += (input_file.size_bytes + 1) // shortest_line
        else:
            return None
    return total
