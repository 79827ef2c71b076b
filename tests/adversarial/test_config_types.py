"""Every loader config field given wrong types and out-of-range values: a ConfigError naming it.

The cases are generated from the dataclass fields (``LoaderConfig``, ``SourceConfig``,
``ScheduleEntry``, ``StorageOptions``): a field whose annotation is a plain ``bool``,
``int``, ``float`` or ``str`` (optional or not) gets every wrong value of its kind, so a
field added later is covered without editing this file; a field of any other shape must
have hand-written cases in ``SHAPED_CASES`` (the coverage test fails otherwise). The
expectations come from the annotation and the README's table, not from the validation
rules under test.

Each case asserts a :class:`ConfigError` whose message names the field by its path
(``datasets[1].weight``, ``schedule[0].weights.web``, ``storage.request_timeout_s``) and
shows the value.
"""

from __future__ import annotations

import json
import time
import typing
from dataclasses import MISSING, fields
from pathlib import Path

import numpy as np
import pytest

from loader.io import storage as storage_mod
from loader.config import STORAGE_TOP_LEVEL, ConfigError, LoaderConfig, ScheduleEntry, SourceConfig
from loader.order.ordering import Topology, TopologyError, validate_topology
from loader.io.storage import StorageOptions
from loader.stages.tokenizer import TokenizerError, load_tokenizer
from loader.validation import show

NAN, INF = float("nan"), float("inf")

BASE = dict(datasets=[{"path": "data/web"}], seq_len=64, global_batch_size=16, micro_batch_size=4, seed=0,
            tokenizer="tokenizer.json")
MIX = dict(BASE, datasets=[{"path": "data/web", "name": "web"}, {"path": "data/code", "name": "code"}])

# Wrong values by the kind of the annotation. Every value here is wrong for every field of
# that kind (-1 is below every integer field's minimum, 0 or 1 would not be).
WRONG_BY_KIND = {
    bool: ["false", "true", "yes", 0, 1, 0.0, NAN, None, [], [True], {}, {"x": True}],
    int: ["8", "", 1.5, 2.0, NAN, INF, -INF, True, False, -1, None, [], [8], {}, {"x": 8}],
    float: ["1.0", "", NAN, INF, -INF, True, False, -1, -0.5, None, [], [1.0], {}, {"x": 1.0}],
    str: ["", 1, 1.5, NAN, True, False, None, [], ["x"], {}, {"x": "y"}],
}

# Fields whose annotation is not a plain kind: hand-written wrong values.
SHAPED_CASES = {
    "datasets": [
        [], "data/web", {"path": "data/web"}, None, 3, NAN, True,
        [5], ["data/web"], [None], [{}], [{"path": "a", "wieght": 1.0}],
    ],
    "schedule": [
        "0:web", {"step": 0, "weights": {"web": 1}}, 5, NAN, True,
        [5], [None], [[0, {"web": 1}]], [{}], [{"step": 0}], [{"weights": {"web": 1}}],
        [{"step": 0, "weights": {"web": 1}, "extra": 1}],
    ],
    "storage": ["retries=3", 3, NAN, True, [], [("retry_max_attempts", 3)], {"retries": 3},
                *({name: "x"} for name in STORAGE_TOP_LEVEL)],
    "weights": ["web=1", None, 1.0, NAN, True, [], [1, 1], {}, {"web": 0, "code": 0}],  # ScheduleEntry
    "batch_fields": ["input_ids", None, 3, NAN, True, {}, [], ["labels"], ["input_ids", "attention_mask"],
                     ["input_ids", "input_ids"], ["input_ids", 3], ["input_ids", None]],
    "transforms": ["drop_regex", {"function": "identity"}, None, 5, NAN, True, [5], [None], [{}],  # issue 19
                   [{"function": ""}], [{"function": "identity", "extra": 1}], [{"function": "identity", "args": 3}],
                   [{"function": "identity", "args": {"x": NAN}}], [{"function": "identity", "stage": "words"}],
                   [{"function": "nope"}], [{"function": "a b:c"}]],
    "images": ["qwen2_vl", 5, NAN, True, [], [{}], {"extra": 1}, {"overflow": "drop"},  # issue 18
               {"overflow": 3}, {"max_images_per_sequence": 0}, {"max_images_per_sequence": 1.5},
               {"max_images_per_sequence": True}, {"image_token": 3}, {"image_token": ""},
               {"image_start_token": 7}, {"image_end_token": ["<e>"]}, {"policy": 5}, {"policy": "tiles"}, {"policy": {"kind": "fixed", "size": -3}}],
}


