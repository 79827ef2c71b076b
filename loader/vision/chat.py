"""Chat with images: conversations whose messages hold image parts, as training tokens.

The Hugging Face multimodal message convention: a message's ``content`` is a list of parts,
``{"type": "text", "text": ...}`` and ``{"type": "image", "image": <path | bytes>}`` (``"url"``
or ``"path"`` name the image too). The chat template renders each image part as its model
family's placeholder (Qwen2-VL: ``<|vision_start|><|image_pad|><|vision_end|>``), and, as the
Qwen2-VL processor does, the loader expands each image's single pad token into the ``n``
visual tokens the image-processing policy gives it::

    zephon shard --messages-field messages --chat-template T (no --tokenizer) + an image option
      record --parse (image parts allowed)--> each image part's reference read and inspected
             (loader.vision.images: a bad image rejects the whole conversation, with its reason)
             --> lane row: conversation JSON with each image part reduced to {"type": "image"},
                 the images' bytes/size/counts in the image columns (k-th image part = image k)
    loader (ImageChatBlock, the decoder of the image-chat kind, loader.kinds.image):
      conversation --render + generation spans + tokenize (loader.chat, as text chat)--> ids, mask
        --each pad token of image k--> [pad] x n_k   loss_mask 0, image_ref = ref of image k
          (the image's start / end tokens beside it: loss_mask 0 too, even in an assistant turn)
        --length: at most min(--chat-max-tokens, seq_len - BOS/EOS) after the expansion, per
          --chat-overflow (reject: too_long; truncate: cut before an image the cut would split)

so the text tokens and their mask are exactly what ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` gives once each run of pads is collapsed back to one.
The refs make the existing resolver (:mod:`loader.vision.resolve`) attach ``pixel_values``.

Rejects found online (counted per reason in ``batch["chat_rejects"]``, plus
``too_many_images_for_sequence`` in ``batch["image_rejects"]``): the chat guards
(``empty_loss_mask`` (also when only image tokens were supervised), ``full_loss_mask``,
``too_long``) and ``image_placeholder_mismatch``: the render does not hold exactly one image
token per image part (a template that does not render image parts with the configured
``images.image_token``, or text that contains that token literally).

Not supported: pre-tokenized chat with images (``--tokenizer`` with an image option is refused
by the job: the loader must place the image refs, so the lanes hold the conversations).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from loader.chat.conversations import REJECT_REASONS, Conversation, parse_conversation
from loader.chat.encode import RenderedConversation, spans_or_reject, finish_encoding
from loader.chat.masks import tokenize_rendered_batch
from loader.errors import RecordRejected
from loader.io.blocks import wrap_documents
from loader.stages.features import FEATURES, wrap_feature
from loader.chat.block import log_first_reject
from loader.vision.block import BLOCK_BITS, EPOCH_BITS, ROW_BITS, VISUAL_TOKENS_COLUMN, ImageBlock, encode_ref
from loader.vision.reasons import IMAGE_CHAT_REJECT_REASONS

IMAGE_PART_TYPE = "image"
IMAGE_REFERENCE_KEYS = ("image", "url", "path")  # where an image part names its image, first found wins


class ImageChatRejected(RecordRejected):
    """A conversation with images refused online (a chat reason or :data:`IMAGE_CHAT_REJECT_REASONS`)."""

    REASONS = REJECT_REASONS + IMAGE_CHAT_REJECT_REASONS + ("too_many_images_for_sequence",)


def is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == IMAGE_PART_TYPE


def image_parts(conversation: Conversation) -> list[tuple[str, Any]]:
    """``(where, reference)`` of every image part in message order (reference None: names none)."""
    found = []
    for index, message in enumerate(conversation.messages):
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            for part_index, part in enumerate(content):
                if is_image_part(part):
                    reference = next((part[key] for key in IMAGE_REFERENCE_KEYS if part.get(key) is not None), None)
                    found.append((f"messages[{index}].content[{part_index}]", reference))
    return found


def stripped(conversation: Conversation) -> Conversation:
    """The conversation with each image part reduced to ``{"type": "image"}`` (what the lane stores:
    the images themselves are in the image columns, in the same order) and the ``None``-valued
    keys of the other parts dropped (a Parquet struct gives a text part ``"image": null``, which
    Qwen2-VL's template, testing ``'image' in part``, would render as an image)."""
    messages = []
    for message in conversation.messages:
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            content = [{"type": IMAGE_PART_TYPE} if is_image_part(part) else
                       {key: value for key, value in part.items() if value is not None} for part in content]
            message = {**message, "content": content}
        messages.append(message)
    return Conversation(messages=tuple(messages), tools=conversation.tools, from_json=conversation.from_json)


def parse_image_conversation(record: Any, *, messages_field: str = "messages", tools_field: str = "tools",
                             from_json: bool = False) -> Conversation:
    """Validate one record, image parts allowed; raises :class:`loader.chat.ConversationRejected`."""
    return parse_conversation(record, messages_field=messages_field, tools_field=tools_field, from_json=from_json,
                              image_parts=True)


def render_image_conversation(conversation: Conversation, template, *, loss_on: str = "all") -> RenderedConversation:
    """The :func:`stripped` conversation rendered with its assistant spans (what the job checks
    and the loader encodes: the same render); raises :class:`loader.chat.ConversationRejected`."""
    conversation = stripped(conversation)
    return RenderedConversation(conversation, spans_or_reject(template, conversation, loss_on))


@dataclass(frozen=True, eq=False)
class ImageConversation:
    """An encoded conversation with its images expanded: ``image_index`` is the image (in part
    order) each token stands for, -1 on text and on the images' start / end tokens."""

    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    image_index: np.ndarray  # int16


def expand_images(input_ids: np.ndarray, loss_mask: np.ndarray, visual_tokens: Sequence[int], options
                  ) -> ImageConversation:
    """Each ``options.image_id`` token of ``input_ids`` as ``visual_tokens[k]`` copies (module
    docstring); raises :class:`ImageChatRejected` (``image_placeholder_mismatch``, ``empty_loss_mask``)."""
    pads = np.flatnonzero(input_ids == options.image_id)
    if len(pads) != len(visual_tokens):
        raise ImageChatRejected("image_placeholder_mismatch",
                                f"the render holds {len(pads)} image token(s) (id {options.image_id}) for "
                                f"{len(visual_tokens)} image part(s): the template must render each image part "
                                "as one images.image_token, and no text may contain it")
    mask = loss_mask.copy()
    for pad in pads.tolist():  # the image's start / end tokens are image tokens too: never supervised
        mask[pad] = 0
        if options.start_id is not None and pad > 0 and input_ids[pad - 1] == options.start_id:
            mask[pad - 1] = 0
        if options.end_id is not None and pad + 1 < len(input_ids) and input_ids[pad + 1] == options.end_id:
            mask[pad + 1] = 0
    repeats = np.ones(len(input_ids), np.int64)
    repeats[pads] = np.asarray(visual_tokens, np.int64)
    index = np.full(len(input_ids), -1, np.int16)
    index[pads] = np.arange(len(pads), dtype=np.int16)
    expanded = ImageConversation(np.repeat(input_ids, repeats).astype(np.int32, copy=False),
                                 np.repeat(mask, repeats), np.repeat(index, repeats))
    if not expanded.loss_mask.any():
        raise ImageChatRejected("empty_loss_mask", "no text token is supervised (the assistant turns hold only "
                                "images, which are never trained on)")
    return expanded


def image_spans(conversation: ImageConversation, options) -> list[tuple[int, int]]:
    """``(start, end)`` token range of each image: its pads and the start / end tokens beside them."""
    ids, index = conversation.input_ids, conversation.image_index
    on = np.flatnonzero(index >= 0)
    if not len(on):
        return []
    firsts = on[np.flatnonzero(np.diff(index[on], prepend=-2) != 0)]
    spans = []
    for first in firsts.tolist():
        last = first + int(np.count_nonzero(index == index[first]))
        if options.start_id is not None and first > 0 and ids[first - 1] == options.start_id:
            first -= 1
        if options.end_id is not None and last < len(ids) and ids[last] == options.end_id:
            last += 1
        spans.append((first, last))
    return spans


def fit_conversation(conversation: ImageConversation, *, max_tokens: Optional[int], overflow: str,
                     max_images: Optional[int], options) -> ImageConversation:
    """The conversation bounded as best fit needs it (module docstring); raises :class:`ImageChatRejected`."""
    images = int(conversation.image_index.max(initial=-1)) + 1
    if max_images is not None and images > max_images:
        raise ImageChatRejected("too_many_images_for_sequence",
                                f"{images} images, max_images_per_sequence = {max_images}")
    length = len(conversation.input_ids)
    if max_tokens is None or length <= max_tokens:
        return conversation
    if overflow == "reject":
        raise ImageChatRejected("too_long", f"{length} tokens with the images expanded > {max_tokens} (the bound "
                                "of --chat-max-tokens and seq_len; overflow='reject')")
    keep = max_tokens
    for start, end in image_spans(conversation, options):  # never inside an image: back to before it
        if start < keep < end:
            keep = start
            break
    cut = ImageConversation(conversation.input_ids[:keep], conversation.loss_mask[:keep],
                            conversation.image_index[:keep])
    if not cut.loss_mask.any():
        raise ImageChatRejected("too_long" if keep == 0 else "empty_loss_mask",
                                f"no supervised token in the first {keep} tokens (overflow='truncate')")
    return cut


def encode_image_conversations(records: Sequence[Any], visual_tokens: Sequence[Sequence[int]], chat, options, *,
                               max_images: Optional[int] = None
                               ) -> list[Union[ImageConversation, RecordRejected]]:
    """Each record (``json.loads`` output of the lane's ``conversation`` column) encoded with its
    images expanded, or the reject; one batched tokenizer call. ``chat``: the source's
    :class:`loader.chat.block.OnlineChat`; ``options``: :class:`loader.vision.block.ImageOptions`."""
    outcomes: list = []
    rendered = []
    for record in records:
        try:
            outcome = render_image_conversation(parse_image_conversation(record, from_json=True), chat.template,
                                                loss_on=chat.loss_on)
        except RecordRejected as exc:
            outcome = exc
        else:
            rendered.append(outcome)
        outcomes.append(outcome)
    tokens = iter(tokenize_rendered_batch(chat.tokenizer, [r.text for r in rendered]))
    for k, outcome in enumerate(outcomes):
        if not isinstance(outcome, RenderedConversation):
            continue
        try:
            encoded = finish_encoding(outcome, next(tokens))  # the chat guards on the text tokens
            expanded = expand_images(encoded.input_ids, encoded.loss_mask, visual_tokens[k], options)
            outcomes[k] = fit_conversation(expanded, max_tokens=chat.max_tokens, overflow=chat.overflow,
                                           max_images=max_images, options=options)
        except RecordRejected as exc:
            outcomes[k] = exc
    return outcomes


ONLINE_REASONS = ("empty_loss_mask", "full_loss_mask", "too_long", "too_many_images_for_sequence",
                  *IMAGE_CHAT_REJECT_REASONS)


class ImageChatBlock(ImageBlock):
    """A row group of conversations with images, encoded as a whole on first use (module docstring)."""

    def __init__(self, conversations: list, columns: dict, options, chat, token_format, where: str, row_group: int,
                 place) -> None:
        super().__init__(conversations, columns, options, chat.tokenizer, token_format, where, row_group, place)
        self._chat = chat

    def _records_and_tokens(self) -> tuple[list, list[list[int]]]:
        counts = self._columns["num_images"].to_pylist()
        widths = self._columns["image_width"].to_pylist()
        heights = self._columns["image_height"].to_pylist()
        recorded = self._columns[VISUAL_TOKENS_COLUMN].to_pylist() if VISUAL_TOKENS_COLUMN in self._columns else None
        records, tokens = [], []
        for row, value in enumerate(self._texts):
            try:
                record = json.loads(value)
            except (TypeError, ValueError) as exc:
                raise self._fail(row, f"the conversation column holds no conversation JSON ({exc})") from exc
            if not isinstance(record, dict):
                raise self._fail(row, f"the conversation column holds {type(record).__name__}, not an object")
            sizes = list(zip(widths[row] or [], heights[row] or []))
            parts = sum(1 for message in record.get("messages") or () if isinstance(message, dict)
                        for part in (message.get("content") if isinstance(message.get("content"), list) else ())
                        if is_image_part(part))
            if counts[row] != parts or len(sizes) != parts:
                raise self._fail(row, f"num_images {counts[row]}, {parts} image parts, {len(sizes)} image sizes: "
                                      "the row is inconsistent")
            tokens.append([self._visual_tokens(row, k, w, h, recorded[row][k] if recorded is not None else None)
                           for k, (w, h) in enumerate(sizes)])
            records.append(record)
        return records, tokens

    def _encode(self) -> None:
        options, fmt, chat = self._options, self._format, self._chat
        records, visual_tokens = self._records_and_tokens()
        block_index, epoch = self._place.block_of(), self._place.epoch
        if epoch >= 1 << EPOCH_BITS or block_index >= 1 << BLOCK_BITS or len(records) > 1 << ROW_BITS:
            raise self._fail(0, f"epoch {epoch}, block {block_index} or {len(records)} rows exceed what an "
                                "image_ref holds; re-shard with more lanes or smaller row groups")
        outcomes = encode_image_conversations(records, visual_tokens, chat, options,
                                              max_images=options.max_images_per_sequence)
        ids, masks, refs = [], [], []
        for row, outcome in enumerate(outcomes):
            if isinstance(outcome, RecordRejected):
                if outcome.reason not in ONLINE_REASONS:  # the job checked the rest: not its data
                    raise self._fail(row, f"a conversation fails a check the Beam job makes ({outcome})")
                self.reject_counts[outcome.reason] = self.reject_counts.get(outcome.reason, 0) + 1
                log_first_reject(outcome.reason, chat.source_name, outcome.detail)
                continue
            ref = np.full(len(outcome.input_ids), -1, np.int64)
            on = outcome.image_index >= 0
            ref[on] = encode_ref(epoch, block_index, row, 0) + outcome.image_index[on].astype(np.int64)  # low bits
            ids.append(outcome.input_ids)
            masks.append(outcome.loss_mask)
            refs.append(ref)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        wrapped = wrap_documents(np.concatenate(ids) if ids else np.zeros(0, np.int32), lengths, fmt)
        bos, eos = fmt.bos_id is not None, fmt.eos_id is not None
        self.tokens, self.doc_starts = wrapped.tokens, wrapped.doc_starts
        self.features = {
            "loss_mask": wrap_feature(FEATURES["loss_mask"], np.concatenate(masks) if masks else np.zeros(0, np.uint8),
                                      lengths, wrapped.doc_starts, bos, eos),
            "image_ref": wrap_feature(FEATURES["image_ref"], np.concatenate(refs) if refs else np.zeros(0, np.int64),
                                      lengths, wrapped.doc_starts, bos, eos),
        }
        self.complete = True
        self._texts = self._columns = None

