"""A lane stream's background reads: the blocks after the cursor's, queued on the read-ahead."""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from loader.io.blocks import Block
from loader.io.owner import StreamOwner

log = logging.getLogger(__name__)


def prepare_block(owner: StreamOwner, key: tuple[int, int], block: Block) -> None:
    """A block just read ahead (``key``: its epoch and index): its remaining decoding (an online
    chat block's render, tokenization and masks) queued on its owner's prepare thread; blocks with
    nothing to prepare (pre-tokenized, text: see ``TextBlock``) cost nothing here."""
    prepare = type(block).prepare
    if not block.complete and prepare is not Block.prepare:
        owner.prepare_later(prepare, block, key)  # the unbound method: the block itself is held weakly


class LaneReadAhead:
    """A base of :class:`~loader.io.lane_reader.LaneTokenStream`: its read-ahead.

    The next ``read_ahead_blocks`` blocks after the cursor's are read on the stream's
    :class:`~loader.io.read_ahead.ReadAheadQueue` (``_ahead``); a block leaves the queue only
    through :meth:`_settle_read_ahead`.
    """

    def _next_block_key(self, epoch: int, block_index: int) -> Optional[tuple[int, int]]:
        if block_index + 1 < len(self.blocks_of_epoch(epoch)):
            return epoch, block_index + 1
        if self.max_epochs is not None and epoch + 1 >= self.max_epochs:
            return None
        return epoch + 1, 0

    def _start_read_ahead(self, epoch: int, block_index: int) -> None:
        """Queue reads of the blocks after ``(epoch, block_index)``, ``read_ahead_blocks`` of them."""
        key = (epoch, block_index)
        for _ in range(self.read_ahead_blocks):
            key = self._next_block_key(*key)
            if key is None:
                return
            if key in self._ahead:
                continue
            # The epoch layout is looked up on this thread: the reader gets file and row group.
            where = self.blocks_of_epoch(key[0])[key[1]]
            # The row order is ~a dozen NumPy calls: on the read-ahead thread each is a GIL
            # hand-off with this thread, so it is computed here when the size is known.
            rows = self._group_rows.get(where)
            order = self.lane_files.row_order(key[0], *where, rows) if key[0] > 0 and rows is not None else None
            self._ahead.submit(key, where, order)

    def start_reading(self) -> None:
        """Queue the read of the cursor's block in the background (with read-ahead on).

        A lane's first block is otherwise read when its first sequence is asked for: the
        second micro-batch of a fresh loader, the first to use lanes 8-15 of 16, waited for
        their reads (bench/HISTORY.md, "Issue 16: the harness audit"), and a worker read its
        lanes' blocks one after another. A block that cannot be read or does not exist is left
        to the read the stream really makes (it raises there, naming the file or the state's
        path).
        """
        if not self.read_ahead or self.exhausted or self._block is not None or len(self._ahead):
            return
        key = (self.epoch, self.block_index)
        try:
            blocks = self.blocks_of_epoch(key[0])
        except Exception:  # noqa: BLE001 - raised again, with its context, by the stream's own read
            log.debug("lane %d of source %r: epoch %d's blocks are not known yet; the stream's own read "
                      "raises the error", self.lane_id, self.source_name, key[0], exc_info=True)
            return
        if key[1] < len(blocks):
            self._ahead.submit(key, blocks[key[1]], None)

    def _read_queued_block(self, key: tuple[int, int], where: tuple[int, int], order: Optional[np.ndarray]) -> Block:
        return self._read_block(key[0], *where, order=order)

    def wait_for_read_ahead(self) -> None:
        """Block until every read queued ahead has finished (the blocks stay queued)."""
        self._ahead.wait()

    def _settle_read_ahead(self, wanted: Optional[tuple[int, int]] = None) -> Optional[Block]:
        """The block ``wanted`` if it is the next one read ahead, else None (all reads dropped).
        The one way a block leaves the read-ahead: claimed here (:meth:`Block.claim`)."""
        block = self._ahead.take(wanted)
        if block is not None:
            block.claim()
        return block