def kind_of(annotation) -> tuple[type | None, bool]:
    """``(plain kind, optional)`` of an annotation, or ``(None, False)`` for other shapes."""
    args = typing.get_args(annotation)
    optional = typing.get_origin(annotation) is typing.Union and type(None) in args
    if optional:
        (annotation,) = [a for a in args if a is not type(None)]
    return (annotation, optional) if annotation in WRONG_BY_KIND else (None, False)


def wrong_values(record: type, name: str) -> list:
    hints = typing.get_type_hints(record)
    kind, optional = kind_of(hints[name])
    if kind is None:
        return SHAPED_CASES[name]
    return [v for v in WRONG_BY_KIND[kind] if not (optional and v is None)]


def cases(record: type, skip=()) -> list[tuple[str, object]]:
    return [(f.name, value) for f in fields(record) if f.name not in skip for value in wrong_values(record, f.name)]


def case_id(case) -> str:
    name, value = case
    return f"{name}={show(value)[:30]}"


def assert_names(exc: ConfigError, path: str, value) -> None:
    message = str(exc)
    assert path in message, f"{path!r} not named in: {message}"
    if not isinstance(value, (list, dict)):  # a container's message may show the bad item instead
        assert f"(got {show(value)})" in message, message


# -- coverage ----------------------------------------------------------------------------
@pytest.mark.parametrize("record", [LoaderConfig, SourceConfig, ScheduleEntry, StorageOptions])
def test_every_field_has_wrong_value_cases(record):
    """A new field of an unusual shape must get hand-written cases here."""
    hints = typing.get_type_hints(record)
    uncovered = [f.name for f in fields(record) if kind_of(hints[f.name])[0] is None and f.name not in SHAPED_CASES]
    assert not uncovered, f"add wrong-value cases for {record.__name__} fields {uncovered} to SHAPED_CASES"


def test_the_base_configs_are_valid():
    assert LoaderConfig(**BASE).datasets[0].path == "data/web"
    assert [d.name for d in LoaderConfig(**MIX).datasets] == ["web", "code"]


# -- LoaderConfig ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", cases(LoaderConfig), ids=case_id)
def test_top_level_field(case):
    name, value = case
    with pytest.raises(ConfigError) as keyword:
        LoaderConfig(**{**BASE, name: value})
    assert_names(keyword.value, name, value)
    with pytest.raises(ConfigError) as parsed:
        LoaderConfig.from_dict({**BASE, name: value}, where="run.toml")
    assert str(parsed.value).startswith("run.toml: ")
    assert_names(parsed.value, name, value)


@pytest.mark.parametrize("case", cases(SourceConfig), ids=case_id)
def test_dataset_entry_field(case):
    name, value = case
    entry = {"path": "data/code", "name": "code", name: value}
    with pytest.raises(ConfigError) as exc:
        LoaderConfig(**{**MIX, "datasets": [MIX["datasets"][0], entry]})
    assert_names(exc.value, f"datasets[1].{name}", value)
    with pytest.raises(ConfigError) as direct:
        SourceConfig(**{"path": "data/code", name: value})
    assert_names(direct.value, name, value)


@pytest.mark.parametrize("case", cases(ScheduleEntry), ids=case_id)
def test_schedule_entry_field(case):
    name, value = case
    entry = {"step": 4, "weights": {"web": 1, "code": 1}, name: value}
    with pytest.raises(ConfigError) as exc:
        LoaderConfig(**{**MIX, "schedule": [{"step": 0, "weights": {"web": 1, "code": 1}}, entry]})
    assert_names(exc.value, f"schedule[1].{name}", value)


@pytest.mark.parametrize("weight", WRONG_BY_KIND[float], ids=show)
def test_schedule_weight_value(weight):
    with pytest.raises(ConfigError) as exc:
        LoaderConfig(**{**MIX, "schedule": [{"step": 3, "weights": {"web": 1, "code": weight}}]})
    assert_names(exc.value, "schedule[0].weights.code", weight)


def test_schedule_weights_need_a_positive_weight():
    with pytest.raises(ConfigError, match=r"schedule\[0\]\.weights must be .*positive sum.*got \{'web': 0, 'code': 0\}"):
        LoaderConfig(**{**MIX, "schedule": [{"step": 3, "weights": {"web": 0, "code": 0}}]})


