"""The image columns of a lane file (image datasets only; schema documented in :mod:`loader.io.manifest`).

Rows of an image job carry ``(segments, images)`` as their fifth element
(:mod:`beam_jobs.image_records`); this module turns a row group of them into Arrow columns,
placed after ``text`` and before kept fields::

    segments             list<int32>   text ends (UTF-8 byte offsets) and -1 per image, in order
    num_images           int32         images in the document
    image_bytes          list<binary>  each image's encoded bytes exactly as read (not re-encoded)
    image_format         list<string>  "JPEG" | "PNG" | "WEBP"
    image_width          list<int32>   stored width (no EXIF rotation)
    image_height         list<int32>   stored height
    image_sha256         list<string>  hex SHA-256 of image_bytes
    image_visual_tokens  list<int32>   only with --image-policy: visual tokens of each image

Element ``k`` of every ``image_*`` list is the document's ``k``-th image, the ``k``-th ``-1`` of
``segments``. Metadata and bytes are separate columns so a reader can plan packing from the
sizes and counts without reading any image bytes. ``image_bytes`` is stored without a Parquet
codec (:data:`IMAGE_COLUMN_CODECS`): JPEG, PNG and WebP are compressed already.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

IMAGE_BYTES_COLUMN = "image_bytes"
VISUAL_TOKENS_COLUMN = "image_visual_tokens"
IMAGE_FIELDS = (
    pa.field("segments", pa.list_(pa.int32())),
    pa.field("num_images", pa.int32()),
    pa.field(IMAGE_BYTES_COLUMN, pa.list_(pa.binary())),
    pa.field("image_format", pa.list_(pa.string())),
    pa.field("image_width", pa.list_(pa.int32())),
    pa.field("image_height", pa.list_(pa.int32())),
    pa.field("image_sha256", pa.list_(pa.string())),
)
VISUAL_TOKENS_FIELD = pa.field(VISUAL_TOKENS_COLUMN, pa.list_(pa.int32()))
IMAGE_COLUMNS = tuple(f.name for f in IMAGE_FIELDS) + (VISUAL_TOKENS_COLUMN,)
IMAGE_COLUMN_CODECS = {IMAGE_BYTES_COLUMN: "none"}
# Position of each value in an image tuple of a lane row.
_BYTES, _FORMAT, _WIDTH, _HEIGHT, _SHA256, _TOKENS = range(6)


def image_fields(visual_tokens: bool) -> list[pa.Field]:
    return [*IMAGE_FIELDS, *([VISUAL_TOKENS_FIELD] if visual_tokens else [])]


def image_nbytes(rows: Sequence[tuple]) -> np.ndarray:
    """Encoded image bytes per row (added to the text bytes that cut row groups)."""
    return np.fromiter((sum(len(image[_BYTES]) for image in row[4][1]) for row in rows), dtype=np.int64,
                       count=len(rows))


def image_count(rows: Sequence[tuple]) -> int:
    return sum(len(row[4][1]) for row in rows)


def image_columns(rows: Sequence[tuple], visual_tokens: bool) -> list[pa.Array]:
    """The :func:`image_fields` columns of one row group, in that order."""
    payloads = [row[4] for row in rows]

    def per_image(position: int, arrow_type) -> pa.Array:
        return pa.array([[image[position] for image in images] for _segments, images in payloads], arrow_type)

    columns = [
        pa.array([list(segments) for segments, _images in payloads], pa.list_(pa.int32())),
        pa.array([len(images) for _segments, images in payloads], pa.int32()),
        per_image(_BYTES, pa.list_(pa.binary())),
        per_image(_FORMAT, pa.list_(pa.string())),
        per_image(_WIDTH, pa.list_(pa.int32())),
        per_image(_HEIGHT, pa.list_(pa.int32())),
        per_image(_SHA256, pa.list_(pa.string())),
    ]
    if visual_tokens:
        missing = [row[1] for row in rows if any(image[_TOKENS] is None for image in row[4][1])]
        if missing:
            raise ValueError(f"rows {missing[:3]} have images without a visual-token count (no --image-policy?)")
        columns.append(per_image(_TOKENS, pa.list_(pa.int32())))
    return columns
