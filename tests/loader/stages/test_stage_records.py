"""One stage protocol, one record per stage: the registry the checkpoint schema assembles from.

Each stateful stage follows ``get_state`` / ``set_state(state, path)`` and registers its record
(loader.checkpoint.records); the keys its state builders write are exactly its record's, and the
schema reads a lane through the registered records (a record taken out of the registry is
missed by name).
"""

from __future__ import annotations

import numpy as np
import pytest

from loader.checkpoint import records
from loader.checkpoint.records import RecordContext, RecordType, StateProblems, Stateful, record_type
from loader.errors import StateError
from loader.io.cursor_record import CURSOR, cursor_state
from loader.io.lane_reader import LaneTokenStream
from loader.stages.lane import Lane
from loader.stages.lane_record import LANE, LaneState, cursor_lane_state, lane_state
from loader.stages.mixed_record import MIXED_STREAM, mixed_stream_state
from loader.stages.packer_records import (
    BEST_FIT, BEST_FIT_WINDOW, CONCAT, best_fit_state, concat_packer_state, window_packer_state,
)
from loader.stages.packing import BestFitPacker, ConcatPacker
from loader.stages.token_mixing import MixedTokenStream
from loader.stages.window_packing import WindowedBestFitPacker

CONTEXT = RecordContext(packing="concat", packing_window=None, source_names=("web", "code"), token_mixing=False)


@pytest.mark.parametrize("stage", [LaneTokenStream, MixedTokenStream, ConcatPacker, BestFitPacker,
                                   WindowedBestFitPacker, Lane])
def test_every_stage_follows_the_protocol(stage):
    assert issubclass(stage, Stateful)


def test_the_stages_register_their_records():
    names = {r.name for r in records.registered_records()}
    assert {"cursor", "mixed_stream", "concat", "best_fit", "best_fit_window", "lane"} <= names


@pytest.mark.parametrize("record, state", [
    (CURSOR, cursor_state(0, 1, 2, False)),
    (MIXED_STREAM, mixed_stream_state([cursor_state(0, 0, 0, False)] * 2, [0, 0], -1, 0)),
    (CONCAT, concat_packer_state(cursor_state(0, 0, 0, False))),
    (BEST_FIT, best_fit_state(cursor_state(0, 0, 0, False), [], 0)),
    (BEST_FIT_WINDOW, window_packer_state(cursor_state(0, 0, 0, False), 3, 1)),
    (LANE, cursor_lane_state(("web", "code"), False, 5, [(0, 0, 0, False)] * 2, (False, True))),
])
def test_a_builders_keys_are_its_records(record, state):
    assert set(record.keys) <= set(state) <= set(record.keys + record.optional)


def test_a_lane_parses_through_the_registered_records():
    raw = lane_state(("web", "code"), False, 7, [concat_packer_state(cursor_state(1, 2, 3, False)),
                                                 concat_packer_state(cursor_state(0, 0, 0, True))], [False, True])
    problems = StateProblems()
    lane = LANE(raw, "lanes.00003", problems, CONTEXT)
    assert not problems and isinstance(lane, LaneState)
    assert lane.outputs == 7 and lane.sources["code"].stopped
    assert (lane.sources["web"].packer.stream.epoch, lane.sources["web"].packer.stream.offset) == (1, 3)


def test_bad_fields_are_named_by_their_path():
    raw = lane_state(("web", "code"), False, -1, [concat_packer_state(cursor_state(0, "x", 0, False)),
                                                  {"stream": {}, "extra": 1}], [False, 0])
    problems = StateProblems()
    assert LANE(raw, "lanes.00003", problems, CONTEXT) is None
    text = "\n".join(problems.items)
    for path in ("lanes.00003.outputs", "lanes.00003.sources.web.packer.stream.block",
                 "lanes.00003.sources.code.packer.extra", "lanes.00003.sources.code.stopped"):
        assert path in text, (path, text)


def test_a_best_fit_lane_reads_its_bins_by_the_best_fit_record():
    context = RecordContext(packing="best_fit", packing_window=None, source_names=("web",), token_mixing=False)
    bin_ = {"serial": 0, "tokens": [5, 6, 7], "piece_starts": [0, 2], "doc_starts": [0], "piece_origins": [[0, 0, 0], [0, 0, 2]]}
    raw = lane_state(("web",), False, 1, [best_fit_state(cursor_state(0, 0, 3, False), [bin_], 1)], [False])
    problems = StateProblems()
    lane = record_type("lane")(raw, "lanes.00000", problems, context)
    assert not problems.items
    (saved,) = lane.sources["web"].packer.bins
    assert saved.tokens.tolist() == [5, 6, 7] and saved.piece_origins == ((0, 0, 0), (0, 0, 2))


def test_an_unregistered_packer_record_is_refused_by_name(monkeypatch):
    monkeypatch.delitem(records._RECORDS._items, "concat")
    with pytest.raises(StateError, match="no checkpoint record 'concat' is registered"):
        LANE(lane_state(("web",), False, 0, [concat_packer_state(cursor_state(0, 0, 0, False))], [False]),
             "lanes.00000", StateProblems(), RecordContext("concat", None, ("web",), False))


def test_a_record_is_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        records.register_record(CURSOR)


def test_record_migrations_read_older_versions():
    record = RecordType(name="test_only", version=3, keys=("a",), parse=lambda *a: None,
                        migrations={1: lambda raw: dict(raw, b=0), 2: lambda raw: dict(raw, c=raw["b"] + 1)})
    assert record.readable == (1, 2, 3)
    assert record.upgrade({"a": 1}, 1) == {"a": 1, "b": 0, "c": 1}
    assert BEST_FIT_WINDOW.readable == (1,) and BEST_FIT.readable == (1, 2)


def test_a_bin_of_the_wrong_feature_set_is_refused_on_restore():
    # The record holds which features a bin may carry; the stage checks them against its stream.
    class Stream:
        feature_names = ("loss_mask",)
        last_origin = None

        def set_state(self, state, path):
            pass

    packer = BestFitPacker(Stream(), seq_len=8, pad_id=0, open_bins=2)
    state = best_fit_state(cursor_state(0, 0, 0, False), [{"serial": 0, "tokens": np.array([1, 2]),
                                                          "piece_starts": [0], "doc_starts": [0]}], 1)
    with pytest.raises(StateError, match=r"packer\.bins\[0\]: holds per-token features \[\]"):
        packer.set_state(state, "packer")
