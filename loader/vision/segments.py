"""The ``segments`` lane column: where a document's images stand in its text.

An image document is stored as its text (the ``text`` column: every text segment
concatenated in order, nothing inserted between them) plus one ``segments`` list that
replays the order::

    parts     ["A cat.", <image 0>, "It sleeps. ", "Then", <image 1>]
    text      "A cat.It sleeps. Then"
    segments  [6, -1, 17, 21, -1]    # UTF-8 byte offsets into text, -1 = the next image

Each entry ``e >= 0`` is a text segment that ends at UTF-8 byte offset ``e`` of ``text`` (it
starts where the previous text segment ended, at 0 for the first), so text segments that
follow each other keep their boundary without storing any text twice; each entry ``-1``
(:data:`IMAGE_SEGMENT`) is the document's next image, in the order of the image columns.
Offsets are bytes, not characters, so any language can slice the column's UTF-8 buffer;
every offset falls on a character boundary and the last text offset is ``len(text)`` in
bytes. Empty text segments are not stored.

:func:`encode_segments` (the Beam job) and :func:`decode_segments` (readers) are the only
two places that know the encoding.
"""

from __future__ import annotations

from typing import Sequence, Union

IMAGE_SEGMENT = -1
Segment = Union[str, int]  # a text segment (str) or the index of an image in the document (int)


class _ImagePlaceholder:
    """Stands for "an image here" in the parts handed to :func:`encode_segments`."""

    def __repr__(self) -> str:
        return "IMAGE"


IMAGE = _ImagePlaceholder()


def encode_segments(parts: Sequence[Union[str, _ImagePlaceholder]]) -> tuple[str, list[int]]:
    """``(text, segments)`` of a document whose parts are texts and :data:`IMAGE` in order."""
    texts: list[str] = []
    segments: list[int] = []
    end = 0
    for part in parts:
        if part is IMAGE:
            segments.append(IMAGE_SEGMENT)
        elif isinstance(part, str):
            if not part:
                continue
            end += len(part.encode("utf-8"))
            texts.append(part)
            segments.append(end)
        else:
            raise TypeError(f"a document part is a str or loader.vision.segments.IMAGE (got {type(part).__name__})")
    return "".join(texts), segments


def decode_segments(text: str, segments: Sequence[int]) -> list[Segment]:
    """The document's parts in order: each text segment as a str, each image as its index.

    Raises ``ValueError`` naming the entry when ``segments`` does not fit ``text``
    (offsets that go back, overrun the text, split a character or leave text unreferenced).
    """
    data = text.encode("utf-8")
    parts: list[Segment] = []
    start = 0
    images = 0
    for position, entry in enumerate(segments):
        if entry == IMAGE_SEGMENT:
            parts.append(images)
            images += 1
            continue
        if not start < entry <= len(data):
            raise ValueError(f"segments[{position}] = {entry}: a text end must be in ({start}, {len(data)}]")
        try:
            parts.append(data[start:entry].decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"segments[{position}] = {entry} splits a UTF-8 character ({exc.reason})") from exc
        start = entry
    if start != len(data):
        raise ValueError(f"segments end at byte {start} of a {len(data)}-byte text: the rest of the text is in "
                         "no segment")
    return parts


def image_count(segments: Sequence[int]) -> int:
    """How many images a ``segments`` list places."""
    return sum(1 for entry in segments if entry == IMAGE_SEGMENT)
