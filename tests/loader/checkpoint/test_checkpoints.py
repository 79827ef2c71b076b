"""Checkpoints: every stage resumes exactly, states are small JSON, restores seek, bad resumes are refused.

* The shared harness (tests/resume_harness.py) on each stage: the lane token stream, both
  packers and the whole loader, cut mid-epoch, right at an epoch edge, at the end of the
  data and several times in a row.
* A state is JSON primitives only (no pickle), and its size is bounded by
  ``L x (cursor + packer bound)``: the same at step 5 and at step 300.
* A restore reads about one row group per lane, whatever the step: it never replays.
* A resume with another seed, seq_len, tokenizer, packing, dataset or lane count is refused
  with a StateError naming the difference; merge_rank_states refuses mismatched or mid-step
  rank states.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from loader.io.read_ahead import READ_AHEAD_BLOCKS
from loader.pipeline import ZephonLoader
from loader.checkpoint.state import StateError, merge_rank_states
from loader.integrations.torch_data import LoaderStateful
from tests.loader.settings import GLOBAL_BATCH, MICRO_BATCH, NUM_LANES, OPEN_BINS, SEQ_LEN, make_packer, make_stream
from tests.resume_harness import (
    LoaderRun, StageRun, assert_plain_json, check_resume, digest_chunks, digest_sequences,
    json_round_trip, loader_runs,
)

STEPS = 30


# -- the harness on every stage ---------------------------------------------------------------


def stream_outputs_until_epoch_edge(corpus, tokenizer, lane: int, per_output: int) -> int:
    stream = make_stream(corpus.text_path, tokenizer, lane)
    outputs = 0
    while stream.epoch == 0:
        stream.take(per_output)
        outputs += 1
    return outputs


@pytest.mark.parametrize("within_document", [False, True])
def test_lane_stream_resumes_mid_epoch_at_the_edge_and_at_the_end(corpus, tokenizer, within_document):
    lane, per_output, per_step = 2, 37, 3
    edge = stream_outputs_until_epoch_edge(corpus, tokenizer, lane, per_output) // per_step

    def make(_k):
        stream = make_stream(corpus.text_path, tokenizer, lane, max_epochs=2)
        return StageRun(stream, lambda s: s.take(per_output, within_document=within_document), per_step,
                        digest_chunks)

    report = check_resume(make, steps=1000, cut_points=[0, 4, edge, edge, edge + 1, 1000])
    assert 2 * edge <= len(report.baseline) < 1000, "the stream should end after its second epoch"


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_packer_resumes_mid_epoch_at_the_edge_and_at_the_end(corpus, tokenizer, packing):
    lane, per_step = 6, 2
    probe = make_packer(packing, make_stream(corpus.text_path, tokenizer, lane), tokenizer)
    outputs = 0
    while probe.stream.epoch == 0:
        probe.next_sequence()
        outputs += 1
    edge = outputs // per_step

    def make(_k):
        packer = make_packer(packing, make_stream(corpus.text_path, tokenizer, lane, max_epochs=2), tokenizer)
        return StageRun(packer, lambda p: p.next_sequence(), per_step, digest_sequences)

    # A step count beyond the data: the last segments see the end (flush of open bins, padding).
    total = len(check_resume(make, steps=500, cut_points=[]).baseline)
    assert edge < total < 500
    check_resume(make, steps=500, cut_points=[1, edge - 1, edge, edge, total - 1, total, 499])


def test_loader_resume_in_repeated_cycles(make_config, baseline, epoch_edges, packing):
    """Save and restore every three steps (each time fresh loaders), across several epoch edges."""
    config = make_config(packing)
    cuts = list(range(3, 24, 3)) + epoch_edges(packing)[:2]
    check_resume(loader_runs(config, [dict(world_size=1), dict(world_size=2)]), steps=24, cut_points=cuts,
                 expected=baseline(packing, STEPS)[:24])


def test_loader_resume_right_at_lane_epoch_edges(make_config, baseline, epoch_edges, packing):
    config = make_config(packing, pretokenized=True)
    edges = epoch_edges(packing)
    assert len(edges) >= 3
    for edge, world_size in zip(edges[:3], (8, 2, 4)):
        check_resume(loader_runs(config, [dict(world_size=1), dict(world_size=world_size, micro_batch_size=1)]),
                     steps=edge + 2, cut_points=[edge], expected=baseline(packing, STEPS)[: edge + 2])


@pytest.mark.timeout(90)
def test_loader_resume_near_the_end_of_the_data(make_config, packing):
    """max_epochs=1: the stream ends at a fixed step; resuming before it (also with workers) ends there too."""
    config = make_config(packing, datasets=[{"path": make_config().datasets[0].path, "max_epochs": 1}])
    run = LoaderRun(config)
    try:
        full = run.run(100)
        assert len(full) < 100 and run.run(1) == [], "the data should have ended"
    finally:
        run.close()
    end = len(full)
    check_resume(loader_runs(config, [dict(world_size=1), dict(world_size=1, num_workers=2), dict(world_size=1)]),
                 steps=end + 3, cut_points=[end - 3, end - 1], expected=full)


def test_all_ranks_agree_on_the_end_of_the_data(make_config, packing, world_size=2):
    """With finite data the W=1 stream ends after step T-1; every rank of any W must end there too.

    A rank that goes on delivering a step that another rank cannot complete leaves the
    trainers out of step (a hang in the next collective).
    """
    config = make_config(packing, datasets=[{"path": make_config().datasets[0].path, "max_epochs": 1}])
    single = LoaderRun(config)
    try:
        expected = single.run(100)
    finally:
        single.close()
    run = LoaderRun(config, world_size)
    try:
        got = run.run(100)  # LoaderRun asserts that all ranks stop at the same step
    finally:
        run.close()
    assert got == expected


# -- state content and size --------------------------------------------------------------------


def state_after(config, steps: int, world_size: int = 1) -> dict:
    run = LoaderRun(config, world_size)
    try:
        assert len(run.run(steps)) == steps
        return run.save()
    finally:
        run.close()


LATE = 200


class ReadCounter:
    """Counts Parquet row-group reads (any of pyarrow's row-group reading entry points)."""

    METHODS = ("read_row_group", "read_row_groups", "iter_batches", "read")

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in self.METHODS:
            original = getattr(pq.ParquetFile, name)

            def counted(pf, *args, _original=original, _name=name, **kwargs):
                groups = args[0] if args else kwargs.get("row_groups")
                self.count += len(groups) if _name in ("read_row_groups", "iter_batches") and groups else 1
                return _original(pf, *args, **kwargs)

            monkeypatch.setattr(pq.ParquetFile, name, counted)


@pytest.fixture(scope="module")
def saved_states(make_config):
    """``(packing) -> {step: state}`` at steps 5, 10 and LATE, and the row groups read to get to LATE."""
    cache = {}

    def get(packing):
        if packing not in cache:
            config = make_config(packing)
            with pytest.MonkeyPatch.context() as patch:
                counter = ReadCounter(patch)
                late = state_after(config, LATE)
            cache[packing] = ({5: state_after(config, 5), 10: state_after(config, 10), LATE: late}, counter.count)
        return cache[packing]

    return get


def test_states_are_plain_json_without_pickle(make_config, packing):
    config = make_config(packing)
    with ZephonLoader(config, rank=1, world_size=2) as loader:
        for _ in range(5):
            next(loader)  # mid-step: a rank-local state may be anywhere
        local = loader.state_dict()
        json_round_trip(local, "rank-local state")
        for _ in range(3):
            next(loader)
        stateful = LoaderStateful(loader).state_dict()
    assert all(isinstance(v, str) for v in stateful.values())
    for key, value in stateful.items():
        assert_plain_json(json.loads(value), key)
    merged = state_after(config, 2, world_size=2)
    json_round_trip(merged, "merged state")
    assert merged["format"] == "zephon.loader_state" and isinstance(merged["version"], int)


def per_lane_bound(packing: str) -> int:
    """Characters of one lane's JSON state: the cursor, plus for best_fit the open bins.

    A bin holds at most seq_len token ids (<= 5 digits + ", ") and as many document and
    piece starts; the cursor and keys are a few hundred characters.
    """
    cursor = 400
    if packing == "concat":
        return cursor
    return cursor + OPEN_BINS * (80 + 3 * SEQ_LEN * 7)


def test_state_size_is_bounded_and_does_not_grow_with_the_step(saved_states, packing):
    states, _ = saved_states(packing)
    early, late = states[5], states[LATE]
    header = len(json.dumps({k: v for k, v in early.items() if k != "lanes"}))
    bound = header + NUM_LANES * per_lane_bound(packing)
    sizes = {5: len(json.dumps(early)), LATE: len(json.dumps(late))}
    assert all(size <= bound for size in sizes.values()), f"state sizes {sizes} exceed the bound {bound}"
    if packing == "concat":  # only counters change: a few more digits per lane
        assert sizes[LATE] - sizes[5] <= NUM_LANES * 24, sizes
    for lane_state in late["lanes"].values():
        packer = lane_state["sources"]["synthetic"]["packer"]
        bins = packer.get("bins", [])
        assert len(bins) <= OPEN_BINS and all(len(b["tokens"]) <= SEQ_LEN for b in bins)
    assert late["lanes"]["00000"]["sources"]["synthetic"]["packer"]["stream"]["epoch"] >= 8  # really late


@pytest.mark.parametrize("read_ahead", [False, True])
def test_restore_seeks_instead_of_replaying(make_config, saved_states, packing, monkeypatch, read_ahead):
    config = make_config(packing, read_ahead=read_ahead)
    states, replay = saved_states(packing)
    counter = ReadCounter(monkeypatch)
    reads = {}
    for step in (10, LATE):
        counter.count = 0
        with ZephonLoader(config) as loader:
            loader.load_state_dict(states[step])
            for _ in range(GLOBAL_BATCH // MICRO_BATCH):  # one whole step
                next(loader)
        reads[step] = counter.count
    # Restore + one step reads the current row group of each lane (and maybe the next one);
    # read-ahead also reads the READ_AHEAD_BLOCKS after it: flat in the step all the same.
    bound = (2 + (READ_AHEAD_BLOCKS if read_ahead else 0)) * NUM_LANES
    assert reads[LATE] <= bound, f"restoring at step {LATE} read {reads[LATE]} row groups"
    assert reads[LATE] <= reads[10] + NUM_LANES, reads
    assert replay > 10 * reads[LATE], f"a replay from step 0 reads {replay} row groups: the counter is not counting"


# -- refused resumes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_tokenizer_path(tmp_path_factory, tokenizer_path) -> str:
    """The shipped tokenizer plus one added token: same EOS, another fingerprint."""
    tok = Tokenizer.from_file(tokenizer_path)
    tok.add_tokens(["zephonextratoken"])
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tok.save(path)
    return path


def test_resume_with_a_different_stream_setting_is_refused_naming_it(make_config, saved_states, other_datasets,
                                                                     other_tokenizer_path, packing):
    config = make_config(packing)
    state = saved_states(packing)[0][5]
    other_packing = "concat" if packing == "best_fit" else "best_fit"
    changes = {
        "seed": (dict(seed=config.seed + 1), ["seed: checkpoint 11, now 12"]),
        "seq_len": (dict(seq_len=32), ["seq_len: checkpoint 64, now 32"]),
        "packing": (dict(packing=other_packing), [f"packing: checkpoint '{packing}', now '{other_packing}'"]),
        "tokenizer": (dict(tokenizer=other_tokenizer_path), ["tokenizer: checkpoint fingerprint"]),
        "dataset": (dict(datasets=[{"path": other_datasets["other_content"]}]),
                    ["dataset 'synthetic': checkpoint fingerprint"]),
        "lanes": (dict(datasets=[{"path": other_datasets["four_lanes"]}], global_batch_size=16),
                  ["num_lanes (lane count L): checkpoint 8, now 4"]),
        "global_batch_size": (dict(global_batch_size=32), ["global_batch_size: checkpoint 16, now 32"]),
    }
    if packing == "best_fit":
        changes["best_fit_open_bins"] = (dict(best_fit_open_bins=OPEN_BINS + 1), ["best_fit_open_bins"])
    for name, (overrides, phrases) in changes.items():
        with ZephonLoader(config.replace(**overrides)) as loader:
            with pytest.raises(StateError) as info:
                loader.load_state_dict(state)
        message = str(info.value)
        for phrase in phrases:
            assert phrase in message, f"changing {name}: {phrase!r} not in the error:\n{message}"
        assert "cannot resume" in message
    # Topology, workers, micro-batch and prefetch are not part of the stream: allowed.
    with ZephonLoader(config.replace(micro_batch_size=4, prefetch=1), rank=1, world_size=4) as loader:
        loader.load_state_dict(state)


def rank_states(config, world_size: int, micro_batches: list[int]) -> list[dict]:
    states = []
    for rank, count in enumerate(micro_batches):
        with ZephonLoader(config, rank=rank, world_size=world_size) as loader:
            for _ in range(count):
                next(loader)
            states.append(loader.state_dict())
    return states


def test_merge_rank_states_refuses_mismatched_and_mid_step_states(make_config, packing):
    config = make_config(packing)  # W=2: 8 sequences per rank and step = 4 micro-batches
    good = rank_states(config, 2, [4, 4])
    merged = merge_rank_states(good)
    assert merged["next_global_index"] == GLOBAL_BATCH and "rank" not in merged

    cases = {
        "mid-step": (rank_states(config, 2, [2, 2]), "mid-step"),
        "different steps": ([good[0], rank_states(config, 2, [0, 8])[1]], "different points of the stream"),
        "missing rank": ([good[0]], "need one state per rank 0..1"),
        "duplicate rank": ([good[0], good[0]], "need one state per rank 0..1"),
        "other seed": ([good[0], rank_states(config.replace(seed=99), 2, [0, 4])[1]], "seed: checkpoint"),
        "a merged state": ([merged, good[1]], "rank-local states"),
        "nothing": ([], "at least one state"),
    }
    for name, (states, phrase) in cases.items():
        with pytest.raises(StateError) as info:
            merge_rank_states(states)
        assert phrase in str(info.value), f"{name}: {phrase!r} not in {info.value}"


def test_load_state_dict_refuses_states_it_cannot_continue(make_config, saved_states, packing):
    config = make_config(packing)
    local = rank_states(config, 2, [3, 3])
    with ZephonLoader(config, rank=1, world_size=2) as loader:  # another rank's own state
        with pytest.raises(StateError, match="rank 0 of 2's own state"):
            loader.load_state_dict(local[0])
    merged = saved_states(packing)[0][10]
    not_a_step = dict(merged, next_global_index=merged["next_global_index"] + 3)
    with ZephonLoader(config) as loader, pytest.raises(StateError, match="not at a step boundary"):
        loader.load_state_dict(not_a_step)
    lanes = json.loads(json.dumps(merged["lanes"]))
    lanes["00005"]["outputs"] += 1
    with ZephonLoader(config) as loader, pytest.raises(StateError, match="lane 5 state has produced"):
        loader.load_state_dict(dict(merged, lanes=lanes))
    with ZephonLoader(config) as loader, pytest.raises(StateError, match="not a Zephon loader state"):
        loader.load_state_dict({"lanes": {}})
    with ZephonLoader(config, rank=0, world_size=2) as loader:
        for _ in range(3):
            next(loader)
        with pytest.raises(StateError, match="mid-step"):
            LoaderStateful(loader).state_dict()


def test_rank_local_state_resumes_mid_step_on_the_same_rank(make_config, packing):
    """A rank's own state may be mid-step; the same rank continues with the very next micro-batch."""
    config = make_config(packing)
    with ZephonLoader(config, rank=1, world_size=2) as loader:
        expected = [next(loader)["input_ids"] for _ in range(9)]
    with ZephonLoader(config, rank=1, world_size=2) as loader:
        got = [next(loader)["input_ids"] for _ in range(3)]
        state = json.loads(json.dumps(loader.state_dict()))
    with ZephonLoader(config.replace(num_workers=0, prefetch=1), rank=1, world_size=2) as loader:
        loader.load_state_dict(state)
        got += [next(loader)["input_ids"] for _ in range(6)]
    assert all((a == b).all() for a, b in zip(expected, got))


def test_loading_an_earlier_state_into_a_running_loader_rewinds_it(make_config, baseline, packing):
    config = make_config(packing)
    run = LoaderRun(config, world_size=2)
    try:
        run.run(2)
        state = run.save()
        run.run(3)
        run.load(state)  # the loaders are mid-iteration: load_state_dict must reset them
        again = run.run(3)
    finally:
        run.close()
    assert again == baseline(packing, 5)[2:5]


def test_loader_stateful_reshards_by_lane_across_world_sizes(make_config, baseline, packing):
    """What DCP does, in one process: the union of W=4 ranks' entries loaded by W=2 ranks."""
    config = make_config(packing)
    saver = LoaderRun(config, world_size=4)
    try:
        first = saver.run(5)
        union: dict[str, str] = {}
        for loader in saver.loaders:
            entries = LoaderStateful(loader).state_dict()
            for key, value in entries.items():
                assert union.get(key, value) == value, f"{key} differs between ranks"
            union.update(entries)
    finally:
        saver.close()
    assert sorted(k for k in union if k.startswith("lane_")) == [f"lane_{l:05d}" for l in range(NUM_LANES)]
    run = LoaderRun(config.replace(micro_batch_size=8), world_size=2)
    try:
        for loader in run.loaders:
            LoaderStateful(loader).load_state_dict({k: union[k] for k in LoaderStateful(loader).state_dict()})
        rest = run.run(5)
    finally:
        run.close()
    assert first + rest == baseline(packing, 10)
