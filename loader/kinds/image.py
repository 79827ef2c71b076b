"""The image kinds: ``image`` (interleaved text and images) and ``image-chat`` (conversations
with image parts).

Their lanes read the image metadata columns beside the value column (and each image's visual
tokens where the job recorded them); a row group becomes a :class:`loader.vision.block.ImageBlock`
or a :class:`loader.vision.chat.ImageChatBlock`. The kinds own the manifest's ``images`` entry
(:class:`loader.vision.record.ImagesRecord`).
"""

from __future__ import annotations

from typing import Any

from loader.errors import ManifestError
from loader.io.blocks import Block
from loader.io.names import DOCUMENT_REJECT_REASONS
from loader.kinds.base import (
    BlockSource, LaneKind, ManifestEntry, SequenceAttachment, SourcePlan, register_attachment, register_kind,
    register_manifest_entry, register_source_plan,
)
from loader.kinds.chat import online_chat
from loader.vision.block import METADATA_COLUMNS, ONLINE_IMAGE_REJECT_REASONS, VISUAL_TOKENS_COLUMN, BlockPlace, ImageBlock
from loader.vision.reasons import IMAGE_REJECT_REASONS
from loader.vision.loader_options import resolve_image_options
from loader.vision.record import ImagesRecord
from loader.vision.resolve import ImageResolver, images_in
from loader.vision.transfer import image_slot_bytes, pack_images, unpack_images

# What an image job records in the manifest's ``rejected``: the document reasons and the image
# reasons of loader.vision.reasons.
IMAGE_DOCUMENT_REJECT_REASONS = DOCUMENT_REJECT_REASONS + IMAGE_REJECT_REASONS


class ImageKind(LaneKind):
    name = "image"
    rejects_online = True
    reject_field = "image_rejects"
    reject_reasons = ONLINE_IMAGE_REJECT_REASONS

    def matches(self, *, pretokenized, chat, images) -> bool:
        return images is not None and chat is None

    def lane_columns(self, schema_names: set) -> tuple[str, ...]:
        return METADATA_COLUMNS + ((VISUAL_TOKENS_COLUMN,) if VISUAL_TOKENS_COLUMN in schema_names else ())

    def decode(self, source: BlockSource) -> Block:
        return ImageBlock(source.values.to_pylist(), dict(zip(source.column_names, source.columns)), source.images,
                          source.tokenizer, source.token_format, source.where, source.row_group,
                          BlockPlace(source.epoch, source.block_of))

    def stream_options(self, manifest, spec, source_name: str, tokenizer) -> dict:
        return {"images": spec.images}

    def sequence_resolver(self, stream, spec, manifest):
        from loader.vision.images import ImageLimits  # Pillow (~0.2 s to import): only image lanes load it

        return ImageResolver(stream, spec.images, ImageLimits(**manifest.images.limits))

    def bin_cap(self, spec):
        cap = spec.images.max_images_per_sequence
        return None if cap is None else (cap, images_in)

    def worker_slot_bytes(self, spec, seq_len: int, items: int) -> int:
        return image_slot_bytes(spec.images.policy, seq_len, items, spec.images.wrap_tokens)


class ImageChatKind(ImageKind):
    name = "image-chat"

    def matches(self, *, pretokenized, chat, images) -> bool:
        return images is not None and chat is not None

    def stream_options(self, manifest, spec, source_name: str, tokenizer) -> dict:
        return {**super().stream_options(manifest, spec, source_name, tokenizer),
                **({"chat": online_chat(manifest, spec, source_name, tokenizer)} if manifest.online_chat else {})}

    def decode(self, source: BlockSource) -> Block:
        from loader.vision.chat import ImageChatBlock  # jinja2 (~0.1 s to import): only image-chat lanes load it

        return ImageChatBlock(source.values.to_pylist(), dict(zip(source.column_names, source.columns)),
                              source.images, source.chat, source.token_format, source.where, source.row_group,
                              BlockPlace(source.epoch, source.block_of))


def _parse_images_entry(data: Any) -> ImagesRecord:
    problems = ImagesRecord.problems_of(data)
    if problems:
        raise ManifestError("; ".join(f"images: {p}" for p in problems))
    return ImagesRecord.from_dict(data)


IMAGE = register_kind(ImageKind())
IMAGE_CHAT = register_kind(ImageChatKind())
IMAGES_ENTRY = register_manifest_entry(ManifestEntry("images", _parse_images_entry))
# Worker messages carry each image sequence's compact pixels in the slot (loader.vision.transfer).
IMAGES_ATTACHMENT = register_attachment(SequenceAttachment("images", pack_images, unpack_images))
IMAGES_PLAN = register_source_plan(SourcePlan("images", options=resolve_image_options))
