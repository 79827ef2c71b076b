"""Worker lane states shipped as deltas of best-fit bins decode to exactly ``get_state()``.

A worker names the bins it has already sent for a lane instead of sending their arrays
again (:mod:`loader.workers.state_delta`); the trainer must still record, for every item,
the very state the lane had after it: same JSON, whatever the packing, over bin evictions,
block changes and a restore (a new run: both sides start anew).
"""

from __future__ import annotations

import json
import pickle

import pytest

from loader.checkpoint.state import to_jsonable
from loader.pipeline import ZephonLoader
from loader.stages.producer import End, build_lanes, produce
from loader.workers.state_delta import StateDecoder, StateEncoder
from tests.loader.settings import NUM_LANES


def _run_states(loader: ZephonLoader, lane_ids: list[int], states: dict, start: int, count: int):
    lanes = build_lanes(loader.spec, lane_ids, states)
    encoder, decoder = StateEncoder(), StateDecoder(loader.spec.source_names, loader.spec.token_mixing)
    items = produce(lanes, num_lanes=NUM_LANES, rank=0, world_size=1, start_position=start, snapshot_state=False)
    sizes = []
    try:
        for _ in range(count):
            item = next(items)
            assert not isinstance(item, End)
            lane_id = item.global_index % NUM_LANES
            shipped = pickle.dumps(encoder.ship(lane_id, lanes[lane_id]))  # as a worker sends it
            sizes.append(len(shipped))
            decoded = decoder.decode(pickle.loads(shipped))
            expected = lanes[lane_id].get_state()
            assert json.dumps(to_jsonable(decoded)) == json.dumps(to_jsonable(expected)), item.global_index
            yield lane_id, decoded, sizes
    finally:
        for lane in lanes.values():
            lane.close()


@pytest.mark.parametrize("packing", ["best_fit", "concat"])
def test_decoded_states_are_the_lanes_states(make_config, packing):
    loader = ZephonLoader(make_config(packing, pretokenized=True))
    lane_ids = [l for l in loader.rank_lanes if l % 2 == 0]  # a worker's share
    last: dict = {}
    for lane_id, state, sizes in _run_states(loader, lane_ids, {}, 0, 300):
        last[lane_id] = to_jsonable(state)
    # a restore from those states: a new run, a new encoder and decoder
    for _ in _run_states(loader, lane_ids, last, 300, 60):
        pass
    loader.close()


def test_unchanged_bins_are_not_sent_again(make_config):
    loader = ZephonLoader(make_config("best_fit", pretokenized=True))
    lane_ids = [0]
    full = []
    for lane_id, state, sizes in _run_states(loader, lane_ids, {}, 0, 40 * NUM_LANES):
        full.append(len(pickle.dumps(state)))
    loader.close()
    assert sum(sizes[5:]) < 0.7 * sum(full[5:]), (sum(sizes[5:]), sum(full[5:]))


def test_decoded_bins_carry_their_piece_origins(make_config):
    """The origins travel with the bins: a shipped delta decodes to bins that say where every
    piece came from (state version 2), as ``get_state()`` does."""
    loader = ZephonLoader(make_config("best_fit", pretokenized=True))
    pieces = 0
    for _, state, _ in _run_states(loader, [0, 2], {}, 0, 80):
        for bin_ in to_jsonable(state)["sources"]["synthetic"]["packer"]["bins"]:
            assert len(bin_["piece_origins"]) == len(bin_["piece_starts"])
            pieces += len(bin_["piece_starts"])
    loader.close()
    assert pieces


def _two_sources(corpus, mixing_unit: str) -> dict:
    """The pre-tokenized corpus as two sources (each its own lanes' streams and packers)."""
    return dict(datasets=[{"path": corpus.pretokenized_path, "name": "a", "weight": 0.6},
                          {"path": corpus.pretokenized_path, "name": "b", "weight": 0.4}],
                mixing_unit=mixing_unit)


@pytest.mark.parametrize("case", ["one_source", "sequence_mix", "token_mix", "text"])
def test_bare_cursors_ship_as_integers_and_decode_to_the_lanes_states(make_config, corpus, case):
    """Concat lanes over plain streams ship ``(outputs, cursors, stopped)``; the decoder's
    snapshot builds exactly ``get_state()`` (checked per item by ``_run_states``), also after a
    restore. Where a packer's state is more than a cursor (token mixing; text cursors that name
    their document), the state travels as the dict it is."""
    overrides = {"one_source": {}, "text": {},
                 "sequence_mix": _two_sources(corpus, "sequence"), "token_mix": _two_sources(corpus, "token")}[case]
    loader = ZephonLoader(make_config("concat", pretokenized=case != "text", **overrides))
    lane_ids = [l for l in loader.rank_lanes if l % 2 == 1]
    encoder = StateEncoder()
    lanes = build_lanes(loader.spec, lane_ids, {})
    try:
        shipped = encoder.ship(lane_ids[0], lanes[lane_ids[0]])
        bare = case in ("one_source", "sequence_mix")
        assert isinstance(shipped, tuple) == bare, shipped
        if bare:  # a small fraction of the dict it stands for
            assert len(pickle.dumps(shipped)) < 0.5 * len(pickle.dumps(lanes[lane_ids[0]].get_state()))
    finally:
        for lane in lanes.values():
            lane.close()
    last: dict = {}
    for lane_id, state, _ in _run_states(loader, lane_ids, {}, 0, 120):
        last[lane_id] = to_jsonable(state)
    for _ in _run_states(loader, lane_ids, last, 120, 40):  # restored from those states
        pass
    loader.close()


