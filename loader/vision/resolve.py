"""Image refs to pixels: what the process that assembles a sequence does before shipping it.

A packed sequence of an image source carries the ``image_ref`` feature
(:mod:`loader.vision.block`): one run of equal refs per image, on its placeholder tokens.
:class:`ImageResolver` (one per image stream, in the worker or the trainer's process, wherever
the lane runs) turns each run into the image's pixels::

    run of ref r at tokens [p, p + n) --decode_ref--> (epoch, block, row, image)
      --the row group's image_bytes column, re-read (epoch row order) and cached--> bytes
      --policy.process_compact (decode_rgb, pinned resample filter)--> PixelValues, checked: n tokens

and sets ``sequence.images`` (:class:`SequenceImages`). The bytes are read from the lane file
again rather than kept in the block: a best-fit bin or a restored checkpoint may hold refs to
a row group read long ago. The last :data:`CACHED_ROW_GROUPS` row groups' bytes are cached,
so the usual case (the sequence's documents come from the block being consumed) reads each
row group's image column once.

Every image's bytes are checked before they are decoded (one verification layer with the token
columns, :mod:`loader.io.integrity`): the row group is read with Parquet page checksums
verified, and the bytes' SHA-256 must be the ``image_sha256`` the Beam job stored beside them.
This detects corruption (a flipped bit, a damaged copy); it is not a seal: whoever edits a
lane file can rewrite both columns (docs/guides/what-is-checked.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loader.errors import LaneDataError
from loader.io import storage
from loader.metrics import counting_into
from loader.vision.block import decode_ref
from loader.vision.reasons import ImageRejected

CACHED_ROW_GROUPS = 2
IMAGE_COLUMNS = ("image_bytes", "image_sha256")


def verify_image_bytes(data, stored_sha256, where: str) -> None:
    """An image's bytes read back from a lane file hash to the SHA-256 stored beside them."""
    if not isinstance(data, bytes):
        raise LaneDataError(f"{where}: the stored image is null; the file is corrupt (re-run the Beam job)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != stored_sha256:
        raise LaneDataError(f"{where}: the image's SHA-256 {digest} is not the {stored_sha256!r:.80} stored with it: "
                            "the lane file is corrupt; re-run the Beam job or restore the file from a good copy")


@dataclass
class SequenceImages:
    """The images of one packed sequence, in token order."""

    positions: np.ndarray  # int64: first placeholder token of each image in the sequence
    lengths: np.ndarray  # int64: placeholder tokens of each image
    pixels: list  # uint8, the policy's compact form: [3, S, S] or [h * w, 3 * p * p] (policy.compact)
    grids: np.ndarray  # int64 [n, 3]: (t, h, w) patch grid of each image

    def __len__(self) -> int:
        return len(self.positions)


def image_runs(refs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(starts, lengths, refs)`` of the runs of equal non-negative values in ``refs``."""
    padded = np.concatenate(([-1], refs, [-1]))
    bounds = np.flatnonzero(padded[1:] != padded[:-1])
    starts, ends = bounds[:-1], bounds[1:]
    values = refs[starts] if len(starts) else np.zeros(0, np.int64)
    keep = values >= 0
    return starts[keep].astype(np.int64), (ends - starts)[keep].astype(np.int64), values[keep]


def empty_images() -> SequenceImages:
    return SequenceImages(np.zeros(0, np.int64), np.zeros(0, np.int64), [], np.zeros((0, 3), np.int64))


class ImageResolver:
    """Resolves the refs of one (source, lane) stream's sequences (module docstring)."""

    def __init__(self, stream, options, limits) -> None:
        self.stream = stream
        self.options = options
        self.limits = limits  # loader.vision.images.ImageLimits the job checked the images against
        # (epoch, block) -> (image_bytes, image_sha256) list columns, rows in replay order
        self._row_groups: OrderedDict = OrderedDict()
        self._open: tuple = ()  # (file ordinal, ParquetFile, handle)

    def attach(self, sequence) -> None:
        """Set ``sequence.images`` from its ``image_ref`` feature."""
        refs = sequence.features.get("image_ref")
        if refs is None:
            sequence.images = empty_images()
            return
        starts, lengths, values = image_runs(refs)
        policy = self.options.policy
        pixels, grids = [], []
        for start, length, ref in zip(starts.tolist(), lengths.tolist(), values.tolist()):
            data, where = self._image_bytes(*decode_ref(ref))
            try:
                processed = policy.process_compact(data, self.limits)
            except ImageRejected as exc:
                raise LaneDataError(f"{where}: the stored image cannot be decoded now ({exc}); the file is "
                                    "corrupt (re-run the Beam job)") from exc
            t, h, w = processed.grid_thw
            tokens = _tokens_of(policy, t, h, w)
            if tokens != length:
                raise LaneDataError(f"{where}: the image has {tokens} visual tokens under the configured policy but "
                                    f"its placeholder run in the sequence holds {length} (an image split across "
                                    "sequences, or another policy); this is a bug: report it")
            pixels.append(processed.values)
            grids.append(processed.grid_thw)
        sequence.images = SequenceImages(starts, lengths, pixels,
                                         np.array(grids, dtype=np.int64).reshape(len(grids), 3))

    def _image_bytes(self, epoch: int, block: int, row: int, image: int) -> tuple[bytes, str]:
        stream = self.stream
        file_ordinal, row_group = stream.blocks_of_epoch(epoch)[block]
        where = f"{storage.join(stream.dataset_path, stream.files[file_ordinal].path)}: row group {row_group}, " \
                f"row {row}, image {image}"
        columns = self._row_groups.get((epoch, block))
        if columns is None:
            columns = self._read(epoch, file_ordinal, row_group, where)
            self._row_groups[(epoch, block)] = columns
            while len(self._row_groups) > CACHED_ROW_GROUPS:
                self._row_groups.popitem(last=False)
        else:
            self._row_groups.move_to_end((epoch, block))
        try:
            data = columns[0][row].values[image].as_py()
            stored = columns[1][row].values[image].as_py()
        except (IndexError, AttributeError) as exc:
            raise LaneDataError(f"{where}: no such image in the lane file ({exc}); the file changed since its "
                                "block was read (re-run the Beam job)") from exc
        verify_image_bytes(data, stored, where)
        return data, where

    def _read(self, epoch: int, file_ordinal: int, row_group: int, where: str) -> pa.Array:
        stream = self.stream
        if not self._open or self._open[0] != file_ordinal:
            self.close()
            with counting_into(stream.owner.io):  # the cache's hits and misses (loader.metrics)
                handle = storage.open_lane_file(stream.dataset_path, stream.files[file_ordinal], stream.storage_options)
            self._open = (file_ordinal, pq.ParquetFile(handle, pre_buffer=False, page_checksum_verification=True),
                          handle)
        try:
            table = self._open[1].read_row_group(row_group, columns=list(IMAGE_COLUMNS), use_threads=False)
        except Exception as exc:  # whatever pyarrow raises on bad bytes
            raise LaneDataError(f"{where}: the image_bytes column cannot be read ({type(exc).__name__}: {exc}); "
                                "the file is corrupt (re-run the Beam job)") from exc
        columns = []
        for column in table.columns:
            column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            if epoch > 0:  # the rows in the order the block was built in (loader.order.epochs)
                order = stream.lane_files.row_order(epoch, file_ordinal, row_group, len(column))
                column = pc.take(column, pa.Array.from_buffers(pa.int64(), len(order), [None, pa.py_buffer(order)]))
            columns.append(column)
        return tuple(columns)

    def close(self) -> None:
        if self._open:
            self._open[1].close()
            self._open[2].close()
            self._open = ()


def _tokens_of(policy, t: int, h: int, w: int) -> int:
    """Visual tokens of a processed image's grid under ``policy``."""
    merge = getattr(policy, "merge_size", 1)
    return t * h * w // (merge * merge)


def images_in(chunk) -> int:
    """Images whose placeholders a chunk holds (runs of ``image_ref``; 0 without the feature)."""
    refs = chunk.features.get("image_ref") if chunk.features else None
    if refs is None or not len(refs):
        return 0
    on = refs >= 0
    if not on.any():
        return 0
    return int(np.count_nonzero(on[1:] & (refs[1:] != refs[:-1])) + on[0])
