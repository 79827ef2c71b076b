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
from loader.kinds.base import BlockSource, LaneKind, ManifestEntry, register_kind, register_manifest_entry
from loader.vision.block import METADATA_COLUMNS, VISUAL_TOKENS_COLUMN, BlockPlace, ImageBlock
from loader.vision.reasons import IMAGE_REJECT_REASONS
from loader.vision.record import ImagesRecord

# What an image job records in the manifest's ``rejected``: the document reasons and the image
# reasons of loader.vision.reasons.
IMAGE_DOCUMENT_REJECT_REASONS = DOCUMENT_REJECT_REASONS + IMAGE_REJECT_REASONS


class ImageKind(LaneKind):
    name = "image"
    rejects_online = True

    def matches(self, *, pretokenized, chat, images) -> bool:
        return images is not None and chat is None

    def lane_columns(self, schema_names: set) -> tuple[str, ...]:
        return METADATA_COLUMNS + ((VISUAL_TOKENS_COLUMN,) if VISUAL_TOKENS_COLUMN in schema_names else ())

    def decode(self, source: BlockSource) -> Block:
        return ImageBlock(source.values.to_pylist(), dict(zip(source.column_names, source.columns)), source.images,
                          source.tokenizer, source.token_format, source.where, source.row_group,
                          BlockPlace(source.epoch, source.block_of))


class ImageChatKind(ImageKind):
    name = "image-chat"

    def matches(self, *, pretokenized, chat, images) -> bool:
        return images is not None and chat is not None

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
