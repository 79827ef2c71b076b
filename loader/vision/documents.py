"""An image document as a reader gets it back from one lane row (the columns of :mod:`loader.io.manifest`).

:meth:`ImageDocument.from_row` takes a row as ``pyarrow.Table.to_pylist()`` gives it (or any
mapping of the column names to Python values) and checks that its columns agree with each
other: one ``-1`` in ``segments`` per image, every ``image_*`` list ``num_images`` long,
text offsets inside ``text``. ``parts`` is the document in order: ``str`` for a text segment,
``int`` for the index of an image in ``images``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from loader.vision.segments import decode_segments

IMAGE_LIST_COLUMNS = ("image_bytes", "image_format", "image_width", "image_height", "image_sha256")


@dataclass(frozen=True)
class LaneImage:
    """One stored image: its encoded bytes as given and what the job recorded about it."""

    data: bytes
    format: str
    width: int
    height: int
    sha256: str
    visual_tokens: Optional[int] = None  # set when the dataset was sharded with --image-policy


@dataclass(frozen=True)
class ImageDocument:
    key: str
    text: str
    parts: tuple[Union[str, int], ...]
    images: tuple[LaneImage, ...]

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "ImageDocument":
        """The document of one lane row; ``ValueError`` naming the key when its columns disagree."""
        key = row.get("key")
        try:
            parts = tuple(decode_segments(row["text"], row["segments"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"lane row {key!r}: bad segments ({exc})") from exc
        count = row.get("num_images")
        placed = sum(1 for part in parts if isinstance(part, int))
        lists = {name: row.get(name) for name in IMAGE_LIST_COLUMNS}
        tokens = row.get("image_visual_tokens")
        if tokens is not None:
            lists["image_visual_tokens"] = tokens
        lengths = {name: len(value) if isinstance(value, list) else None for name, value in lists.items()}
        if count != placed or any(length != count for length in lengths.values()):
            raise ValueError(f"lane row {key!r}: num_images {count}, segments place {placed} images, image "
                             f"columns hold {lengths}: the row is inconsistent")
        images = tuple(
            LaneImage(data=lists["image_bytes"][k], format=lists["image_format"][k], width=lists["image_width"][k],
                      height=lists["image_height"][k], sha256=lists["image_sha256"][k],
                      visual_tokens=tokens[k] if tokens is not None else None)
            for k in range(count))
        return cls(key=key, text=row["text"], parts=parts, images=images)
