"""``zephon audit --seek-index DIR``: a best-fit replay keeps seek points, later audits start there.

A replay started from a kept point must reach the very lane state a replay from step 0 does;
an audit that uses the index must report the same sequences as one without it, from fewer
replayed outputs; and a changed or foreign index file is refused by name, never replayed from.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest

from loader.checkpoint.state import to_jsonable
from loader.commands import audit as audit_module
from loader.commands import audit_replay
from loader.commands.audit import audit_step
from loader.commands.audit_replay import replayed_lane_state
from loader.commands.seek_index import SeekIndexError
from loader.pipeline import ZephonLoader
from tests.audit.conftest import NUM_LANES


def _lanes(config):
    loader = ZephonLoader(config.replace(num_workers=0, read_ahead=False))
    spec = audit_module.replace(loader.spec, features=audit_module.AUDIT_FEATURES, read_ahead=False)
    return loader, (lambda: audit_module._build(spec, list(range(NUM_LANES)), loader))


@pytest.mark.parametrize("mix", [False, True], ids=["one-source", "mix"])
def test_a_replay_from_a_seek_point_reaches_the_replay_from_zero(make_config, mix):
    overrides = {"schedule": [{"step": 4, "weights": {"web": 1, "code": 3}}]} if mix else {}
    loader, build = _lanes(make_config("best_fit", mix=mix, **overrides))
    try:
        for lane_id in range(NUM_LANES):
            points = {}
            lane = build()[lane_id]
            end = 90
            direct = audit_module._resolved_lane_state(lane, replayed_lane_state(
                lane, 0, end, point_every=7, on_point=lambda k, point: points.setdefault(k, json.loads(json.dumps(point)))))
            assert sorted(points) == list(range(7, end + 1, 7))
            assert any(b for p in points.values() for s in p["sources"] for b in s["packer"]["bins"])  # open bins kept
            for k in (7, 42, 84):
                resumed_lane = build()[lane_id]
                resumed = audit_module._resolved_lane_state(
                    resumed_lane, replayed_lane_state(resumed_lane, k, end, start=points[k]))
                assert json.dumps(to_jsonable(resumed), sort_keys=True) == json.dumps(to_jsonable(direct), sort_keys=True)
    finally:
        loader.close()


def _sequences(report) -> list[dict]:
    return [asdict(s) for s in report.sequences]


def test_an_audit_from_the_seek_index_reports_the_same_step(make_config, tmp_path, monkeypatch):
    monkeypatch.setattr(audit_module, "POINT_EVERY", 5)
    config = make_config("best_fit", mix=True)
    firsts: list[int] = []
    real = audit_replay.replayed_lane_state

    def spy(lane, first_output, end_output, **kwargs):
        firsts.append(first_output)
        return real(lane, first_output, end_output, **kwargs)

    monkeypatch.setattr(audit_replay, "replayed_lane_state", spy)
    index = tmp_path / "seek"
    plain_30 = audit_step(config, 30)
    plain_50 = audit_step(config, 50)
    firsts.clear()
    first = audit_step(config, 30, seek_index=str(index))
    assert _sequences(first) == _sequences(plain_30) and set(firsts) == {0}
    files = os.listdir(index)
    assert len(files) == 1 and files[0].endswith(".json")
    firsts.clear()
    later = audit_step(config, 50, seek_index=str(index))  # starts from the points the first one kept
    assert _sequences(later) == _sequences(plain_50)
    assert firsts and min(firsts) > 0
    assert any("from the seek index" in note for note in later.notes)
    firsts.clear()
    again = audit_step(config, 30, seek_index=str(index))
    assert _sequences(again) == _sequences(plain_30) and min(firsts) > 0

    other = make_config("best_fit", mix=True, seq_len=config.seq_len * 2)
    audit_step(other, 10, seek_index=str(index))
    assert len(os.listdir(index)) == 2  # another run: its own file, never the first one's points


def test_a_changed_or_foreign_seek_index_is_refused_by_name(make_config, tmp_path, monkeypatch):
    monkeypatch.setattr(audit_module, "POINT_EVERY", 5)
    config = make_config("best_fit")
    index = tmp_path / "seek"
    audit_step(config, 20, seek_index=str(index))
    (path,) = [index / name for name in os.listdir(index)]
    data = json.loads(path.read_text())

    lane, points = next(iter(data["lanes"].items()))
    outputs = next(iter(points))
    points[outputs]["sources"][0]["packer"]["stream"]["offset"] += 1  # one token: a silent difference
    path.write_text(json.dumps(data))
    with pytest.raises(SeekIndexError, match=f"{path}.*hmac_sha256"):
        audit_step(config, 30, seek_index=str(index))

    path.write_text(path.read_text()[:100])  # cut short
    with pytest.raises(SeekIndexError, match="cannot be read as JSON"):
        audit_step(config, 30, seek_index=str(index))

    data["key"] = "0" * 64
    path.write_text(json.dumps(data))
    with pytest.raises(SeekIndexError, match="another run"):
        audit_step(config, 30, seek_index=str(index))


def test_an_audit_that_seeks_keeps_no_index(make_config, tmp_path):
    index = tmp_path / "seek"
    audit_step(make_config("concat"), 12, seek_index=str(index))  # concat seeks: nothing to keep
    assert not index.exists()
