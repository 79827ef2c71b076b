"""Online chat: the loader renders, tokenizes and masks the conversations of a lane's row group.

A chat dataset sharded without ``--tokenizer`` holds each validated conversation as JSON in
its ``conversation`` column and records the template and options in the manifest's ``chat``
entry (:class:`loader.chat.record.ChatRecord`). Its lane streams read that column, and a row
group becomes a :class:`ChatBlock`, the chat kind of text block::

    conversation JSON --json.loads--> record --encode_conversations (loader.chat.encode,
        the code the Beam job runs offline)--> input_ids + loss_mask of each accepted
        conversation --wrap_documents / wrap_feature--> block tokens + features["loss_mask"]
                                    \\--> ConversationRejected(reason): counted, never trained on

so a block holds exactly what the offline path's lane files would hold for the same
conversations (the same ids, masks and BOS/EOS values): offline and online batches are equal.

Length: under ``best_fit`` no conversation may be split, so the overflow option (the
manifest's ``overflow``) applies at ``min(max_tokens, seq_len - wrap tokens)``
(:func:`effective_max_tokens`); a pre-tokenized chat source whose ``max_tokens`` does not fit is
refused when the loader is built (:func:`check_chat_fits`).

Transforms (:mod:`loader.transforms.conversations`): with a source's transforms the lane reader
hands the block its chain and the row group's key/metadata columns (:meth:`ChatBlock.transform`);
records-stage transforms run on the records before rendering, tokens-stage ones on each
accepted conversation's ids and loss mask, and the block is encoded when read so that its
``transform_counts`` are known as a text block's are.

Rejects found online are the token-level guards (:data:`ONLINE_REJECT_REASONS`; the others
happened in the job). A block renders all its conversations on first use
(:func:`loader.chat.encode.encode_conversations`: batched tokenizer calls of parts of the renders,
on a helper thread while the rest render), so its reject counts are known then. :class:`RejectTally` reports a block's rejects once, with the sequence whose production
moves the stream's cursor into (or past) the block; the first of each reason is logged once
per process. Because "into the block" is read off the cursor, the counts of a micro-batch are
the same on every topology and across a resume (a cursor restored inside a block has reported
it already).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from loader.caches import BoundedCache
from loader.chat.conversations import ConversationRejected
from loader.chat.encode import TOKENIZE_HELPER, check_options, encode_conversations
from loader.chat.template import ChatTemplate
from loader.errors import ChatConfigError, LaneDataError
from loader.errors import ConfigError  # noqa: F401  (also importable from here)
from loader.io.blocks import Block, TokenFormat, wrap_documents
from loader.io.owner import PROCESS_OWNER, StreamOwner
from loader.io.reject_tally import RejectTally  # noqa: F401  (also importable from here)
from loader.stages.features import FEATURES, wrap_feature
from loader.vision.reasons import IMAGE_CHAT_REJECT_REASONS

log = logging.getLogger(__name__)

# The guards that need the tokens: the reasons a conversation is refused online, in batch
# metadata order (``batch["chat_rejects"]``, zeros included).
ONLINE_REJECT_REASONS = ("empty_loss_mask", "full_loss_mask", "too_long")
MESSAGES_KEY, TOOLS_KEY = "messages", "tools"  # keys of the conversation JSON (beam_jobs.chat_records)

_logged_reasons: set[str] = set()
_logged_lock = threading.Lock()
_encoders: BoundedCache["OnlineChat"] = BoundedCache(64)  # OnlineChat.of_manifest: one per source and process


def effective_max_tokens(max_tokens: Optional[int], *, seq_len: int, packing: str, wrap_tokens: int,
                         overlong: str = "refuse") -> Optional[int]:
    """The length bound applied online: the manifest's, and under ``best_fit`` at most what fits
    in one sequence with the loader's BOS/EOS (so no conversation is ever split), unless the
    config's ``overlong`` drops or truncates what does not fit (as it does offline: the
    loader's transforms after the encoding, loader.pipeline)."""
    if packing != "best_fit" or overlong != "refuse":
        return max_tokens
    fit = seq_len - wrap_tokens
    return fit if max_tokens is None else min(max_tokens, fit)