@pytest.mark.parametrize("case", [(f.name, v) for f in fields(StorageOptions) if f.name not in STORAGE_TOP_LEVEL
                                  and f.name not in {g.name for g in fields(LoaderConfig)}
                                  for v in wrong_values(StorageOptions, f.name)], ids=case_id)
def test_storage_table_field(case):
    name, value = case
    with pytest.raises(ConfigError) as exc:
        LoaderConfig(**{**BASE, "storage": {name: value}})
    assert_names(exc.value, f"storage.{name}", value)


@pytest.mark.parametrize("case", cases(StorageOptions), ids=case_id)
def test_storage_options_field(case):
    name, value = case
    with pytest.raises(ConfigError) as exc:
        StorageOptions(**{name: value})
    assert_names(exc.value, name, value)


@pytest.mark.parametrize("name", ["request_timeout_s", "worker_timeout_s"])
def test_timeouts_must_be_positive(name):
    overrides = {"storage": {name: 0}} if name == "request_timeout_s" else {name: 0}
    with pytest.raises(ConfigError, match=rf"{name} must be a finite number > 0 \(got 0\)"):
        LoaderConfig(**{**BASE, **overrides})


def test_every_bad_field_is_reported_at_once():
    bad = {**MIX, "add_eos": "false", "seq_len": 64.0, "storage": {"request_timeout_s": INF},
           "datasets": [{"path": "data/web", "name": "web"}, {"path": "data/code", "weight": NAN}],
           "schedule": [{"step": -1, "weights": {"web": -1, "code": 1}}]}
    with pytest.raises(ConfigError) as exc:
        LoaderConfig.from_dict(bad, where="run.json")
    message = str(exc.value)
    for path in ("add_eos", "seq_len", "storage.request_timeout_s", "datasets[1].weight", "schedule[0].step",
                 "schedule[0].weights.web"):
        assert f"{path} must be" in message, (path, message)
    assert "\n" not in message


def test_missing_and_unknown_fields_are_named():
    data = {k: v for k, v in BASE.items() if k != "seed"}
    with pytest.raises(ConfigError, match=r"run.toml: .*unknown field\(s\) \['sed'\].*seed is required: it must be an integer >= 0"):
        LoaderConfig.from_dict({**data, "sed": 1}, where="run.toml")
    with pytest.raises(ConfigError, match=r"datasets\[0\]: unknown field\(s\) \['wieght'\]"):
        LoaderConfig.from_dict({**BASE, "datasets": [{"path": "a", "wieght": 0.5}]})


def test_cross_field_checks_still_apply():
    with pytest.raises(ConfigError, match="concat packing needs a document separator"):
        LoaderConfig(**BASE, add_eos=False)
    with pytest.raises(ConfigError, match="source names must be unique"):
        LoaderConfig(**{**MIX, "datasets": [{"path": "a", "name": "x"}, {"path": "b", "name": "x"}]})
    with pytest.raises(ConfigError, match="strictly increasing"):
        LoaderConfig(**{**MIX, "schedule": [{"step": 5, "weights": {"web": 1}}, {"step": 5, "weights": {"web": 1}}]})


def test_valid_values_are_stored_in_their_plain_form():
    config = LoaderConfig(**{**BASE, "seq_len": np.int64(64), "tokenizer": Path("tok.json"),
                             "datasets": [{"path": Path("data/web"), "weight": np.float64(0.5)}],
                             "batch_fields": ["input_ids", "labels"]})
    assert type(config.seq_len) is int and config.tokenizer == "tok.json" and config.datasets[0].path == "data/web"
    assert config.batch_fields == ("input_ids", "labels")
    json.dumps(config.stream_fields())  # no numpy scalar left
    assert config.replace(seed=3).seed == 3 and config.replace(seed=3).datasets == config.datasets
    with pytest.raises(ConfigError, match="seed must be an integer >= 0 .*got -3"):
        config.replace(seed=-3)


# -- files ------------------------------------------------------------------------------------
TOML_BASE = 'seed = 0\nseq_len = 64\nglobal_batch_size = 16\nmicro_batch_size = 4\ntokenizer = "t.json"\n'


