"""Online image documents: a lane row group of text and images as one token block.

An image lane (``zephon shard --image-field``, :mod:`beam_jobs.image_lanes`) holds each
document's text, the ``segments`` that place its images, and per image its size (and, when
sharded with ``--image-policy``, its visual-token count). :class:`ImageBlock` turns one row
group into a block, on first use, on the thread that consumes it::

    text + segments --decode_segments--> [text | image k, ...] in order
      text parts --one batched tokenizer call per row group--> ids        loss_mask 1, image_ref -1
      image k    --[start] + [image] x n + [end]-->  n = policy.visual_tokens(w, h)
                                                     loss_mask 0, image_ref = ref on the n tokens
      document   --wrap_documents / wrap_feature--> block tokens + features

``n`` is checked against the lane's recorded count (a mismatch is a :class:`LaneDataError`
naming the file, row group and row). No image bytes are read here: the block holds positions,
and whoever assembles a sequence resolves them (:mod:`loader.vision.resolve`).

**Refs** (the ``image_ref`` feature, int64): ``epoch << 47 | block << 27 | row << 8 | image``
where ``block`` is the row group's index in the epoch's order, ``row`` the document's row in
the block (replay order) and ``image`` its index in the document. Positions, not copies, so
best-fit bins and checkpoints stay bounded (a bin state holds the refs of its tokens).

**Length** (best fit only; concat is refused for image sources because a cut would split an
image): a document with images must fit one sequence with its BOS/EOS. Longer ones follow
``images.overflow``: ``reject`` drops it (counted as ``image_document_too_long``), ``truncate``
keeps its tokens up to the fit, moved back to before an image that would be cut (a document
left with nothing is rejected). A document with more images than ``max_images_per_sequence``
can never be packed and is rejected (``too_many_images_for_sequence``). Rejects are counted on
the block (``reject_counts``), reported once per block by the stream's
:class:`loader.chat.block.RejectTally` (``batch["image_rejects"]``), and the first of each
reason is logged once per process.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional

import numpy as np

from loader.errors import LaneDataError
from loader.io.blocks import Block, TokenFormat, tokenize_documents, wrap_documents
from loader.stages.features import FEATURES, wrap_feature
from loader.vision.policies import policy_from_dict
from loader.vision.reasons import ImageRejected
from loader.vision.segments import decode_segments

log = logging.getLogger(__name__)

ONLINE_IMAGE_REJECT_REASONS = ("image_document_too_long", "too_many_images_for_sequence")
# Columns an image block reads besides ``text`` (image_visual_tokens only when the lanes have it).
METADATA_COLUMNS = ("segments", "num_images", "image_width", "image_height")
VISUAL_TOKENS_COLUMN = "image_visual_tokens"

EPOCH_BITS, BLOCK_BITS, ROW_BITS, IMAGE_BITS = 16, 20, 19, 8
_IMAGE_SHIFT, _ROW_SHIFT, _BLOCK_SHIFT, _EPOCH_SHIFT = 0, IMAGE_BITS, IMAGE_BITS + ROW_BITS, IMAGE_BITS + ROW_BITS + BLOCK_BITS

_logged: set[str] = set()
_logged_lock = threading.Lock()


def encode_ref(epoch: int, block: int, row: int, image: int) -> int:
    """The ``image_ref`` value of image ``image`` of row ``row`` of block ``block`` of ``epoch``."""
    return (epoch << _EPOCH_SHIFT) | (block << _BLOCK_SHIFT) | (row << _ROW_SHIFT) | image


def decode_ref(ref: int) -> tuple[int, int, int, int]:
    """``(epoch, block, row, image)`` of an :func:`encode_ref` value."""
    ref = int(ref)
    return (ref >> _EPOCH_SHIFT, (ref >> _BLOCK_SHIFT) & ((1 << BLOCK_BITS) - 1),
            (ref >> _ROW_SHIFT) & ((1 << ROW_BITS) - 1), ref & ((1 << IMAGE_BITS) - 1))


@dataclass(frozen=True)
class ImageOptions:
    """What every image source of a loader shares (picklable: part of ``LaneSpec``).

    ``policy``: the image-processing policy as config (``policy_from_dict``); token ids
    resolved from the tokenizer; ``start_id`` / ``end_id`` None: no such token.
    """

    policy_config: dict
    image_id: int
    start_id: Optional[int]
    end_id: Optional[int]
    overflow: str
    max_images_per_sequence: Optional[int]
    seq_len: int
    packing: str

    @cached_property
    def policy(self):
        return policy_from_dict(self.policy_config, "images.policy")

    @property
    def wrap_tokens(self) -> int:
        """Tokens around each image's placeholders."""
        return int(self.start_id is not None) + int(self.end_id is not None)


