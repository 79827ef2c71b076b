"""Transform specs, documents and the built-ins, without a loader."""

from __future__ import annotations

import numpy as np
import pytest

from loader.config import ConfigError, LoaderConfig
from loader.transforms import TransformError, TransformSpec, document_seed, parse_transform_arg
from loader.transforms.chain import TransformChain, TransformCounts
from loader.transforms.document import Document
from loader.order.hashing import stable_hash64


def _apply(function: str, document: Document, pretokenized: bool = False, features=(), **args):
    chain = TransformChain([TransformSpec(function, args).resolved(pretokenized)], seed=0, source="s",
                           pretokenized=pretokenized, feature_names=features)
    counts = TransformCounts.zeros(1)
    return chain.apply(document, counts), counts.counts[0]


def test_cli_specs_parse_function_version_and_json_args():
    assert parse_transform_arg('drop_regex:{"pattern": "a:b"}') == TransformSpec("drop_regex", {"pattern": "a:b"})
    assert parse_transform_arg("my.mod:clean@2") == TransformSpec("my.mod:clean", {}, version="2")
    assert parse_transform_arg('my.mod:clean@3:{"x": 1}') == TransformSpec("my.mod:clean", {"x": 1}, version="3")
    for bad, message in (("my.mod:clean:{x}", "not a JSON object"), ("a b:c", "Python identifiers"),
                         ("unknown_builtin", "neither 'module:function' nor a built-in")):
        with pytest.raises(ConfigError, match=message):
            parse_transform_arg(bad)


def test_config_validates_every_transform_field_at_once():
    with pytest.raises(ConfigError) as info:
        LoaderConfig.from_dict({
            "datasets": [{"path": "d", "transforms": [{"function": "identity", "args": [1]}]}], "seq_len": 8,
            "global_batch_size": 2, "micro_batch_size": 1, "seed": 0, "tokenizer": "t",
            "transforms": [{"function": "identity", "stage": "words", "extra": 1}], "transforms_from_step": -1})
    message = str(info.value)
    for part in ("datasets[0].transforms[0].args must be a table", "transforms[0].stage must be one of 'text', 'tokens'",
                 "transforms[0]: unknown field(s) ['extra']", "transforms_from_step must be an integer >= 0"):
        assert part in message


def test_the_fingerprint_covers_transforms_and_is_unchanged_without_them():
    fields = dict(datasets=[{"path": "d"}], seq_len=8, global_batch_size=2, micro_batch_size=1, seed=0, tokenizer="t")
    plain = LoaderConfig(**fields)
    import hashlib
    import json

    assert plain.fingerprint() == hashlib.sha256(json.dumps(plain.stream_fields(), sort_keys=True).encode()).hexdigest()
    one = LoaderConfig(**fields, transforms=[{"function": "drop_regex", "args": {"pattern": "a"}}])
    other = LoaderConfig(**fields, transforms=[{"function": "drop_regex", "args": {"pattern": "b"}}])
    versioned = LoaderConfig(**fields, transforms=[{"function": "drop_regex", "args": {"pattern": "a"}, "version": "2"}])
    assert len({plain.fingerprint(), one.fingerprint(), other.fingerprint(), versioned.fingerprint()}) == 4
    assert one.stream_fields() == plain.stream_fields()  # the checkpoint's config block is unchanged


def test_document_seed_is_the_stable_hash_of_seed_position_and_key():
    assert document_seed(7, 1, "k") == stable_hash64(7, "transform", 1, "k")
    assert len({document_seed(7, 1, "k"), document_seed(7, 0, "k"), document_seed(8, 1, "k"),
                document_seed(7, 1, "j")}) == 4
    doc = Document("k", text="x", seed_base=7).at_position(1)
    assert doc.seed == document_seed(7, 1, "k")


def test_builtin_length_filters():
    text = Document("k", text="abcdef")
    assert _apply("length_chars", text, min=3, max=6) == (text, [0, 0])
    assert _apply("length_chars", Document("k", text="ab"), min=3)[1] == [1, 0]
    assert _apply("length_chars", Document("k", text="abcdefg"), max=6)[1] == [1, 0]
    ids = Document("k", input_ids=np.arange(5, dtype=np.int32), features={})
    assert _apply("length_tokens", ids, pretokenized=True, min=5)[1] == [0, 0]
    assert _apply("length_tokens", ids, pretokenized=True, min=6)[1] == [1, 0]
    with pytest.raises(TransformError, match="give min, max or both"):
        _apply("length_chars", text)


