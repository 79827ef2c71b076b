"""One lane of one source as a positional token stream.

A lane's files are cut into *blocks* (one Parquet row group each), replayed epoch after
epoch in the order of :mod:`loader.order.epochs`. Each block becomes one token array
(:mod:`loader.io.blocks`); the stream's position is three integers::

    cursor = (epoch, block, offset)      offset = tokens of the block already consumed

so a checkpoint never holds tokens for this stage, and restoring reads exactly one block.
Text blocks are tokenized as the cursor advances (:class:`~loader.io.blocks.TextBlock`); a text
cursor's state also names the document it is in (``document``), so restoring a text lane
tokenizes its block from that document on (:meth:`~loader.io.blocks.TextBlock.skip_to`), not
from the block's first document.
The next blocks are read in the background (:mod:`loader.io.read_ahead`), and every file and
row group is checked as it is read (:mod:`loader.io.integrity`).

State keys (``get_state``): ``epoch``, ``block``, ``offset``, ``exhausted``; text lanes inside a
block ``document`` (``{index, token_start, char_start}``: :meth:`~loader.io.blocks.TextBlock.document_at`); with transforms
(:mod:`loader.transforms`), or tombstones of ``zephon shard --transform`` in the lane files (the
offline transforms' counters first), also ``transforms``: per transform ``[dropped, changed]`` documents of
the blocks before the cursor's, and of the cursor's own once it has taken from it (counters
only: a dropped document yields no tokens, and the cursor counts tokens of the transformed
block, which every process rebuilds alike).
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loader.errors import EmptyLaneError, LaneDataError, StateError, ZephonError
from loader.io import storage
from loader.io.blocks import Block, Chunk, DocumentsView, TextBlock, TokenFormat
from loader.io.integrity import FIX, check_footer, check_no_unlisted_files, check_row_group, verify_local_file
from loader.io.manifest import CONVERSATION_COLUMN, MANIFEST_NAME, TOMBSTONE_COLUMN, FileEntry, Manifest
from loader.io.read_ahead import READ_AHEAD_BLOCKS, ReadAheadQueue, prepare_later
from loader.io.reject_tally import RejectTally
from loader.kinds.base import BlockSource, lane_kind
from loader.metrics import note_row_group_read
from loader.order.epochs import epoch_blocks, row_order
from loader.stages.features import Feature, column_features, slice_features
from loader.transforms.chain import TransformCounts, chain_for
from loader.transforms.conversations import chat_transforms_for
from loader.transforms.rows import LazyColumns, apply_transforms, extra_columns, tombstone_rows, with_tombstones

log = logging.getLogger(__name__)


def _prepare_block(key: tuple[int, int], block: Block) -> None:
    """A block just read ahead (``key``: its epoch and index): its remaining decoding (an online
    chat block's render, tokenization and masks) queued on the prepare thread; blocks with
    nothing to prepare (pre-tokenized, text: see ``TextBlock``) cost nothing here."""
    prepare = type(block).prepare
    if not block.complete and prepare is not Block.prepare:
        prepare_later(prepare, block, key)  # the unbound method: the block itself is held weakly


# Set by ZephonLoader.load_state_dict in a restored cursor saved under other transforms
# (declared with transforms_from_step); never written by get_state.
TRANSFORMS_CHANGED = "_transforms_changed"


_EDITED = "the state was edited or comes from other data: restore an unmodified checkpoint of this dataset"


class LaneTokenStream:
    """Tokens of one (source, lane), epoch after epoch, addressed by a three-int cursor."""

    # ``(epoch, block, offset)``: the cursor of the first token the last ``take`` returned (a
    # best-fit bin saves it per piece: ``piece_origins``). One tuple per take, kept beside the
    # chunk rather than in it: a field of the frozen ``Chunk`` costs every chunk a setattr.
    last_origin: Optional[tuple[int, int, int]] = None

    # Whether a whole epoch of empty blocks ends the stream at its last epoch (finite data with
    # filled tails: loader.stages.lane) instead of being an EmptyLaneError.
    ends_when_empty = False

    def __init__(
        self,
        *,
        dataset_path: str,
        manifest: Manifest,
        source_name: str,
        lane_id: int,
        seed: int,
        token_format: TokenFormat,
        tokenizer=None,  # a tokenizers.Tokenizer for text lanes; None for pre-tokenized
        max_epochs: Optional[int] = None,
        storage_options: storage.StorageOptions = storage.StorageOptions(),
        read_ahead: bool = False,
        read_ahead_threads: int = 1,
        read_ahead_blocks: int = READ_AHEAD_BLOCKS,
        transforms: tuple = (),  # resolved loader.transforms.TransformSpec of this source, in order
        chat=None,  # a loader.chat.block.OnlineChat for online chat lanes (manifest.online_chat)
        images=None,  # a loader.vision.block.ImageOptions for image lanes (manifest.images)
    ) -> None:
        # Image lanes: text, segments and image sizes become tokens, loss_mask and image_ref in
        # the block (loader.vision.block); image bytes are read only to resolve refs.
        self.images = images
        # Online chat: the conversation column is rendered, tokenized and masked by its block
        # (loader.chat.block), whose rejects the tally reports once per block entered.
        self.chat = chat
        # The lane's kind (loader.kinds) decodes its row groups and names the columns it adds.
        self.kind = lane_kind(manifest.kind, pretokenized=manifest.pretokenized, chat=chat, images=images)
        self._kind_columns = self.kind.lane_columns({c.get("name") for c in manifest.schema})
        # Online rejects of chat and image blocks, reported once per block entered.
        self.chat_rejects = RejectTally() if self.kind.rejects_online else None
        self.dataset_path = dataset_path
        self.source_name = source_name
        self.lane_id = lane_id
        self.seed = seed
        self.token_format = token_format
        self.tokenizer = tokenizer
        self.max_epochs = max_epochs
        self.storage_options = storage_options
        self.pretokenized = manifest.pretokenized
        # Text lanes tokenize online: their states say which document the cursor is in, so that
        # a restore tokenizes from there (``document``, see TextBlock.skip_to).
        self.resumes_at_document = not self.pretokenized and chat is None and images is None
        # Per-token features read with the ids: the registered columns the lane files hold
        # (the manifest's schema lists them; only pre-tokenized ids have values to align with).
        self.features: tuple[Feature, ...] = column_features(
            c.get("name") for c in manifest.schema) if self.pretokenized else ()
        if not self.pretokenized and tokenizer is None:
            raise ValueError("a tokenizer is needed for text lanes")
        self.files: list[FileEntry] = manifest.lane_files(lane_id)  # rows >= 1 each (Manifest.from_dict)
        if not storage.is_remote(dataset_path):
            check_no_unlisted_files(dataset_path, lane_id, self.files)
        if not self.files:
            raise LaneDataError(
                f"lane {lane_id} of source {source_name!r} ({dataset_path}) has no documents: its "
                f"{MANIFEST_NAME} lists no file of the lane. The dataset has {manifest.documents} documents "
                f"in {manifest.num_lanes} lanes; "
                "re-shard it with fewer lanes (--num-lanes) so that every lane holds data."
            )
        self._row_groups: dict[int, int] = {}
        # Rows of each (file, row group) read so far (dict writes are atomic): lets the reads
        # of later epochs get their row order computed on the thread that queues them.
        self._group_rows: dict[tuple[int, int], int] = {}
        # Tokens of each row group read so far, per file, until the file's total is checked.
        self._file_group_tokens: dict[int, dict[int, int]] = {}
        self._tokens_checked: set[int] = set()
        self._epoch_blocks: dict[int, list[tuple[int, int]]] = {}
        self._open_file: tuple[int, pq.ParquetFile, object] | None = None
        self._block_key: tuple[int, int] | None = None
        self._block: Optional[Block] = None
        self.epoch = 0
        self.block_index = 0
        self.offset = 0
        self.exhausted = False
        self._restored_path: Optional[str] = None  # a restored cursor not yet checked against its block
        # A restored text cursor's document (TextBlock.document_at), until its block is read: the
        # block is then tokenized from that document on (TextBlock.skip_to), and the hint checked.
        self._restored_document: Optional[dict] = None
        self.read_ahead = read_ahead
        self.read_ahead_threads = read_ahead_threads
        self.read_ahead_blocks = read_ahead_blocks  # see read_ahead_depth
        # Blocks being read in the background, in stream order, keyed (epoch, block).
        self._ahead = ReadAheadQueue(self._read_queued_block, read_ahead_threads, prepare=_prepare_block)
        # The next block, read early by documents_ahead: ((epoch, block), Block).
        self._peeked: Optional[tuple[tuple[int, int], Block]] = None
        # Transforms (loader.transforms): the source's chain, the columns it reads, and the
        # counts of the blocks before the current one; a restored state's counts wait in
        # _restored_counts until the cursor's block is read again.
        if chat is not None:  # records before the render, tokens after (loader.transforms.conversations)
            self.transforms = chat_transforms_for(transforms, seed=seed, source=source_name)
        else:
            self.transforms = chain_for(transforms, seed=seed, source=source_name, pretokenized=self.pretokenized,
                                        feature_names=self.feature_names,
                                        vocab_size=(manifest.tokenizer or {}).get("vocab_size"))
        self._transform_columns = extra_columns(self.transforms, manifest)
        # A dataset sharded with --transform holds tombstones (dropped_by >= 0): skipped at decode,
        # counted like online drops, before the config's own transforms (the counters' order).
        self.tombstone_transforms = manifest.tombstone_transforms if manifest.has_tombstones else ()
        self.counted_transforms = len(self.tombstone_transforms) + (len(self.transforms) if self.transforms else 0)
        self.counting = manifest.has_tombstones or self.transforms is not None
        self._counts_before = TransformCounts.zeros(self.counted_transforms) if self.counting else None
        self._restored_counts: Optional[tuple[TransformCounts, bool]] = None
        self._counts_memo: list = [None, None]  # counts without / with the current block (see _counts_at)
        # (file, row group) of the blocks left empty since the last one with tokens: all of the
        # lane's blocks is an error, not a hang (_note_block_left)
        self._empty_blocks: set[tuple[int, int]] = set()

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The features every chunk of this stream carries (registry order)."""
        if self.images is not None:  # made by the image block (loader.vision.block; chat: loader.vision.chat)
            return ("loss_mask", "image_ref")
        if self.chat is not None:
            return ("loss_mask",)  # made by the chat block, not read from a column
        return tuple(f.name for f in self.features)

    # -- state -------------------------------------------------------------------------
    def get_state(self) -> dict:
        return self._cursor_state(self.epoch, self.block_index, self.offset, self.exhausted)

    @property
    def state_is_cursor(self) -> bool:
        """Whether :meth:`get_state` is the four cursor values alone (no transform counters, no
        text document), so that a packer may save the cursor as four integers until it is used."""
        return not self.counting and not self.resumes_at_document

    def _cursor_state(self, epoch: int, block_index: int, offset: int, exhausted: bool) -> dict:
        """The state of a cursor at ``(epoch, block_index, offset)`` (this one's or one it
        will reach in the current or next block: a bulk reader's)."""
        state = {"epoch": epoch, "block": block_index, "offset": offset, "exhausted": exhausted}
        if self.counting:
            state["transforms"] = self._counts_at(epoch, block_index, offset)
        if self.resumes_at_document and offset > 0 and not exhausted:
            self._add_document(state, epoch, block_index, offset)
        return state

    def _add_document(self, state: dict, epoch: int, block_index: int, offset: int) -> None:
        """A text cursor's ``document`` (:meth:`~loader.io.blocks.TextBlock.document_at`), from
        the block that holds it."""
        if self._restored_document is not None and self._restored_path is not None:
            state["document"] = dict(self._restored_document)  # not moved since the restore
            return
        for key, block in ((self._block_key, self._block), self._peeked or (None, None)):
            if key == (epoch, block_index) and isinstance(block, TextBlock) and offset <= len(block.tokens):
                state["document"] = block.document_at(offset)
                return

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

    def set_state(self, state: dict, path: str = "stream") -> None:
        """Continue from ``state``, checked by ``loader.checkpoint.schema`` (``ZephonLoader.load_state_dict``).

        What only the data can tell is checked when the cursor's block is first read: that
        the block exists (manifests without row-group counts) and that ``offset`` lies inside
        its tokens; a :class:`~loader.checkpoint.state.StateError` then names ``path`` (the cursor's JSON
        path in the checkpoint).
        """
        self.epoch = int(state["epoch"])
        self.block_index = int(state["block"])
        self.offset = int(state["offset"])
        self.exhausted = bool(state.get("exhausted", False))
        self._restored_path = None if self.exhausted else path
        document = state.get("document")
        # Only text streams use it (a stream whose blocks are not TextBlocks, the audit's, reads without).
        use = document is not None and not self.exhausted and self.resumes_at_document
        self._restored_document = {k: int(v) for k, v in document.items()} if use else None
        if self.chat_rejects is not None:
            self.chat_rejects.restore(self.epoch, self.block_index, self.offset)
        if self.counting:
            if state.get(TRANSFORMS_CHANGED):
                self._restore_after_transform_change()
                return
            saved = state.get("transforms")
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

    # -- epoch layout ------------------------------------------------------------------
    def _num_row_groups(self, file_ordinal: int) -> int:
        if file_ordinal not in self._row_groups:
            entry = self.files[file_ordinal]
            if entry.row_groups > 0:
                self._row_groups[file_ordinal] = entry.row_groups
            else:
                self._row_groups[file_ordinal] = self._parquet(file_ordinal).metadata.num_row_groups
        return self._row_groups[file_ordinal]

    def blocks_of_epoch(self, epoch: int) -> list[tuple[int, int]]:
        """``(file_ordinal, row_group)`` pairs in the order epoch ``epoch`` replays them."""
        if epoch not in self._epoch_blocks:
            if len(self._epoch_blocks) > 2:
                self._epoch_blocks.clear()
            row_groups = [self._num_row_groups(f) for f in range(len(self.files))]
            self._epoch_blocks[epoch] = epoch_blocks(self.seed, self.source_name, self.lane_id, epoch, row_groups)
        return self._epoch_blocks[epoch]

    # -- reading -----------------------------------------------------------------------
    def _parquet(self, file_ordinal: int) -> pq.ParquetFile:
        if self._open_file is None or self._open_file[0] != file_ordinal:
            self._close_file()
            entry = self.files[file_ordinal]
            path = storage.join(self.dataset_path, entry.path)
            handle = storage.open_lane_file(self.dataset_path, entry, self.storage_options)
            try:
                if self.storage_options.verify_local_files and not storage.is_remote(path):
                    verify_local_file(path, handle, entry)
                # pre_buffer (pyarrow's default) sends every local row-group read through
                # Arrow's I/O thread pool with an fadvise first: 150-350 us per read for
                # nothing when the file is in the page cache (bench/RESULTS.md, "Token column
                # codec and lane file access"). Remote files keep it: it coalesces ranged reads.
                parquet = pq.ParquetFile(handle, page_checksum_verification=True,
                                         pre_buffer=storage.is_remote(self.dataset_path))
                check_footer(parquet.metadata, entry, path)
            except BaseException as exc:
                handle.close()  # pyarrow closes only sources it opened itself
                if isinstance(exc, ZephonError) or not isinstance(exc, Exception):
                    raise  # already names the file and the fix (a 403 is not corruption), or Ctrl-C
                # Whatever pyarrow raises on bad bytes (ArrowInvalid, OSError, ...) names the file.
                raise LaneDataError(
                    f"{path} is not a readable Parquet file ({type(exc).__name__}: {exc}); it is corrupt "
                    f"or truncated: {FIX}"
                ) from exc
            self._open_file = (file_ordinal, parquet, handle)
        return self._open_file[1]

    def close(self) -> None:
        """Release the open lane file (file descriptors are not left to the GC)."""
        self._settle_read_ahead()
        self._peeked = None
        self._close_file()

    def _close_file(self) -> None:  # also on the read-ahead thread, which must not settle itself
        if self._open_file is not None:
            _, parquet, handle = self._open_file
            parquet.close()
            handle.close()  # pyarrow closes only sources it opened itself
            self._open_file = None

    def _load_block(self, epoch: int, block_index: int) -> Block:
        if self._block_key == (epoch, block_index) and self._block is not None:
            return self._block  # checked first: this is the per-sequence path
        key = (epoch, block_index)
        if self._restored_path is not None:  # before the read: the block may not exist
            self._check_restored_cursor(epoch, block_index)
        block = None
        if self._peeked is not None and self._peeked[0] == key:
            block, self._peeked = self._peeked[1], None
        else:
            block = self._settle_read_ahead(wanted=key)
        if block is None:
            block = self._read_block(epoch, *self.blocks_of_epoch(epoch)[block_index])
        if self.chat_rejects is not None:
            self.chat_rejects.register(key, block)
        if self.counting:
            self._block_loaded(key, block)
        self._block_key, self._block = key, block
        if self._restored_path is not None:
            self._check_restored_cursor(epoch, block_index, block)
        if self.read_ahead:
            self._start_read_ahead(epoch, block_index)
        return block

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
            order = self._row_order(key[0], *where, rows) if key[0] > 0 and rows is not None else None
            self._ahead.submit(key, where, order)

    def start_reading(self) -> None:
        """Queue the read of the cursor's block in the background (with read-ahead on).

        A lane's first block is otherwise read when its first sequence is asked for: the
        second micro-batch of a fresh loader, the first to use lanes 8-15 of 16, waited for
        their reads (bench/RESULTS.md, issue 16), and a worker read its lanes' blocks one
        after another. A block that cannot be read or does not exist is left to the read the
        stream really makes (it raises there, naming the file or the state's path).
        """
        if not self.read_ahead or self.exhausted or self._block is not None or len(self._ahead):
            return
        key = (self.epoch, self.block_index)
        try:
            blocks = self.blocks_of_epoch(key[0])
        except Exception:  # noqa: BLE001 - raised again, with its context, by the stream's own read
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

    def _row_order(self, epoch: int, file_ordinal: int, row_group: int, rows: int) -> np.ndarray:
        """The order epoch ``epoch`` replays the rows of a row group in (int64)."""
        return row_order(self.seed, self.source_name, self.lane_id, epoch, file_ordinal, row_group, rows)

    def _read_block(self, epoch: int, file_ordinal: int, row_group: int, order: Optional[np.ndarray] = None) -> Block:
        """``order``: the row order of ``epoch`` > 0 if already computed (else computed here).

        Errors name the file and row group; on a read-ahead thread they travel in the read's
        future and are raised to whoever takes the block (in a worker process, inside the
        ``WorkerError`` that carries the worker's traceback).
        """
        entry = self.files[file_ordinal]
        path = storage.join(self.dataset_path, entry.path)
        column = "input_ids" if self.pretokenized else CONVERSATION_COLUMN if self.chat is not None else "text"
        try:
            parquet = self._parquet(file_ordinal)
            # One column: pyarrow's thread pool parallelises across columns, so for us it is
            # only a hand-off (and more threads per worker process); ~8% less CPU without.
            columns = [column] + [f.column for f in self.features] + list(self._kind_columns) + (
                [TOMBSTONE_COLUMN] if self.tombstone_transforms else [])  # last: popped below
            table = parquet.read_row_group(row_group, columns=columns, use_threads=False)
            note_row_group_read(parquet.metadata.row_group(row_group), columns)  # loader.metrics
            # combine_chunks copies even a single chunk
            values, *feature_columns = [c.chunk(0) if c.num_chunks == 1 else c.combine_chunks() for c in table.columns]
            check_row_group(len(values), parquet.metadata, row_group, path)
            self._group_rows[(file_ordinal, row_group)] = len(values)
            if epoch > 0 and (order is None or len(order) != len(values)):
                order = self._row_order(epoch, file_ordinal, row_group, len(values))
            rows = order if epoch > 0 else None  # the rows in replay order (None: all, as stored)
            tombstones = None
            if self.tombstone_transforms:  # skipped as online drops, in the same replay order
                rows, tombstones = tombstone_rows(feature_columns.pop(), rows, self.tombstone_transforms, path,
                                                  row_group)
            if rows is not None:
                # Arrow's take copies the rows in C++ without the GIL (on the read-ahead thread a
                # Python loop over the rows would stall the trainer's thread). Indices from the
                # buffer: pa.array(ndarray) imports pandas when it is installed, a fraction of a
                # second on the first call, paid by a restore's first batch.
                indices = pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])
                values = pc.take(values, indices)
                feature_columns = [pc.take(c, indices) for c in feature_columns]
            if self.transforms is not None:  # key, metadata (...) columns: read if a function asks
                transform_columns = LazyColumns(
                    lambda names: self._extra_columns(parquet, row_group, names, indices if rows is not None else None),
                    self._transform_columns)
            counts = None
            if self.transforms is not None and not self.pretokenized and self.chat is None:  # text: before tokenization
                texts = values.to_pylist()
                kept, counts = apply_transforms(self.transforms, transform_columns, texts=texts)
                if kept is not texts:
                    values = pa.array(kept, pa.string())
            block = self.kind.decode(BlockSource(
                values=values, columns=feature_columns, column_names=self._kind_columns, features=self.features,
                token_format=self.token_format, tokenizer=None if self.pretokenized else self.tokenizer, where=path,
                row_group=row_group, chat=self.chat, images=self.images, epoch=epoch,
                block_of=lambda: self.blocks_of_epoch(epoch).index((file_ordinal, row_group))))
            if self.chat is not None and self.transforms is not None:  # around the render (loader.chat.block)
                block.transform(self.transforms, transform_columns)
                counts = block.transform_counts
            if not self.pretokenized:
                block.transform_counts = with_tombstones(tombstones, counts, self.transforms)
                return block  # text: the manifest has no token totals to check against
        except ZephonError:
            raise  # already names the file (a StorageError also says what to do about storage)
        except Exception as exc:  # whatever pyarrow or numpy raise on bad bytes
            raise LaneDataError(
                f"{path}: row group {row_group} cannot be read ({type(exc).__name__}: {exc}); the file is "
                f"corrupt: {FIX}"
            ) from exc
        documents = len(block.doc_starts) - 1
        self._note_group_tokens(file_ordinal, row_group, len(block.tokens) - self.token_format.extra * documents)
        counts = None
        if self.transforms is not None:  # pre-tokenized: on the ids and features, after the checks
            block, counts = apply_transforms(self.transforms, transform_columns, block=block,
                                             token_format=self.token_format)
        if self.counting:
            block.transform_counts = with_tombstones(tombstones, counts, self.transforms)
        return block

    @staticmethod
    def _extra_columns(parquet: pq.ParquetFile, row_group: int, names, indices) -> dict:
        """Columns of a row group the transforms asked for, in the block's (epoch) row order."""
        table = parquet.read_row_group(row_group, columns=list(names), use_threads=False)
        columns = {n: c.chunk(0) if c.num_chunks == 1 else c.combine_chunks() for n, c in zip(names, table.columns)}
        return columns if indices is None else {n: pc.take(c, indices) for n, c in columns.items()}

    def _note_group_tokens(self, file_ordinal: int, row_group: int, tokens: int) -> None:
        """Once every row group of a file has been read, its tokens must be the manifest's."""
        if file_ordinal in self._tokens_checked:
            return
        seen = self._file_group_tokens.setdefault(file_ordinal, {})
        seen[row_group] = tokens
        if len(seen) < self._num_row_groups(file_ordinal):
            return
        entry = self.files[file_ordinal]
        total = sum(seen.values())
        del self._file_group_tokens[file_ordinal]
        self._tokens_checked.add(file_ordinal)
        if entry.tokens is not None and total != entry.tokens:
            raise LaneDataError(
                f"{storage.join(self.dataset_path, entry.path)}: its {len(seen)} row groups hold {total} tokens, "
                f"the manifest says {entry.tokens}: the file or the manifest is corrupt; {FIX}"
            )

    def _advance_block(self) -> None:
        self._note_block_left()
        self.block_index += 1
        self.offset = 0
        if self.block_index >= len(self.blocks_of_epoch(self.epoch)):
            self.epoch += 1
            self.block_index = 0
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                self.exhausted = True

    def _note_block_left(self) -> None:
        """Refuse a lane left without tokens in every one of its blocks: every conversation
        rejected online (chat), every document dropped (transforms, or tombstones of ``zephon
        shard --transform``). Its stream would otherwise search for a token forever.

        Counted by block identity, not by blocks in a row: a run of empty blocks as long as an
        epoch can span two epochs, each shuffled, and miss the block with tokens (the tail of
        one epoch and the head of the next may hold the same empty blocks twice). Whether a
        block is empty does not depend on the epoch (its rows are permuted, not changed)."""
        empty = self._block is not None and self._block_key == (self.epoch, self.block_index) \
            and len(self._block.tokens) == 0
        if not empty:
            self._empty_blocks.clear()
            return
        if self.ends_when_empty:  # finite data with filled tails: such a lane is simply done
            return
        blocks = self.blocks_of_epoch(self.epoch)
        self._empty_blocks.add(tuple(blocks[self.block_index]))
        if len(self._empty_blocks) >= len(blocks):
            raise EmptyLaneError(self._empty_lane_message())

    def _empty_lane_message(self) -> str:
        where = f"lane {self.lane_id} of source {self.source_name!r} ({self.dataset_path})"
        if self.chat is not None and not self.counting:
            reason = ("every conversation is rejected online (empty_loss_mask, full_loss_mask or too_long: see the "
                      "log and batch['chat_rejects'])")
            fix = "fix the template, --chat-loss-on or --chat-max-tokens and re-shard"
        elif self.counting:
            names = [f"{name} (zephon shard --transform)" for name in self.tombstone_transforms]
            names += [spec.function for spec in self.transforms.specs] if self.transforms is not None else []
            reason = "every document is dropped by its transforms (" + ", ".join(names) + ")" + (
                " or rejected online" if self.chat is not None else "")
            fix = ("loosen the filters, or re-shard so that the lane holds documents they keep (fewer --num-lanes)"
                   if self.transforms is None else "loosen the filters, or filter offline (zephon shard --transform)")
        else:
            reason = "every document is empty (no tokens, and no BOS/EOS configured)"
            fix = "configure bos/eos tokens, or re-shard without the empty documents"
        return f"{where}: {reason} in every block of the lane: it can never produce a sequence; {fix}"

    def at_document_start(self) -> bool:
        """True when the next token is a document's first (or nothing is left)."""
        if self.exhausted or self.offset == 0:
            return True
        block = self._load_block(self.epoch, self.block_index)
        block.ensure(self.offset)
        k = np.searchsorted(block.doc_starts, self.offset)
        return k < len(block.doc_starts) and block.doc_starts[k] == self.offset

    def documents_ahead(self, min_tokens: int) -> Optional[DocumentsView]:
        """The documents a bulk reader may take from the cursor on (see :class:`DocumentsView`).

        The current block is tokenized to at least ``min_tokens`` past the cursor (text); the
        next block joins the view only when fewer than ``min_tokens`` are left in this one.
        None when the stream is exhausted.
        """
        if self.exhausted:
            return None
        block = self._load_block(self.epoch, self.block_index)
        block.ensure(self.offset + min_tokens)
        blocks, starts, features = [block.tokens], block.doc_starts, [block.features]
        short = len(block.tokens) - self.offset < min_tokens  # else the next block is not needed yet
        if short and block.complete and self.block_index + 1 < len(self.blocks_of_epoch(self.epoch)):
            following = self._next_block_in_epoch()
            # A text block is tokenized only once the cursor reaches it: tokenizing it here
            # would front-load work (first batch, restore) for every lane at once.
            if following.complete:
                blocks.append(following.tokens)
                features.append(following.features)
                starts = np.concatenate([starts[:-1], following.doc_starts + len(block.tokens)])
        lo = starts.searchsorted(self.offset, side="right")
        hi = starts.searchsorted(sum(len(b) for b in blocks), side="left")
        return DocumentsView(blocks=blocks, cursor=self.offset, ends=starts[lo:hi],
                             epoch=self.epoch, block_index=self.block_index, features=tuple(features))

    def _next_block_in_epoch(self) -> Block:
        """The block after the current one (same epoch), kept until the cursor gets there."""
        key = (self.epoch, self.block_index + 1)
        if self._peeked is not None and self._peeked[0] == key:
            return self._peeked[1]
        block = self._settle_read_ahead(wanted=key)  # the read-ahead's head, or nothing pending
        if block is None:
            block = self._read_block(key[0], *self.blocks_of_epoch(key[0])[key[1]])
        if self.chat_rejects is not None:
            self.chat_rejects.register(key, block)
        self._peeked = (key, block)
        return block

    def move_to(self, view: DocumentsView, position: int) -> None:
        """Put the cursor at a virtual position of ``view`` (bulk readers)."""
        block_index = self.block_index
        self.block_index, self.offset = view.where(position)
        if self.block_index != block_index:  # past a block that held documents
            self._empty_blocks.clear()

    def state_at(self, view: DocumentsView, position: int) -> dict:
        """The state with the cursor at a virtual position of ``view``."""
        block_index, offset = view.where(position)
        return self._cursor_state(view.epoch, block_index, offset, False)

    def rewound_state(self, rows: int, row_len: int) -> dict:
        """The state before the last ``rows`` rows of ``row_len`` (all in the current block)."""
        return self._cursor_state(self.epoch, self.block_index, self.offset - rows * row_len, self.exhausted)

    def take_rows(self, row_len: int, max_rows: int) -> Optional[Chunk]:
        """Up to ``max_rows`` whole rows of ``row_len`` tokens from the current block, or None.

        The bulk form of ``take(row_len)`` repeated: it returns only rows that end strictly
        inside the current block (so the cursor stays in the block and one subtraction undoes
        the rows not used yet) and None when not even one row does; the caller then falls
        back to :meth:`take`. ``tokens`` has length ``k * row_len``.
        """
        if self.exhausted:
            return None
        block = self._load_block(self.epoch, self.block_index)
        block.ensure(self.offset + row_len)
        offset = self.offset
        rows = min(max_rows, (len(block.tokens) - offset - 1) // row_len)
        if rows < 1:
            return None
        end = offset + rows * row_len
        self.offset = end
        doc_starts = block.doc_starts
        lo, hi = doc_starts.searchsorted(offset), doc_starts.searchsorted(end)
        return Chunk(tokens=block.tokens[offset:end], doc_starts=doc_starts[lo:hi] - offset,
                     features=slice_features(block.features, offset, end))

    def take(self, n: int, *, within_document: bool = False) -> Optional[Chunk]:
        """Up to ``n`` tokens from the cursor on (fewer only at exhaustion or a document end).

        With ``within_document`` the chunk stops at the end of the current document. Returns
        None when the stream is exhausted. :attr:`last_origin` is then the cursor of the
        chunk's first token (a best-fit bin saves it per piece: ``piece_origins``).
        """
        if self.exhausted:
            return None
        # Fast path, nearly every call: the chunk lies inside the current block and does not
        # reach its end (so no block change can follow).
        block = self._load_block(self.epoch, self.block_index)
        block.ensure(self.offset + n)
        offset, doc_starts = self.offset, block.doc_starts
        if offset < len(block.tokens):
            end = offset + n
            if within_document:
                end = min(end, int(doc_starts[doc_starts.searchsorted(offset, side="right")]))
            if offset < end < len(block.tokens):
                self.offset = end
                lo, hi = doc_starts.searchsorted(offset), doc_starts.searchsorted(end)
                self.last_origin = (self.epoch, self.block_index, offset)
                return Chunk(tokens=block.tokens[offset:end], doc_starts=doc_starts[lo:hi] - offset,
                             features=slice_features(block.features, offset, end))
        pieces: list[np.ndarray] = []
        feature_pieces: list = []
        starts: list[np.ndarray] = []
        taken = 0
        while taken < n and not self.exhausted:
            block = self._load_block(self.epoch, self.block_index)
            offset = self.offset
            block.ensure(offset + n - taken)  # so that a short block means its real end
            tokens, doc_starts = block.tokens, block.doc_starts
            available = len(tokens) - offset
            if available <= 0:
                self._advance_block()
                continue
            count = min(n - taken, available)
            if within_document:
                next_doc = int(doc_starts[doc_starts.searchsorted(offset, side="right")])
                count = min(count, next_doc - offset)
            lo = doc_starts.searchsorted(offset)
            hi = doc_starts.searchsorted(offset + count)
            if not pieces:
                self.last_origin = (self.epoch, self.block_index, offset)
            pieces.append(tokens[offset : offset + count])
            feature_pieces.append(slice_features(block.features, offset, offset + count))
            starts.append(doc_starts[lo:hi] - (offset - taken))
            self.offset = offset + count
            taken += count
            if self.offset >= len(tokens):
                self._advance_block()
            if within_document:
                break
        if taken == 0:
            return None
        tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        doc_starts = starts[0] if len(starts) == 1 else np.concatenate(starts)
        features = feature_pieces[0]
        if len(feature_pieces) > 1 and features:  # a stream's blocks all carry its features
            features = {name: np.concatenate([f[name] for f in feature_pieces]) for name in features}
        return Chunk(tokens=tokens, doc_starts=doc_starts, features=features)
