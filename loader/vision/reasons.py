"""Why an image (and with it its whole document) is rejected: stable reason names.

These names are manifest ``rejected`` keys and ``_rejected/*.jsonl`` reasons of an image job
(``zephon shard --image-field`` or WebDataset input): part of the format, never renamed. The
module imports nothing heavy, so the manifest can name them without loading Pillow.

=============================  ==============================================================
reason                         when
=============================  ==============================================================
missing_image_field            the record has no value for ``--image-field`` (JSONL/Parquet),
                               or a WebDataset sample has no ``.jpg/.jpeg/.png/.webp`` member
invalid_image_field            the image field has the wrong type or shape (not a path /
                               bytes / list; an interleaved ``images``/``texts`` pair whose
                               lists differ in length or hold both or neither at a position)
image_missing                  a named image file or tar member does not exist, or holds no
                               bytes (``None`` / 0 bytes)
image_unreadable               the named file exists but reading it failed (permission, I/O,
                               a storage error)
image_truncated                the encoded bytes end early (Pillow runs out of data, a PNG
                               without its ``IEND`` chunk, a WebP shorter than its RIFF size)
image_undecodable              the bytes are not a decodable image of a supported format
                               (not an image at all, or corrupt data Pillow refuses)
image_unsupported_format       a decodable image whose format is not JPEG, PNG or WebP
                               (GIF, BMP, TIFF, ...)
image_too_large                above :class:`loader.vision.images.ImageLimits`: more encoded
                               bytes than ``max_bytes`` or more pixels than ``max_pixels``
                               (checked from the header, before decoding)
image_extreme_aspect_ratio     ``max(w, h) / min(w, h)`` above ``max_aspect_ratio`` (200, the
                               bound of Qwen2-VL's ``smart_resize``)
too_many_images                more images in one document than ``max_images_per_document``
=============================  ==============================================================
"""

from __future__ import annotations

from loader.errors import RecordRejected

IMAGE_REJECT_REASONS = (
    "missing_image_field",
    "invalid_image_field",
    "image_missing",
    "image_unreadable",
    "image_truncated",
    "image_undecodable",
    "image_unsupported_format",
    "image_too_large",
    "image_extreme_aspect_ratio",
    "too_many_images",
)

# Online rejects of chat with images beyond the chat guards (batch["chat_rejects"]).
IMAGE_CHAT_REJECT_REASONS = ("image_placeholder_mismatch",)


class ImageRejected(RecordRejected):
    """An image that cannot be used, with ``reason`` (one of :data:`IMAGE_REJECT_REASONS`) and ``detail``."""

    REASONS = IMAGE_REJECT_REASONS