def test_builtin_metadata_and_regex_drops():
    def doc(lang):
        return Document("k", text="Hello World", metadata=(("lang", None if lang is None else f'"{lang}"'),))

    assert _apply("drop_metadata", doc("de"), field="lang", values=["de", "fr"])[1] == [1, 0]
    assert _apply("drop_metadata", doc("en"), field="lang", values=["de"])[1] == [0, 0]
    assert _apply("drop_metadata", doc(None), field="lang", values=["de"])[1] == [0, 0]
    assert _apply("drop_metadata", doc(None), field="lang", values=["de"], missing="drop")[1] == [1, 0]
    assert _apply("drop_regex", doc("en"), pattern=r"wor")[1] == [0, 0]
    assert _apply("drop_regex", doc("en"), pattern=r"wor", ignore_case=True)[1] == [1, 0]


def test_builtin_truncation_cuts_ids_and_features_together():
    doc = Document("k", input_ids=np.arange(10, dtype=np.int32), features={"loss_mask": np.ones(10, np.uint8)})
    result, counts = _apply("truncate_tokens", doc, pretokenized=True, features=("loss_mask",), max_tokens=4)
    assert counts == [0, 1]
    assert result.input_ids.tolist() == [0, 1, 2, 3] and result.features["loss_mask"].tolist() == [1, 1, 1, 1]
    short = Document("k", input_ids=np.arange(3, dtype=np.int32), features={"loss_mask": np.ones(3, np.uint8)})
    assert _apply("truncate_tokens", short, pretokenized=True, features=("loss_mask",), max_tokens=4) == (short, [0, 0])


def test_a_token_map_must_keep_features_aligned():
    def bad(doc):
        return doc.replace(input_ids=doc.input_ids[:2])

    import sys
    import types

    module = types.ModuleType("zz_transform_bad")
    module.bad = bad
    sys.modules["zz_transform_bad"] = module
    doc = Document("k", input_ids=np.arange(5, dtype=np.int32), features={"loss_mask": np.ones(5, np.uint8)})
    with pytest.raises(TransformError, match="2 input_ids but 5 values of feature 'loss_mask' for document 'k'"):
        _apply("zz_transform_bad:bad", doc, pretokenized=True, features=("loss_mask",))


def test_fingerprint_logs_report_counts_as_comment_lines(tmp_path):
    from loader.commands.diff import parse_log
    from loader.commands.fingerprints import transform_count_lines

    lines = transform_count_lines({"web": {"0:drop_regex": {"dropped": 3, "changed": 0},
                                           "1:truncate_tokens": {"dropped": 0, "changed": 5}}})
    assert lines == ["# transforms web: 0:drop_regex dropped=3 changed=0, 1:truncate_tokens dropped=0 changed=5"]
    assert transform_count_lines({}) == []
    log = tmp_path / "a.txt"
    log.write_text("0 " + "ab" * 32 + "\n" + "\n".join(lines) + "\n")
    assert [r.step for r in parse_log(str(log))] == [0]  # zephon diff reads the log as before


def test_tombstone_rows_leave_the_dropped_rows_out_of_the_replay_order_and_count_them():
    import pyarrow as pa

    from loader.io.integrity import LaneDataError
    from loader.transforms.rows import tombstone_rows

    dropped_by = pa.array([-1, 1, -1, 0, 1, -1], pa.int16())
    rows, counts = tombstone_rows(dropped_by, None, ("a", "b"), "f", 0)
    assert rows.tolist() == [0, 2, 5] and counts.tolist() == [1, 2]
    order = np.array([5, 3, 0, 1, 4, 2], dtype=np.int64)  # a later epoch's permutation of all six rows
    rows, counts = tombstone_rows(dropped_by, order, ("a", "b"), "f", 0)
    assert rows.tolist() == [5, 0, 2] and counts.tolist() == [1, 2]
    rows, counts = tombstone_rows(pa.array([-1, -1], pa.int16()), None, ("a",), "f", 0)
    assert rows is None and counts.tolist() == [0]  # no tombstone: the row group as stored
    with pytest.raises(LaneDataError, match="dropped_by holds 2, but the manifest lists 2 transforms"):
        tombstone_rows(pa.array([2], pa.int16()), None, ("a", "b"), "f", 0)


def test_a_records_transform_sees_a_fresh_copy_of_the_conversation():
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    doc = Document("k", record=record)
    doc.record["messages"].clear()  # editing what a read returned changes nothing
    assert doc.record == record
    chain = TransformChain([TransformSpec("tests.transforms.functions:shout_replies").resolved(False)], seed=0,
                           source="chat", pretokenized=False, records=True)
    counts = TransformCounts.zeros(1)
    result = chain.apply(Document("k", record=record), counts)
    assert result.record["messages"][1]["content"] == "YO" and counts.counts == [[0, 1]]
    assert record["messages"][1]["content"] == "yo"