@pytest.mark.parametrize("case", ["one_source", "sequence_mix", "text", "token_mix"])
def test_best_fit_packers_ship_as_tuples_and_decode_to_the_lanes_states(make_config, corpus, case):
    """Best-fit lanes whose sources are not mixed per token ship their packers' parts as a tuple
    (cursor, serial, open bins' serials, new pieces' tokens as bytes), text cursors as their dict;
    the decoder's snapshot builds exactly ``get_state()`` per item (``_run_states``), over bin
    evictions and block changes, and after a restore. A token mix ships the encoded snapshot."""
    overrides = {"one_source": {}, "text": {},
                 "sequence_mix": _two_sources(corpus, "sequence"), "token_mix": _two_sources(corpus, "token")}[case]
    loader = ZephonLoader(make_config("best_fit", pretokenized=case != "text", **overrides))
    lane_ids = [l for l in loader.rank_lanes if l % 2 == 0]
    lanes = build_lanes(loader.spec, lane_ids, {})
    try:
        shipped = StateEncoder().ship(lane_ids[0], lanes[lane_ids[0]])
        assert isinstance(shipped, tuple) == (case != "token_mix"), shipped
    finally:
        for lane in lanes.values():
            lane.close()
    last: dict = {}
    pieces = 0
    for lane_id, state, _ in _run_states(loader, lane_ids, {}, 0, 200):
        last[lane_id] = to_jsonable(state)
        packers = [s["packer"] for s in last[lane_id]["sources"].values()] if "sources" in last[lane_id] \
            else [last[lane_id]["mixed"]]
        pieces += sum(len(b["piece_starts"]) for packer in packers for b in packer["bins"])
    assert pieces  # open bins with pieces were compared, not only empty packers
    for _ in _run_states(loader, lane_ids, last, 200, 60):  # restored: the first ship sends every piece
        pass
    loader.close()


def test_a_piece_count_the_trainer_does_not_hold_is_an_error(make_config):
    """The decoder refuses a delta that does not continue what it holds (a lost or reordered
    message) rather than record a state with pieces missing."""
    loader = ZephonLoader(make_config("best_fit", pretokenized=True))
    lanes = build_lanes(loader.spec, [0], {})
    encoder, decoder = StateEncoder(), StateDecoder(loader.spec.source_names, loader.spec.token_mixing)
    try:
        items = produce(lanes, num_lanes=NUM_LANES, rank=0, world_size=1, start_position=0, snapshot_state=False)
        shipped = []
        while len(shipped) < 6:
            item = next(items)
            if item.global_index % NUM_LANES == 0:
                shipped.append(pickle.dumps(encoder.ship(0, lanes[0])))
        decoder.decode(pickle.loads(shipped[0]))
        with pytest.raises(RuntimeError, match="internal error: lane 0 bin"):
            for message in shipped[2:]:  # the second one skipped
                decoder.decode(pickle.loads(message))
    finally:
        lanes[0].close()
        loader.close()


def test_a_delta_is_keyed_by_the_best_fit_record(make_config):
    """The transport writes the record's own keys (loader.stages.packer_records), its marker beside them
    (the encoded snapshot: what lanes mixed per token ship; other best-fit lanes ship packer tuples)."""
    from loader.stages.packer_records import BEST_FIT
    from loader.workers import state_delta

    def deltas(value):
        if isinstance(value, dict):
            if state_delta._DELTA in value:
                yield value
            for inner in value.values():
                yield from deltas(inner)

    loader = ZephonLoader(make_config("best_fit", pretokenized=True))
    for lane_id, _, _ in _run_states(loader, [0], {}, 0, 1):
        lane = build_lanes(loader.spec, [lane_id], {})[lane_id]
        found = list(deltas(StateEncoder().encode(lane_id, lane.snapshot())))
        lane.close()
        assert found and all(set(d) - {state_delta._DELTA} == set(BEST_FIT.keys) for d in found)
    loader.close()
