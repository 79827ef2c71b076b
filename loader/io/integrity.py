"""Lane-file integrity: what a lane file is checked against before its data is used.

On open, the Parquet footer against the manifest entry (rows, row groups) and, with
``verify_local_files``, a local file's SHA-256; on every row-group read, the rows decoded
against the footer (a flipped bit in a page header, which page checksums do not cover, can
make a row group decode as fewer rows without an error); once a file's row groups have all
been read, its tokens against the manifest (:class:`~loader.io.lane_reader.LaneTokenStream`).
All of it runs once per file or per row group, never per sequence (docs/guides/reliability.md).
"""

from __future__ import annotations

import os
import re

import pyarrow.parquet as pq

from loader.caches import BoundedCache
from loader.errors import LaneDataError
from loader.io import storage, storage_options
from loader.io.manifest import MANIFEST_NAME, FileEntry, lane_file_path


FIX = "re-run the Beam job or restore the file from a good copy"
PART_FILE_NAME = re.compile(r"part-\d{5,}\.parquet")

# Local lane files whose SHA-256 matched the manifest in this process, by identity on disk
# (a file replaced in place is hashed again): each is hashed once per process, on first open.
# Bounded: a file forgotten is hashed again on its next open (a cost, never a wrong answer).
_verified_local_files: BoundedCache[bool] = BoundedCache(65536)


def verify_local_file(path: str, handle, entry: FileEntry) -> None:
    """Hash a local lane file through the handle pyarrow will read (then rewound) and compare
    it with the manifest's SHA-256, unless this process already verified the same file."""
    st = os.fstat(handle.fileno())
    identity = (path, entry.sha256, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if identity in _verified_local_files:
        return
    digest = storage_options.sha256_of_file(handle)
    handle.seek(0)
    if digest != entry.sha256:
        raise LaneDataError(
            f"{path}: SHA-256 {digest} does not match the manifest's {entry.sha256} (verify_local_files): "
            f"the file is corrupt or was replaced; {FIX}"
        )
    _verified_local_files.put(identity, True)


def check_footer(metadata: pq.FileMetaData, entry: FileEntry, path: str) -> None:
    """The footer promises what the manifest does: the rows, and the row groups if recorded."""
    problems = []
    if metadata.num_rows != entry.rows:
        problems.append(f"footer says {metadata.num_rows} rows, manifest says {entry.rows}")
    if entry.row_groups > 0 and metadata.num_row_groups != entry.row_groups:
        problems.append(f"footer says {metadata.num_row_groups} row groups, manifest says {entry.row_groups}")
    group_rows = sum(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
    if group_rows != metadata.num_rows:
        problems.append(f"footer's row groups hold {group_rows} rows, its total says {metadata.num_rows}")
    if problems:
        raise LaneDataError(f"{path}: " + "; ".join(problems) + f": the file or the manifest is corrupt; {FIX}")


def check_no_unlisted_files(dataset_path: str, lane_id: int, files: list[FileEntry]) -> None:
    """A local lane directory holds exactly the manifest's part files of the lane.

    The Beam job clears its output before writing, so a part file that the manifest does not
    list means an entry was removed from the manifest (its lane would silently lose those
    documents). One directory listing per lane and process; not done on ``gs://`` or ``s3://``, where it
    would cost a request per lane.
    """
    lane_dir = storage.join(dataset_path, os.path.dirname(lane_file_path(lane_id, 0)))
    try:
        names = os.listdir(lane_dir)
    except FileNotFoundError:
        return  # the listed files are reported missing when opened
    listed = {os.path.basename(f.path) for f in files}
    unlisted = sorted(n for n in names if PART_FILE_NAME.fullmatch(n) and n not in listed)
    if unlisted:
        raise LaneDataError(
            f"{lane_dir} holds {unlisted} but {MANIFEST_NAME} does not list them: the manifest is not the "
            "one the Beam job wrote with these files (an entry was removed?); re-run the Beam job or "
            "restore the manifest"
        )


def check_row_group(rows: int, metadata: pq.FileMetaData, row_group: int, path: str) -> None:
    """A row group read yields exactly the rows its footer entry promises."""
    expected = metadata.row_group(row_group).num_rows
    if rows != expected:
        raise LaneDataError(
            f"{path}: row group {row_group} decoded to {rows} rows, its footer says {expected}: "
            f"the file is corrupt (a damaged page header?); {FIX}"
        )