@dataclass(frozen=True)
class BlockPlace:
    """Where a row group stands in its stream: ``block_of()`` gives its index in the epoch's
    order (called on the consuming thread, when the block is encoded)."""

    epoch: int
    block_of: Callable[[], int]


def _log_first(reason: str, where: str, detail: str) -> None:
    with _logged_lock:
        if reason in _logged:
            return
        _logged.add(reason)
    log.warning("image document rejected online (%s: %s, %s); it is not trained on (logged once per reason)",
                reason, detail, where)


class ImageBlock(Block):
    """A row group of image documents, encoded as a whole on first use (module docstring)."""

    def __init__(self, texts: list, columns: dict, options: ImageOptions, tokenizer, token_format: TokenFormat,
                 where: str, row_group: int, place: BlockPlace) -> None:
        super().__init__(tokens=np.zeros(0, dtype=np.int32), doc_starts=np.zeros(1, dtype=np.int64),
                         complete=False)
        self._texts = texts
        self._columns = columns
        self._options = options
        self._tokenizer = tokenizer
        self._format = token_format
        self._where = (where, row_group)
        self._place = place
        self.reject_counts: dict[str, int] = {}

    def ensure(self, position: int) -> None:
        if not self.complete:
            self._encode()

    def rejects(self) -> dict[str, int]:
        self.ensure(0)
        return self.reject_counts

    def _fail(self, row: int, problem: str) -> LaneDataError:
        where, row_group = self._where
        return LaneDataError(f"{where}: row group {row_group}, row {row}: {problem}; the file was not written by "
                             "the Beam job with these options (re-run it)")

    def _documents(self) -> list[list]:
        """Each row's parts: ``str`` text or ``(width, height, recorded tokens or None)``."""
        segments = self._columns["segments"].to_pylist()
        counts = self._columns["num_images"].to_pylist()
        widths = self._columns["image_width"].to_pylist()
        heights = self._columns["image_height"].to_pylist()
        recorded = self._columns[VISUAL_TOKENS_COLUMN].to_pylist() if VISUAL_TOKENS_COLUMN in self._columns else None
        documents = []
        for row, text in enumerate(self._texts):
            try:
                parts = decode_segments(text or "", segments[row] or [])
            except ValueError as exc:
                raise self._fail(row, f"bad segments ({exc})") from exc
            images = [p for p in parts if isinstance(p, int)]
            sizes = (len(widths[row] or []), len(heights[row] or []),
                     len(recorded[row] or []) if recorded is not None else len(images))
            if counts[row] != len(images) or any(size != len(images) for size in sizes):
                raise self._fail(row, f"num_images {counts[row]}, segments place {len(images)} images, image "
                                      f"columns hold {list(sizes)}: the row is inconsistent")
            documents.append([p if isinstance(p, str) else
                              (widths[row][p], heights[row][p], recorded[row][p] if recorded is not None else None)
                              for p in parts])
        return documents

    def _encode(self) -> None:
        options, fmt = self._options, self._format
        documents = self._documents()
        texts = [part for document in documents for part in document if isinstance(part, str)]
        flat, lengths = tokenize_documents(self._tokenizer, texts)
        text_ids = iter(np.split(flat, np.cumsum(lengths)[:-1]) if texts else [])
        block_index = self._place.block_of()
        epoch = self._place.epoch
        if epoch >= 1 << EPOCH_BITS or block_index >= 1 << BLOCK_BITS or len(documents) > 1 << ROW_BITS:
            where, row_group = self._where
            raise LaneDataError(f"{where}: row group {row_group}: epoch {epoch}, block {block_index} or "
                                f"{len(documents)} rows exceed what an image_ref holds (2^{EPOCH_BITS} epochs, "
                                f"2^{BLOCK_BITS} row groups per lane, 2^{ROW_BITS} rows per row group); re-shard "
                                "with more lanes or smaller row groups")
        ids_out, masks_out, refs_out = [], [], []
        for row, document in enumerate(documents):
            ids, masks, refs, spans = [], [], [], []  # spans: (start, end) of each image's tokens
            at = 0
            images = 0
            for part in document:
                if isinstance(part, str):
                    piece = next(text_ids)
                    ids.append(piece)
                    masks.append(np.ones(len(piece), np.uint8))
                    refs.append(np.full(len(piece), -1, np.int64))
                    at += len(piece)
                    continue
                width, height, recorded = part
                tokens = self._visual_tokens(row, images, width, height, recorded)
                piece = np.full(tokens + options.wrap_tokens, options.image_id, np.int32)
                ref = np.full(len(piece), -1, np.int64)
                ref[int(options.start_id is not None): int(options.start_id is not None) + tokens] = \
                    encode_ref(epoch, block_index, row, images)
                if options.start_id is not None:
                    piece[0] = options.start_id
                if options.end_id is not None:
                    piece[-1] = options.end_id
                ids.append(piece)
                masks.append(np.zeros(len(piece), np.uint8))
                refs.append(ref)
                spans.append((at, at + len(piece)))
                at += len(piece)
                images += 1
            keep = self._kept_tokens(row, at, spans)
            if keep == 0:
                continue
            ids_out.append(np.concatenate(ids)[:keep] if ids else np.zeros(0, np.int32))
            masks_out.append(np.concatenate(masks)[:keep] if masks else np.zeros(0, np.uint8))
            refs_out.append(np.concatenate(refs)[:keep] if refs else np.zeros(0, np.int64))
        lengths = np.fromiter(map(len, ids_out), dtype=np.int64, count=len(ids_out))
        flat = np.concatenate(ids_out) if ids_out else np.zeros(0, np.int32)
        wrapped = wrap_documents(flat, lengths, fmt)
        bos, eos = fmt.bos_id is not None, fmt.eos_id is not None
        self.tokens, self.doc_starts = wrapped.tokens, wrapped.doc_starts
        self.features = {
            "loss_mask": wrap_feature(FEATURES["loss_mask"], np.concatenate(masks_out) if masks_out else
                                      np.zeros(0, np.uint8), lengths, wrapped.doc_starts, bos, eos),
            "image_ref": wrap_feature(FEATURES["image_ref"], np.concatenate(refs_out) if refs_out else
                                      np.zeros(0, np.int64), lengths, wrapped.doc_starts, bos, eos),
        }
        self.complete = True
        self._texts = self._columns = None

    def _visual_tokens(self, row: int, image: int, width: int, height: int, recorded: Optional[int]) -> int:
        try:
            tokens = self._options.policy.visual_tokens(width, height)
        except (ImageRejected, TypeError, ValueError) as exc:
            raise self._fail(row, f"image {image} ({width}x{height}) has no visual-token count under the "
                                  f"configured images.policy ({exc})") from exc
        if recorded is not None and recorded != tokens:
            raise self._fail(row, f"image {image} ({width}x{height}): the lane records {recorded} visual tokens, "
                                  f"the configured images.policy gives {tokens} (was the dataset sharded with "
                                  "another --image-policy?)")
        return tokens

    def _kept_tokens(self, row: int, length: int, spans: list[tuple[int, int]]) -> int:
        """How many of a document's tokens stay (0: rejected, counted); see the module docstring."""
        options = self._options
        if not spans or options.packing != "best_fit":
            return length
        where = f"{self._where[0]} row group {self._where[1]} row {row}"
        cap = options.max_images_per_sequence
        if cap is not None and len(spans) > cap:
            return self._reject("too_many_images_for_sequence", where,
                                f"{len(spans)} images, max_images_per_sequence = {cap}")
        fit = options.seq_len - self._format.extra
        if length <= fit:
            return length
        if options.overflow == "reject":
            return self._reject("image_document_too_long", where, f"{length} tokens, {fit} fit one sequence")
        keep = fit
        for start, end in spans:  # never inside an image: back to before the one the cut falls in
            if start < keep < end:
                keep = start
                break
        if keep == 0:
            return self._reject("image_document_too_long", where,
                                f"its first image alone ({spans[0][1]} tokens) does not fit {fit}")
        return keep

    def _reject(self, reason: str, where: str, detail: str) -> int:
        self.reject_counts[reason] = self.reject_counts.get(reason, 0) + 1
        _log_first(reason, where, detail)
        return 0
