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

State keys (``get_state``; its record, ``cursor``: :mod:`loader.io.cursor_record`): ``epoch``, ``block``, ``offset``, ``exhausted``; text lanes inside a
block ``document`` (``{index, token_start, char_start}``: :meth:`~loader.io.blocks.TextBlock.document_at`); with transforms
(:mod:`loader.transforms`), or tombstones of ``zephon shard --transform`` in the lane files (the
offline transforms' counters first), also ``transforms``: per transform ``[dropped, changed]`` documents of
the blocks before the cursor's, and of the cursor's own once it has taken from it (counters
only: a dropped document yields no tokens, and the cursor counts tokens of the transformed
block, which every process rebuilds alike).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import numpy as np

from loader.errors import EmptyLaneError, LaneDataError
from loader.io import storage
from loader.io.blocks import Block, Chunk, DocumentsView, TextBlock, TokenFormat
from loader.io.cursor_record import BLOCK, DOCUMENT, EPOCH, EXHAUSTED, OFFSET, TRANSFORMS
from loader.io.integrity import check_no_unlisted_files
from loader.io.lane_decode import LaneBlockDecoder
from loader.io.lane_files import LaneFiles
from loader.io.lane_read_ahead import LaneReadAhead, prepare_block
from loader.io.owner import PROCESS_OWNER, StreamOwner
from loader.io.lane_restore import TRANSFORMS_CHANGED, CursorRestore
from loader.io.manifest import MANIFEST_NAME, FileEntry, Manifest
from loader.io.read_ahead import READ_AHEAD_BLOCKS, ReadAheadQueue
from loader.io.reject_tally import RejectTally
from loader.kinds.base import BlockSource, lane_kind
from loader.order.epochs import epoch_blocks, row_order
from loader.stages.features import Feature, column_features, slice_features
from loader.transforms.chain import TransformCounts, chain_for
from loader.transforms.conversations import chat_transforms_for
from loader.transforms.lane_counts import TransformCounting
from loader.transforms.rows import extra_columns

log = logging.getLogger(__name__)

__all__ = ["LaneTokenStream", "TRANSFORMS_CHANGED"]


class LaneTokenStream(LaneReadAhead, LaneBlockDecoder, CursorRestore, TransformCounting):
    """Tokens of one (source, lane), epoch after epoch, addressed by a three-int cursor: the
    :class:`~loader.stages.stream.TokenStream` the packers read.

    This class is the cursor (``take``, ``take_rows``, ``documents_ahead``, the state) and the
    current block. The lane's files and footers are a member with its own state
    (``lane_files``: :mod:`loader.io.lane_files`), reached once per block. Each other job is a
    base of its own module, sharing the stream's attributes (set here, in ``__init__``): row
    groups decoded into blocks (:mod:`loader.io.lane_decode`), the read-ahead
    (:mod:`loader.io.lane_read_ahead`), a restored cursor's checks (:mod:`loader.io.lane_restore`)
    and the transform counters (:mod:`loader.transforms.lane_counts`). Bases, not members: the
    per-sequence calls (``take``, ``_load_block``) reach every attribute without a hop.
    """

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
        owner: StreamOwner = PROCESS_OWNER,  # its background threads and I/O counters (the loader's)
    ) -> None:
        self.owner = owner
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
        self.lane_files = LaneFiles(files=self.files, dataset_path=dataset_path, storage_options=storage_options,
                                    owner=owner, seed=seed, source_name=source_name, lane_id=lane_id)
        # Rows of each (file, row group) read so far (dict writes are atomic): lets the reads
        # of later epochs get their row order computed on the thread that queues them.
        self._group_rows: dict[tuple[int, int], int] = {}
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
        self._ahead = ReadAheadQueue(self._read_queued_block, functools.partial(owner.read_ahead_pool, read_ahead_threads),
                                     prepare=functools.partial(prepare_block, owner))
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
        state = {EPOCH: epoch, BLOCK: block_index, OFFSET: offset, EXHAUSTED: exhausted}
        if self.counting:
            state[TRANSFORMS] = self._counts_at(epoch, block_index, offset)
        if self.resumes_at_document and offset > 0 and not exhausted:
            self._add_document(state, epoch, block_index, offset)
        return state

    def _add_document(self, state: dict, epoch: int, block_index: int, offset: int) -> None:
        """A text cursor's ``document`` (:meth:`~loader.io.blocks.TextBlock.document_at`), from
        the block that holds it."""
        if self._restored_document is not None and self._restored_path is not None:
            state[DOCUMENT] = dict(self._restored_document)  # not moved since the restore
            return
        for key, block in ((self._block_key, self._block), self._peeked or (None, None)):
            if key == (epoch, block_index) and isinstance(block, TextBlock) and offset <= len(block.tokens):
                state[DOCUMENT] = block.document_at(offset)
                return

    # -- reading -----------------------------------------------------------------------
    def blocks_of_epoch(self, epoch: int) -> list[tuple[int, int]]:
        """``(file_ordinal, row_group)`` pairs in the order epoch ``epoch`` replays them."""
        return self.lane_files.blocks_of_epoch(epoch)

    def close(self) -> None:
        """Release the open lane file (file descriptors are not left to the GC)."""
        self._settle_read_ahead()
        self._peeked = None
        self.lane_files.close()

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
            raise EmptyLaneError(_empty_lane_message(self))

    def current_block(self) -> Block:
        """The block under the cursor, loaded as :meth:`take` loads it (not exhausted). A bulk
        reader that works out several takes at once from its ``tokens`` and ``doc_starts``
        (``BestFitPacker``) moves :attr:`offset` and :attr:`last_origin` itself, as the fast
        path of :meth:`take` does, only to positions strictly inside the block."""
        return self._load_block(self.epoch, self.block_index)

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


def _empty_lane_message(stream) -> str:
    """Why a lane of ``stream`` can never produce a sequence, and the fix (:class:`EmptyLaneError`)."""
    where = f"lane {stream.lane_id} of source {stream.source_name!r} ({stream.dataset_path})"
    if stream.chat is not None and not stream.counting:
        reason = ("every conversation is rejected online (empty_loss_mask, full_loss_mask or too_long: see the "
                  "log and batch['chat_rejects'])")
        fix = "fix the template, --chat-loss-on or --chat-max-tokens and re-shard"
    elif stream.counting:
        names = [f"{name} (zephon shard --transform)" for name in stream.tombstone_transforms]
        names += [spec.function for spec in stream.transforms.specs] if stream.transforms is not None else []
        reason = "every document is dropped by its transforms (" + ", ".join(names) + ")" + (
            " or rejected online" if stream.chat is not None else "")
        fix = ("loosen the filters, or re-shard so that the lane holds documents they keep (fewer --num-lanes)"
               if stream.transforms is None else "loosen the filters, or filter offline (zephon shard --transform)")
    else:
        reason = "every document is empty (no tokens, and no BOS/EOS configured)"
        fix = "configure bos/eos tokens, or re-shard without the empty documents"
    return f"{where}: {reason} in every block of the lane: it can never produce a sequence; {fix}"
