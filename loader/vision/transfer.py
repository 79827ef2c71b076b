"""Pixels through a worker's shared-memory slot (:mod:`loader.workers.messages`).

A message of image sequences puts each image's pixel array, in its policy's compact form
(:meth:`~loader.vision.policies.DynamicResolutionPolicy.compact`: the resized image's uint8
values; the collator normalises them to float32 and makes Qwen2-VL's temporal copy as it
writes ``pixel_values``, so a slot carries an eighth of the float32 layout's bytes),
into the slot beside the per-token arrays (``image.<row>.<k>``, each 64-byte aligned by
:func:`loader.workers.shm.write_arrays`), and its descriptor holds per row the images'
token positions, lengths and grids (small lists). The trainer's items get views of the slot;
the collator normalises them once into the micro-batch's ``pixel_values``, as it copies the ids,
before the slot goes back to the worker. No pixel array is pickled.

:func:`image_slot_bytes` is the room a message needs for its pixels in the worst case: every
token of every sequence a visual token. Slots are sparse files in ``/dev/shm``: only the pages
a message writes are ever backed by memory.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from loader.vision.resolve import SequenceImages


def pack_images(sequences: list, arrays: dict) -> list[Optional[list]]:
    """Each sequence's image descriptor (None: not an image sequence); pixels added to ``arrays``."""
    entries: list[Optional[list]] = []
    for row, sequence in enumerate(sequences):
        images = sequence.images
        if images is None:
            entries.append(None)
            continue
        for k, pixels in enumerate(images.pixels):
            arrays[f"image.{row}.{k}"] = pixels
        entries.append([images.positions.tolist(), images.lengths.tolist(), images.grids.tolist()])
    return entries


def unpack_images(entry: Optional[list], arrays: dict, row: int) -> Optional[SequenceImages]:
    """The :class:`SequenceImages` of one row of a message (pixels are views of the slot)."""
    if entry is None:
        return None
    positions, lengths, grids = entry
    return SequenceImages(np.array(positions, dtype=np.int64), np.array(lengths, dtype=np.int64),
                          [arrays[f"image.{row}.{k}"] for k in range(len(positions))],
                          np.array(grids, dtype=np.int64).reshape(len(grids), 3))


def image_slot_bytes(policy, seq_len: int, items: int, wrap_tokens: int) -> int:
    """Worst-case pixel bytes of a message of ``items`` sequences of ``seq_len`` tokens."""
    if policy.kind == "fixed":
        images = max(1, seq_len // (policy.visual_tokens(1, 1) + wrap_tokens))
        return items * images * (3 * policy.image_size ** 2 + 64)
    # dynamic: at most seq_len visual tokens, each merge_size^2 compact patches of 3 * p * p uint8
    images = max(1, seq_len // (1 + wrap_tokens))
    per_token = policy.merge_size ** 2 * 3 * policy.patch_size ** 2
    return items * (seq_len * per_token + 64 * images)
