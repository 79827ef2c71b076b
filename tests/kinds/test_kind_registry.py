"""The lane-kind registry (loader.kinds): every lane has exactly one kind, and a kind plugs in
by registering, without an edit to the core."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest

from loader.io.blocks import Block, TokenFormat
from loader.kinds import base
from loader.kinds.base import BlockSource, LaneKind, kind_for, manifest_entries, register_kind, unregister_kind

CHAT, IMAGES = object(), object()  # stand-ins: kind_for looks only at presence


@pytest.mark.parametrize("pretokenized,chat,images,expected", [
    (False, None, None, "text"),
    (True, None, None, "tokens"),
    (False, CHAT, None, "chat"),
    (False, None, IMAGES, "image"),
    (False, CHAT, IMAGES, "image-chat"),
])
def test_each_lane_description_has_its_kind(pretokenized, chat, images, expected):
    assert kind_for(pretokenized=pretokenized, chat=chat, images=images).name == expected


def test_every_lane_description_matches_exactly_one_builtin_kind():
    for pretokenized, chat, images in itertools.product((False, True), (None, CHAT), (None, IMAGES)):
        matching = [k.name for k in base.registered_kinds()
                    if k.matches(pretokenized=pretokenized, chat=chat, images=images)]
        assert len(matching) == 1, (pretokenized, chat, images, matching)


def test_the_builtin_manifest_entries_are_chat_then_images():
    # The order problems of a bad manifest are reported in (and the order before the registry).
    assert [e.key for e in manifest_entries()] == ["chat", "images"]


class _BytesKind(LaneKind):
    """A test kind: a text lane's UTF-8 bytes as tokens (matches what the text kind matches)."""

    name = "test-bytes"

    def matches(self, *, pretokenized, chat, images) -> bool:
        return not pretokenized and chat is None and images is None

    def decode(self, source: BlockSource) -> Block:
        documents = [np.frombuffer(t.encode(), np.uint8).astype(np.int32) for t in source.values.to_pylist()]
        starts = np.cumsum([0] + [len(d) for d in documents])
        return Block(tokens=np.concatenate(documents), doc_starts=starts)


def test_a_kind_registered_from_a_test_decodes_and_two_matching_kinds_are_refused():
    kind = register_kind(_BytesKind())
    try:
        with pytest.raises(ValueError, match="2 lane kinds match .* exactly one must"):
            kind_for(pretokenized=False)
        source = BlockSource(values=pa.array(["ab", "c"]), columns=(), column_names=(), features=(),
                             token_format=TokenFormat(None, None), tokenizer=None, where="f.parquet", row_group=0,
                             chat=None, images=None, epoch=0, block_of=lambda: 0)
        block = kind.decode(source)
        assert block.tokens.tolist() == [97, 98, 99] and block.doc_starts.tolist() == [0, 2, 3]
    finally:
        unregister_kind(kind.name)
    assert kind_for(pretokenized=False).name == "text"


def test_a_kind_name_is_registered_once():
    with pytest.raises(ValueError, match="'text' is registered twice"):
        register_kind(type("Again", (LaneKind,), {"name": "text"})())
    with pytest.raises(TypeError, match="LaneKind instance"):
        register_kind(_BytesKind)


def test_what_the_core_asks_of_a_kind_has_defaults_and_the_builtin_kinds_answer():
    # The core reaches images and online chat only through these hooks (tests/test_layers.py
    # checks that it imports no kind); a kind without them adds nothing.
    text = kind_for(pretokenized=False)
    assert text.stream_options(None, None, "web", None) == {} and text.sequence_resolver(None, None, None) is None
    assert text.bin_cap(None) is None and text.worker_slot_bytes(None, 64, 8) == 0 and text.reject_field is None
    image = kind_for(pretokenized=False, images=IMAGES)
    assert image.reject_field == "image_rejects" and image.reject_reasons
    assert base.source_plan("images").options is not None and base.source_plan("chat").rejects is not None
    assert base.source_plan("no such plan") == base.SourcePlan("no such plan")  # plans nothing
    assert base.sequence_attachment("images").pack is not None
    with pytest.raises(ValueError, match="sequence attachment 'images' is registered twice"):
        base.register_attachment(base.sequence_attachment("images"))
    with pytest.raises(ValueError, match="no sequence attachment 'audio' is registered"):
        base.sequence_attachment("audio")