def chat_overflows(manifest, *, seq_len: int, packing: str, wrap_tokens: int) -> bool:
    """Whether a chat source tokenized offline may hold a conversation that does not fit one
    ``best_fit`` sequence: its recorded longest conversation (``chat.longest_tokens``), else the
    job's bound (``--chat-max-tokens``; neither: it may), against ``seq_len`` minus the loader's
    BOS/EOS. Never under concat packing."""
    chat = manifest.chat
    if chat is None or packing != "best_fit":
        return False
    longest = chat.longest_tokens if chat.longest_tokens is not None else chat.max_tokens
    return longest is None or longest > seq_len - wrap_tokens


def check_chat_fits(manifest, source_name: str, *, seq_len: int, packing: str, wrap_tokens: int,
                    overlong: str = "refuse") -> None:
    """Refuse a pre-tokenized chat source under ``best_fit`` whose conversations do not all fit
    one sequence (they would be split), unless ``overlong`` ("drop", "truncate": the loader's
    transforms handle them; loader.pipeline). Online sources are cut or refused at the fit instead."""
    if manifest.chat is None or not manifest.chat.tokenized or not chat_overflows(manifest, seq_len=seq_len, packing=packing, wrap_tokens=wrap_tokens):
        return
    chat, fit = manifest.chat, seq_len - wrap_tokens
    if fit >= 1 and overlong != "refuse":
        return
    if chat.longest_tokens is not None:
        why = f"its longest conversation has {chat.longest_tokens} tokens, more than"
    else:
        bound = "no --chat-max-tokens" if chat.max_tokens is None else f"--chat-max-tokens {chat.max_tokens}"
        why = (f"it was tokenized offline with {bound} by a job that did not record its longest conversation, "
               "so some may be longer than")
    raise ChatConfigError(
        f"datasets entry {source_name!r}: {why} seq_len={seq_len} minus the {wrap_tokens} BOS/EOS token(s) the "
        "loader adds, and best_fit packing would split them; set overlong = \"drop\" (they are dropped, counted) "
        "or overlong = \"truncate\" (cut after their last assistant turn that fits) in the loader config, raise "
        f"seq_len, or re-shard with --chat-max-tokens {max(fit, 1)} (or lower)"
        + ("" if chat.longest_tokens is not None else
           "; or record its longest conversation without re-sharding: zephon record-longest <the dataset's path>")
        + ("" if fit >= 1 else f" (seq_len={seq_len} leaves no room for a token: raise it)")
    )


def check_chat_sources(manifests, source_names, tokenizer, *, seq_len: int, packing: str,
                       wrap_tokens: int, overlong: str = "refuse") -> tuple[str, ...]:
    """Check a loader's chat sources when it is built: pre-tokenized ones fit (:func:`check_chat_fits`),
    online ones have a usable template and bound. Returns the batch's ``chat_rejects`` reasons
    (empty without an online chat source: the batch then has no such field)."""
    online = image_chat = False
    for manifest, name in zip(manifests, source_names):
        check_chat_fits(manifest, name, seq_len=seq_len, packing=packing, wrap_tokens=wrap_tokens, overlong=overlong)
        if manifest.online_chat:
            OnlineChat.of_manifest(manifest, tokenizer, source_name=name, seq_len=seq_len, packing=packing,
                                   wrap_tokens=wrap_tokens, overlong=overlong)  # compiles the template: errors now, not in a worker
            online = True
            image_chat = image_chat or getattr(manifest, "images", None) is not None
    if image_chat:  # conversations with image parts (loader.vision.chat) add their own reason
        return ONLINE_REJECT_REASONS + IMAGE_CHAT_REJECT_REASONS
    return ONLINE_REJECT_REASONS if online else ()


def log_first_reject(reason: str, source_name: str, detail: str) -> None:
    """Log an online reject once per reason per process (the counts go into every micro-batch)."""
    with _logged_lock:
        if reason in _logged_reasons:
            return
        _logged_reasons.add(reason)
    log.warning("chat source %r: a conversation is rejected online (%s: %s); it is not trained on, and rejects "
                "are counted per reason in each micro-batch's 'chat_rejects' (logged once per reason)",
                source_name, reason, detail)


