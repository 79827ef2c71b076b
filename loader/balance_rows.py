"""A step's rows between real ranks (``balance = "attention"``): everything an item carries, as bytes.

:class:`~loader.balanced.DistributedExchange` sends each peer the rows that peer trains on as
one ``uint8`` tensor (:func:`encode_items`), decoded by the peer into items whose arrays are
views of the received buffer (:func:`decode_items`; the collator copies them once, as it copies
a worker slot's). A row is rebuilt exactly as the rank that made it holds it, so a micro-batch
of exchanged rows is bit for bit the one a simulated rank collates from the items themselves:

* per item: ``global_index``, ``source_id``, ``padding``, ``majority_source`` and the online
  rejects reported with it (``chat_rejects``: ``{reason: count}`` or None; chat and image blocks);
* per row: ``input_ids``, ``labels``, ``segment_starts`` and each of the loader's per-token
  features, in their own dtypes (not widened);
* image rows: the images' token positions, lengths and grids, and each image's pixels in the
  policy's compact form (:func:`loader.vision.transfer.pack_images`, the descriptor workers
  ship in their slots), float32 bytes as they are.

Layout of the buffer::

    u64 little-endian n | n bytes of JSON {"items": [...], "images": [...], "arrays": [[name, dtype, shape, offset]]}
    | zero padding to 8 | the arrays, each at its offset (8-byte aligned)

JSON holds only integers, strings and lists; no object is pickled between ranks.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from loader.stages.features import NO_FEATURES
from loader.stages.packing import PackedSequence
from loader.stages.producer import Item
from loader.vision.transfer import pack_images, unpack_images

_PREFIX = 8  # bytes of the header's length
_ALIGN = 8


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode_items(items: Sequence[Item], features: Sequence[str]) -> np.ndarray:
    """``items`` as one ``uint8`` array (see the module docstring)."""
    arrays: dict[str, np.ndarray] = {}
    described = []
    for row, item in enumerate(items):
        sequence = item.sequence
        arrays[f"ids.{row}"] = np.asarray(sequence.input_ids)
        arrays[f"labels.{row}"] = np.asarray(sequence.labels)
        arrays[f"starts.{row}"] = np.asarray(sequence.segment_starts)
        for name in features:
            arrays[f"{name}.{row}"] = np.asarray(sequence.features[name])
        described.append([item.global_index, item.source_id, int(sequence.padding), int(sequence.majority_source),
                          item.chat_rejects])
    images = pack_images([item.sequence for item in items], arrays)
    layout, at = [], 0
    for name, array in arrays.items():
        layout.append([name, array.dtype.str, list(array.shape), at])
        at = _aligned(at + array.nbytes)
    header = json.dumps({"items": described, "images": images, "arrays": layout},
                        separators=(",", ":")).encode("utf-8")
    base = _aligned(_PREFIX + len(header))
    buffer = np.zeros(base + at, dtype=np.uint8)
    buffer[:_PREFIX] = np.frombuffer(np.array([len(header)], dtype="<u8").tobytes(), dtype=np.uint8)
    buffer[_PREFIX:_PREFIX + len(header)] = np.frombuffer(header, dtype=np.uint8)
    for (name, _, _, offset), array in zip(layout, arrays.values()):
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        buffer[base + offset:base + offset + len(flat)] = flat
    return buffer


def decode_items(buffer: np.ndarray, features: Sequence[str]) -> list[Item]:
    """The items :func:`encode_items` wrote into ``buffer`` (their arrays are views of it)."""
    if len(buffer) < _PREFIX:
        raise ValueError(f"a balance exchange buffer of {len(buffer)} bytes has no header")
    size = int(np.frombuffer(buffer[:_PREFIX].tobytes(), dtype="<u8")[0])
    header = json.loads(buffer[_PREFIX:_PREFIX + size].tobytes().decode("utf-8"))
    base = _aligned(_PREFIX + size)
    arrays = {}
    for name, dtype, shape, offset in header["arrays"]:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        arrays[name] = np.frombuffer(buffer, dtype=dtype, count=count, offset=base + offset).reshape(shape)
    items = []
    for row, (global_index, source_id, padding, majority, rejects) in enumerate(header["items"]):
        laid_out = {name: arrays[f"{name}.{row}"] for name in features}
        sequence = PackedSequence(input_ids=arrays[f"ids.{row}"], labels=arrays[f"labels.{row}"],
                                  segment_starts=arrays[f"starts.{row}"], features=laid_out or NO_FEATURES,
                                  majority_source=majority, padding=padding)
        sequence.images = unpack_images(header["images"][row], arrays, row)
        items.append(Item(global_index=global_index, source_id=source_id, sequence=sequence, lane_state=None,
                          chat_rejects=rejects))
    return items
