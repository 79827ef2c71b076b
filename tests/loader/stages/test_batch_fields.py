"""``batch_fields``: a micro-batch holds only the per-token tensors asked for, and the stream
(ids, sources, indices, steps, checkpoints, fingerprints) does not depend on the choice."""

from __future__ import annotations

import json

import pytest
import torch

from loader.config import BATCH_FIELDS, ConfigError
from loader.commands.fingerprints import collect_fingerprints
from loader.pipeline import ZephonLoader

PER_SEQUENCE = ("source_ids", "global_indices", "step", "micro_step")


def _mixed(make_config, corpus, **overrides):
    return make_config("concat", datasets=[{"path": corpus.text_path, "name": "a", "weight": 0.6},
                                           {"path": corpus.pretokenized_path, "name": "b", "weight": 0.4}],
                       mixing_unit="token", **overrides)


def _batches(config, count: int) -> list[dict]:
    with ZephonLoader(config) as loader:
        return [next(loader) for _ in range(count)]


@pytest.mark.parametrize("case", ["concat", "best_fit", "token_mix"])
@pytest.mark.parametrize("fields", [("input_ids",), ("input_ids", "position_ids"), ("cu_seqlens", "input_ids")])
def test_a_batch_holds_the_fields_asked_for_with_the_same_values(make_config, corpus, case, fields):
    def config(**overrides):
        if case == "token_mix":
            return _mixed(make_config, corpus, **overrides)
        return make_config(case, **overrides)

    full = _batches(config(), 6)
    part = _batches(config(batch_fields=fields), 6)
    # No source of these cases has a loss_mask column (tests/loader/io/test_features.py covers it).
    expected_keys = set(BATCH_FIELDS) - {"loss_mask"} - ({"token_source_ids"} if case != "token_mix" else set())
    assert set(full[0]) == expected_keys | set(PER_SEQUENCE)
    for a, b in zip(full, part):
        assert set(b) == set(fields) | set(PER_SEQUENCE)
        for key in b:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key


def test_a_resume_may_change_the_fields(make_config):
    config = make_config("concat")
    expected = _batches(config, 8)
    with ZephonLoader(config) as first:
        for _ in range(3):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))
    with ZephonLoader(config.replace(batch_fields=("input_ids",))) as resumed:
        resumed.load_state_dict(state)
        rest = [next(resumed) for _ in range(5)]
    for a, b in zip(expected[3:], rest):
        assert torch.equal(a["input_ids"], b["input_ids"]) and "labels" not in b


def test_fingerprints_do_not_depend_on_the_fields(make_config):
    lines = lambda config: [r.line() for r in collect_fingerprints(config, end_step=6)[0]]  # noqa: E731
    assert lines(make_config("concat", batch_fields=("input_ids",))) == lines(make_config("concat"))


@pytest.mark.parametrize("fields,message", [
    (("labels",), "must be a list of names .* that includes 'input_ids'"),
    (("input_ids", "attention_mask"), r"unknown: \['attention_mask'\]"),
    ("input_ids", "batch_fields must be a list"),
])
def test_bad_fields_are_named(make_config, fields, message):
    with pytest.raises(ConfigError, match=message):
        make_config("concat", batch_fields=fields)