@dataclass(frozen=True)
class OnlineChat:
    """What a stream of an online chat source needs to encode its conversations.

    Picklable (the template pickles as its sources; the tokenizer is the loader's, rebuilt in
    each worker process from its JSON).
    """

    template: ChatTemplate
    tokenizer: Any
    loss_on: str
    max_tokens: Optional[int]  # the effective bound (effective_max_tokens)
    overflow: str
    source_name: str

    @classmethod
    def of_manifest(cls, manifest, tokenizer, *, source_name: str, seq_len: int, packing: str,
                    wrap_tokens: int, overlong: str = "refuse") -> "OnlineChat":
        """The encoder of a manifest whose ``chat`` is online (``manifest.online_chat``).

        One per source and process: every lane of the source shares it (compiling the
        template once took ~0.1 s; per lane it delayed the first batch by lanes x that)."""
        key = (json.dumps(manifest.chat.to_dict(), sort_keys=True), id(tokenizer), source_name, seq_len, packing,
               wrap_tokens, overlong)
        cached = _encoders.get(key)
        if cached is not None and cached.tokenizer is tokenizer:
            return cached
        encoder = cls._build(manifest, tokenizer, source_name=source_name, seq_len=seq_len, packing=packing,
                             wrap_tokens=wrap_tokens, overlong=overlong)
        return _encoders.put(key, encoder)

    @classmethod
    def _build(cls, manifest, tokenizer, *, source_name: str, seq_len: int, packing: str,
               wrap_tokens: int, overlong: str = "refuse") -> "OnlineChat":
        chat = manifest.chat
        record = chat.template
        template = ChatTemplate(sources=dict(record["sources"]), origin=f"{source_name}: manifest chat.template",
                                special_tokens=dict(record.get("special_tokens") or {}),
                                extra_variables=dict(record.get("extra_variables") or {}),
                                template_name=record.get("template_name"))
        max_tokens = effective_max_tokens(chat.max_tokens, seq_len=seq_len, packing=packing, wrap_tokens=wrap_tokens,
                                          overlong=overlong)
        if max_tokens is not None and max_tokens < 1:
            raise ChatConfigError(f"datasets entry {source_name!r}: seq_len={seq_len} leaves no room for a "
                                  f"conversation beside the {wrap_tokens} BOS/EOS token(s); raise seq_len")
        check_options(chat.loss_on, max_tokens, chat.overflow)
        return cls(template, tokenizer, chat.loss_on, max_tokens, chat.overflow, source_name)

    def block(self, conversations: list, token_format: TokenFormat, where: str, row_group: int,
              owner: Optional[StreamOwner] = None) -> "ChatBlock":
        """The block of one row group's ``conversation`` values (rows in replay order); its
        renders are tokenized on ``owner``'s helper thread (the stream's; None: the process's)."""
        return ChatBlock(conversations, self, token_format, where, row_group, owner)


