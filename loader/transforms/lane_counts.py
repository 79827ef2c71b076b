"""A lane stream's transform counters: per transform, documents dropped and changed before the cursor."""

from __future__ import annotations

from typing import Optional

from loader.io.blocks import Block
from loader.transforms.chain import TransformCounts


class TransformCounting:
    """A base of :class:`~loader.io.lane_reader.LaneTokenStream`: its transform counters.

    ``_counts_before`` holds the counts of the blocks before the current one; a state's counts
    add the current block's once the cursor has taken from it. A restored state's counts wait
    in ``_restored_counts`` until the cursor's block is read again (``_block_loaded``).
    """

    def _counts_at(self, epoch: int, block_index: int, offset: int) -> list:
        """The transform counts of a state at this cursor: the blocks before its block, and its
        block too once taken from (``offset > 0``); the cursor is at or after the current block.
        A JSON list, shared by the states that have the same counts (never mutated: a state is
        taken per sequence, the counts change per block)."""
        if self._restored_counts is not None:
            return self._restored_counts[0].to_state()
        key, current = self._block_key, self._block
        if key is None or current is None:
            return self._counts_before.to_state()
        ahead = key < (epoch, block_index)
        with_current = ahead or offset > 0
        if ahead and offset > 0 and self._peeked is not None and self._peeked[0] == (epoch, block_index):
            # a bulk reader's state inside the next block (read early): not cached, rare
            return self._counts_before.plus(current.transform_counts).plus(self._peeked[1].transform_counts).to_state()
        counts = self._counts_memo[with_current]
        if counts is None:
            counts = self._counts_memo[with_current] = self._counts_before.plus(
                current.transform_counts if with_current else None).to_state()
        return counts

    def transform_counts(self) -> Optional[TransformCounts]:
        """What this stream's transforms did so far (every block read as the cursor's, whole)."""
        if not self.counting:
            return None
        total = TransformCounts.from_state(self._counts_at(self.epoch, self.block_index, self.offset))
        if self._restored_counts is None and self._block is not None and self._block_key == (
                self.epoch, self.block_index) and self.offset == 0:
            total.add(self._block.transform_counts)
        return total

    def _block_loaded(self, key: tuple[int, int], block: Block) -> None:
        """Counter bookkeeping when ``block`` becomes the current block (see :meth:`_counts_at`)."""
        self._counts_memo = [None, None]
        if self._restored_counts is not None:
            saved, taken_from = self._restored_counts
            self._restored_counts = None
            self._counts_before = saved.plus(None)
            if taken_from:  # the saved counts include this block: they are counted again from it
                for mine, its in zip(self._counts_before.counts, block.transform_counts.counts):
                    mine[0] -= its[0]
                    mine[1] -= its[1]
        elif self._block_key is not None and self._block is not None and self._block_key < key:
            self._counts_before.add(self._block.transform_counts)