@pytest.mark.parametrize("text, path", [
    (TOML_BASE + 'add_eos = "false"\n[[datasets]]\npath = "d"\n', "add_eos"),
    (TOML_BASE + '[[datasets]]\npath = "d"\nweight = nan\n', "datasets[0].weight"),
    (TOML_BASE + '[[datasets]]\npath = "d"\nweight = inf\n', "datasets[0].weight"),
    (TOML_BASE + 'worker_timeout_s = inf\n[[datasets]]\npath = "d"\n', "worker_timeout_s"),
    (TOML_BASE + '[storage]\nrequest_timeout_s = nan\n[[datasets]]\npath = "d"\n', "storage.request_timeout_s"),
    (TOML_BASE + '[[datasets]]\npath = "d"\n[[schedule]]\nweights = {d = 1}\n', "schedule[0].step"),
    (TOML_BASE + '[[datasets]]\npath = "d"\n[[schedule]]\nstep = "10"\nweights = {d = 1}\n', "schedule[0].step"),
    (TOML_BASE + '[[datasets]]\npath = "d"\n[[schedule]]\nstep = 10\nweights = {d = "1"}\n', "schedule[0].weights.d"),
])
def test_toml_file(tmp_path, text, path):
    config_path = tmp_path / "run.toml"
    config_path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        LoaderConfig.from_file(str(config_path))
    assert str(exc.value).startswith(f"{config_path}: ") and f"{path} " in str(exc.value)


def test_json_file(tmp_path):
    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps({**BASE, "read_ahead": "false", "prefetch": 2.5, "cache_max_bytes": -1}))
    with pytest.raises(ConfigError) as exc:
        LoaderConfig.from_file(str(config_path))
    for path in ("read_ahead", "prefetch", "cache_max_bytes"):
        assert f"{path} must be" in str(exc.value)


@pytest.mark.parametrize("content", [None, "dir", b"\xff\xfe\x00garbage", "[1, 2]", "seed = ", '"just a string"'])
def test_unreadable_config_files(tmp_path, content):
    path = tmp_path / ("run.json" if content in ("[1, 2]", '"just a string"') else "run.toml")
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as exc:
        LoaderConfig.from_file(str(path))
    assert str(path) in str(exc.value)


# -- a huge batch size ------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [10**12, 10**12 + 1, 2**61 - 1, 10**18])
def test_topology_messages_for_huge_sizes_are_instant(batch):
    started = time.perf_counter()
    with pytest.raises(TopologyError, match="valid micro-batch sizes here: \\[1, ") as exc:
        validate_topology(num_lanes=8, global_batch_size=batch, micro_batch_size=batch - 1, world_size=1, rank=0)
    with pytest.raises(TopologyError, match="divisors: \\[1, "):
        Topology(num_lanes=batch, global_batch_size=16, micro_batch_size=1, world_size=batch - 1)
    assert time.perf_counter() - started < 1.0
    assert len(str(exc.value)) < 1000


def test_small_divisor_lists_stay_complete():
    with pytest.raises(TopologyError, match=r"valid micro-batch sizes here: \[1, 2, 3, 4, 6, 12\]"):
        validate_topology(num_lanes=8, global_batch_size=24, micro_batch_size=5, world_size=2, rank=0)
    with pytest.raises(TopologyError, match=r"divisors: \[1, 2, 4, 8\]"):
        validate_topology(num_lanes=8, global_batch_size=24, micro_batch_size=1, world_size=3, rank=0)


# -- the tokenizer path ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["directory", "missing", "empty", "binary", "json_not_tokenizer", "truncated"])
def test_bad_tokenizer_files(tmp_path, kind):
    path = tmp_path / "tokenizer.json"
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "binary":
        path.write_bytes(bytes(range(256)))
    elif kind == "json_not_tokenizer":
        path.write_text('{"vocab": {"a": 0}}')
    elif kind == "truncated":
        from loader.samples import default_tokenizer_path

        path.write_bytes(Path(default_tokenizer_path()).read_bytes()[:5000])
    with pytest.raises(TokenizerError) as exc:
        load_tokenizer(str(path))
    assert str(path) in str(exc.value)


def test_unreadable_tokenizer_file(tmp_path, monkeypatch):
    """Permission bits do not stop root (CI may run as root): the read itself is made to fail."""
    path = str(tmp_path / "tokenizer.json")

    def denied(p, options=None):
        raise PermissionError(13, "Permission denied", p)

    monkeypatch.setattr(storage_mod, "read_bytes", denied)
    with pytest.raises(TokenizerError, match=f"{path} cannot be read \\(Permission denied\\)"):
        load_tokenizer(path)


def test_defaults_cover_every_required_field():
    """BASE must name every required field, or the cases above would fail for the wrong reason."""
    required = {f.name for f in fields(LoaderConfig) if f.default is MISSING and f.default_factory is MISSING}
    assert required == set(BASE)