class ChatBlock(Block):
    """A row group of conversations, encoded as a whole on first use (see the module docstring).

    ``reject_counts``: conversations refused online, per reason (after :meth:`ensure`).
    """

    def __init__(self, conversations: list, chat: OnlineChat, token_format: TokenFormat, where: str,
                 row_group: int, owner: Optional[StreamOwner] = None) -> None:
        super().__init__(tokens=np.zeros(0, dtype=np.int32), doc_starts=np.zeros(1, dtype=np.int64),
                         complete=not conversations)
        self._conversations = conversations
        self._chat = chat
        self._owner = PROCESS_OWNER if owner is None else owner
        self._format = token_format
        self._where = (where, row_group)
        self.reject_counts: dict[str, int] = {}
        self._transforms = None  # (ChatTransforms, LazyColumns) once transform() is called
        # prepare (the prepare thread) encodes under _encoding unless claimed; claim sets the flag
        # first, then waits for an encoding in progress. After the claim the block is the
        # stream's alone, so ensure takes no lock.
        self._encoding = threading.Lock()
        self._claimed = False
        if not conversations:
            self.features = {"loss_mask": np.zeros(0, FEATURES["loss_mask"].dtype)}

    def ensure(self, position: int) -> None:
        if not self.complete:
            self._encode()

    def prepare(self) -> None:
        """Encode on the prepare thread when read ahead: a block encoded when the stream reached
        it stalled the stream for the whole render (0.75x the floor in-process, bench/HISTORY.md,
        "issue 17, online chat")."""
        with self._encoding:
            if not self._claimed and not self.complete:
                self._encode()

    def claim(self) -> None:
        # The flag before the lock: otherwise nothing stops a prepare that has not started yet.
        self._claimed = True
        with self._encoding:
            pass

    def transform(self, transforms, columns) -> None:
        """Run ``transforms`` (a :class:`loader.transforms.conversations.ChatTransforms`) around the
        encoding, with the row group's ``columns`` (``LazyColumns``), and encode now: the block's
        ``transform_counts`` are its transforms' counters."""
        self._transforms = (transforms, columns)
        self.transform_counts = transforms.zeros()
        self.ensure(0)

    def rejects(self) -> dict[str, int]:
        self.ensure(0)
        return self.reject_counts

    def _records(self) -> list[dict]:
        where, row_group = self._where
        records = []
        for row, value in enumerate(self._conversations):
            try:
                record = json.loads(value)
            except (TypeError, ValueError) as exc:
                raise LaneDataError(f"{where}: row group {row_group}, row {row}: the conversation column holds "
                                    f"no conversation JSON ({type(exc).__name__}: {exc}); the file was not written "
                                    "by the Beam job (re-run it)") from exc
            if not isinstance(record, dict):
                raise LaneDataError(f"{where}: row group {row_group}, row {row}: the conversation column holds "
                                    f"{type(record).__name__}, not an object; re-run the Beam job")
            records.append(record)
        return records

    def _encode(self) -> None:
        chat = self._chat
        records, rows = self._records(), None
        if self._transforms is not None:  # records stage: before rendering
            transforms, columns = self._transforms
            records, rows = transforms.apply_records(columns, records, self.transform_counts)
        outcomes = encode_conversations(
            records, chat.template, chat.tokenizer, loss_on=chat.loss_on, max_tokens=chat.max_tokens,
            overflow=chat.overflow, messages_field=MESSAGES_KEY, tools_field=TOOLS_KEY,
            from_json=rows is None,  # json.loads output, unless a records-stage transform replaced records
            helper=self._owner.helper(TOKENIZE_HELPER))
        ids, masks, encoded_rows = [], [], []
        for k, outcome in enumerate(outcomes):
            if isinstance(outcome, ConversationRejected):
                if outcome.reason not in ONLINE_REJECT_REASONS:  # the job checked the rest: not its data
                    where, row_group = self._where
                    raise LaneDataError(f"{where}: row group {row_group}: a conversation fails a check the Beam job "
                                        f"makes ({outcome}); the file was not written by it (re-run it)")
                self.reject_counts[outcome.reason] = self.reject_counts.get(outcome.reason, 0) + 1
                log_first_reject(outcome.reason, chat.source_name, outcome.detail)
                continue
            ids.append(outcome.input_ids)
            masks.append(outcome.loss_mask)
            encoded_rows.append(rows[k] if rows is not None else k)
        if self._transforms is not None:  # tokens stage: on the ids and loss mask of each accepted one
            ids, masks = transforms.apply_tokens(columns, encoded_rows, ids, masks, self.transform_counts)
            self._transforms = None
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat_ids = np.concatenate(ids).astype(np.int32, copy=False) if ids else np.zeros(0, np.int32)
        flat_mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
        wrapped = wrap_documents(flat_ids, lengths, self._format)
        fmt = self._format
        self.tokens, self.doc_starts = wrapped.tokens, wrapped.doc_starts
        self.features = {"loss_mask": wrap_feature(FEATURES["loss_mask"], flat_mask, lengths, wrapped.doc_starts,
                                                   fmt.bos_id is not None, fmt.eos_id is not None)}
        self.complete = True
        self._conversations = None
