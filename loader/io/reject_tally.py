"""The online rejects of a lane stream's blocks, reported once per block the cursor enters.

A block that refuses documents as it decodes them (an online chat or image block) counts
them per reason in ``reject_counts``; the stream reports them with the sequence whose
production moves its cursor into (or past) the block, so a micro-batch's counts are the same
on every topology and across a resume (see :mod:`loader.chat.block`).
"""

from __future__ import annotations

import threading
from typing import Optional

from loader.io.blocks import Block


class RejectTally:
    """The online rejects of one stream, reported once per block (see the module docstring).

    Not part of the stream's state: which blocks have been reported follows from the cursor
    (``(epoch, block, offset)``, a block is entered once ``offset > 0`` or the cursor is past it),
    both in a run and after :meth:`restore`. Holds the blocks read since the last report (the
    current one and those read ahead), by ``(epoch, block)``.
    """

    def __init__(self) -> None:
        self._reported = (0, -1)  # the last block whose rejects were reported: none yet
        self._blocks: dict[tuple[int, int], Block] = {}
        self._lock = threading.Lock()  # blocks are registered by read-ahead threads too

    def register(self, key: tuple[int, int], block: Block) -> None:
        """A block read (on any thread); the same key always holds the same conversations."""
        if block.reject_counts is not None:  # a block that rejects online (chat and image blocks)
            with self._lock:
                self._blocks[key] = block

    def restore(self, epoch: int, block: int, offset: int) -> None:
        self._reported = (epoch, block) if offset > 0 else (epoch, block - 1)

    def take(self, epoch: int, block: int, offset: int) -> Optional[dict[str, int]]:
        """The rejects of the blocks entered since the last call, or None when there are none."""
        entered = (epoch, block) if offset > 0 else (epoch, block - 1)
        if entered <= self._reported:
            return None
        with self._lock:
            passed = [(key, self._blocks.pop(key)) for key in sorted(self._blocks) if key <= entered]
        counts: Optional[dict[str, int]] = None
        for key, rejecting_block in passed:
            if key > self._reported:
                for reason, count in rejecting_block.rejects().items():
                    counts = {} if counts is None else counts
                    counts[reason] = counts.get(reason, 0) + count
        self._reported = entered
        return counts
