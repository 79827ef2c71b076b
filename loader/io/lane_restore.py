"""A lane stream's restore: a checkpointed cursor set, then checked against its block when read."""

from __future__ import annotations

from typing import Optional

import numpy as np

from loader.errors import StateError
from loader.io.blocks import Block, TextBlock
from loader.io.cursor_record import BLOCK, DOCUMENT, EPOCH, EXHAUSTED, OFFSET, TRANSFORMS
from loader.transforms.chain import TransformCounts

# Set by ZephonLoader.load_state_dict in a restored cursor saved under other transforms
# (declared with transforms_from_step); never written by get_state.
TRANSFORMS_CHANGED = "_transforms_changed"


_EDITED = "the state was edited or comes from other data: restore an unmodified checkpoint of this dataset"


class CursorRestore:
    """A base of :class:`~loader.io.lane_reader.LaneTokenStream`: a restored cursor.

    ``set_state`` takes what the checkpoint schema checked; what only the data can tell (the
    block exists, the offset lies inside it, a text cursor's document) is checked when the
    cursor's block is first read (``_restored_path`` until then).
    """

    def block_at(self, epoch: int, block_index: int) -> Optional[Block]:
        """Block ``block_index`` of ``epoch`` as this stream decodes it (the current one when it
        is), without moving the cursor; None when the epoch has no such block. What a restored
        best-fit bin's pieces are checked against (``BestFitPacker.set_state``)."""
        if self._block_key == (epoch, block_index) and self._block is not None:
            return self._block
        blocks = self.blocks_of_epoch(epoch)
        if not 0 <= block_index < len(blocks):
            return None
        return self._read_block(epoch, *blocks[block_index])

    def set_state(self, state: dict, path: str = "stream") -> None:
        """Continue from ``state``, checked by ``loader.checkpoint.schema`` (``ZephonLoader.load_state_dict``).

        What only the data can tell is checked when the cursor's block is first read: that
        the block exists (manifests without row-group counts) and that ``offset`` lies inside
        its tokens; a :class:`~loader.checkpoint.state.StateError` then names ``path`` (the cursor's JSON
        path in the checkpoint).
        """
        self.epoch = int(state[EPOCH])
        self.block_index = int(state[BLOCK])
        self.offset = int(state[OFFSET])
        self.exhausted = bool(state.get(EXHAUSTED, False))
        self._restored_path = None if self.exhausted else path
        document = state.get(DOCUMENT)
        # Only text streams use it (a stream whose blocks are not TextBlocks, the audit's, reads without).
        use = document is not None and not self.exhausted and self.resumes_at_document
        self._restored_document = {k: int(v) for k, v in document.items()} if use else None
        if self.chat_rejects is not None:
            self.chat_rejects.restore(self.epoch, self.block_index, self.offset)
        if self.counting:
            if state.get(TRANSFORMS_CHANGED):
                self._restore_after_transform_change()
                return
            saved = state.get(TRANSFORMS)
            counts = TransformCounts.from_state(saved) if saved is not None else TransformCounts.zeros(
                self.counted_transforms)
            self._restored_counts = (counts, self.offset > 0 and not self.exhausted)
            if self._block_key == (self.epoch, self.block_index) and self._block is not None:
                key, self._block_key = self._block_key, None
                self._block_loaded(key, self._block)
                self._block_key = key
        if self._restored_path is not None and self._block_key == (self.epoch, self.block_index) \
                and self._block is not None:
            self._check_restored_cursor(self.epoch, self.block_index, self._block)

    def _restore_after_transform_change(self) -> None:
        """A cursor saved under other transforms (``transforms_from_step``): its offset counted
        tokens of another transformed block, so it moves forward to the next document start of
        this block (or its end); counters start again from zero."""
        self._counts_before = TransformCounts.zeros(self.counted_transforms)
        self._counts_memo = [None, None]
        self._restored_counts = None
        self._restored_document = None  # it named a document of the block as other transforms made it
        self._block_key = self._block = None
        if self.exhausted:
            self._restored_path = None
            return
        self._check_restored_cursor(self.epoch, self.block_index)  # the block exists
        self._restored_path = None
        block = self._load_block(self.epoch, self.block_index)
        block.ensure(self.offset)
        if self.offset >= len(block.tokens):
            self.offset = len(block.tokens)
        else:
            self.offset = int(block.doc_starts[np.searchsorted(block.doc_starts, self.offset)])

    def _check_restored_cursor(self, epoch: int, block_index: int, block: Optional[Block] = None) -> None:
        """The checks of a restored cursor that need the data (see :meth:`set_state`)."""
        path = self._restored_path
        if (epoch, block_index) != (self.epoch, self.block_index):
            return
        blocks = len(self.blocks_of_epoch(epoch))
        if block_index >= blocks:
            raise StateError(f"{path}.block: lane {self.lane_id} of source {self.source_name!r} has {blocks} "
                             f"blocks (row groups) per epoch, so block must be in [0, {blocks - 1}] (got {block_index})")
        if block is None:
            return
        document = self._restored_document
        where = f"block {block_index} of epoch {epoch} (lane {self.lane_id} of source {self.source_name!r})"
        if document is not None:
            self._check_document(block, document, path, where)
            if document["index"] > 0 and block.untouched:
                block.skip_to(document["index"], document["token_start"])
        block.ensure(self.offset)
        if self.offset > len(block.tokens):
            raise StateError(f"{path}.offset: {where} holds {len(block.tokens)} tokens, so offset must be in "
                             f"[0, {len(block.tokens)}] (got {self.offset})")
        if document is not None and block.document_at(self.offset) != document:
            raise StateError(f"{path}.document: {path}.offset {self.offset} of {where} is in the document "
                             f"{block.document_at(self.offset)} (got {document}); {_EDITED}")
        self._restored_path = None
        self._restored_document = None

    def _check_document(self, block: TextBlock, document: dict, path: str, where: str) -> None:
        """What a restored text cursor's document can be checked against before its block is
        tokenized from it: the index names a document of the block whose text starts at
        ``char_start`` (which binds it to the data), and ``token_start`` leaves room for the
        documents before it (the schema checked it against the offset)."""
        index, token_start = document["index"], document["token_start"]
        extra = self.token_format.extra  # BOS/EOS: every document has at least these tokens
        field = "index"
        if index > block.documents:
            problem = f"{where} holds {block.documents} documents, so index must be in [0, {block.documents}]"
        elif block.char_start(index) != document["char_start"]:
            field, problem = "char_start", f"document {index} of {where} starts at character {block.char_start(index)}"
        elif token_start < index * extra:
            field = "token_start"
            problem = f"{index} documents of at least {extra} tokens each cannot end at token {token_start}"
        else:
            return
        raise StateError(f"{path}.document.{field}: {problem} (got {document}); {_EDITED}")
