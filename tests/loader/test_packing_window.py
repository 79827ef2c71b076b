"""``packing_window``: best-fit-decreasing per window, exact across topologies, resumes and seeks.

The stream is compared by real batch fingerprints (ranks simulated by rank/world args, real
worker processes); the pure window packing by Hypothesis properties; the audit's window seek
against the audit from a saved state of the same step.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from loader.checkpoint.state import StateError, merge_rank_states
from loader.commands.audit import audit_step
from loader.commands.fingerprints import collect_fingerprints
from loader.config import ConfigError, LoaderConfig
from loader.order.packing_windows import best_fit_decreasing, document_pieces, window_outputs
from loader.pipeline import ZephonLoader
from loader.stages.window_packing import WindowedBestFitPacker
from tests.resume_harness import StageRun, check_resume, digest_sequences, loader_runs

from tests.loader.settings import SEQ_LEN, eos_id_of, expected_lane_documents, make_stream

WINDOW = 6  # documents: windows end every few sequences of the suite's corpus (~2.6 documents a sequence)


# -- the pure packing ------------------------------------------------------------------------
lengths_strategy = st.lists(st.integers(min_value=1, max_value=300), min_size=0, max_size=60)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_strategy, seq_len=st.integers(min_value=1, max_value=128))
def test_bins_partition_the_pieces_and_fit(lengths, seq_len):
    sizes = document_pieces(lengths, seq_len)
    assert sum(sizes) == sum(lengths)
    bins = best_fit_decreasing(sizes, seq_len)
    assert sorted(k for members in bins for k in members) == list(range(len(sizes)))
    assert all(sum(sizes[k] for k in members) <= seq_len for members in bins)
    assert [members[0] for members in bins] == sorted(members[0] for members in bins)  # emission order
    assert window_outputs(lengths, seq_len) == len(bins)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_strategy, seq_len=st.integers(min_value=1, max_value=128), data=st.data())
def test_bins_do_not_depend_on_arrival_order(lengths, seq_len, data):
    """The bins as multisets of lengths (and so their count) are a function of the window's lengths."""
    shuffled = data.draw(st.permutations(lengths))

    def shape(values):
        sizes = document_pieces(values, seq_len)
        return sorted(tuple(sorted(sizes[k] for k in members)) for members in best_fit_decreasing(sizes, seq_len))

    assert shape(lengths) == shape(shuffled)
    assert window_outputs(lengths, seq_len) == window_outputs(shuffled, seq_len)


def test_no_bin_is_left_fitting_a_later_piece():
    """Best fit decreasing: a piece opens a bin only when no open bin has room for it."""
    sizes = [60, 50, 40, 30, 20, 10, 5, 5, 3]
    bins = best_fit_decreasing(sizes, 64)
    rooms = [64 - sum(sizes[k] for k in members) for members in bins]
    assert sum(rooms) == 64 * len(bins) - sum(sizes)
    assert len(bins) == 4  # 60+3, 50+10, 40+20, 30+5+5


# -- configuration ---------------------------------------------------------------------------
def test_concat_with_a_window_is_refused_naming_the_field(make_config):
    with pytest.raises(ConfigError, match=r"packing_window = 8 needs packing = \"best_fit\""):
        make_config("concat", packing_window=8)
    with pytest.raises(ConfigError, match="packing_window"):
        make_config("best_fit", packing_window=0)


def test_fingerprints_are_new_only_when_set(make_config):
    plain = make_config("best_fit")
    assert "packing_window" not in plain.stream_fields() and "balance" not in plain.stream_fields()
    assert make_config("best_fit", packing_window=WINDOW).fingerprint() != plain.fingerprint()
    assert make_config("best_fit", packing_window=WINDOW).fingerprint() != \
        make_config("best_fit", packing_window=WINDOW + 1).fingerprint()


# -- the stream ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def windowed(make_config):
    def make(pretokenized=True, **overrides) -> LoaderConfig:
        return make_config("best_fit", pretokenized=pretokenized, packing_window=WINDOW, **overrides)

    return make


def _lines(config, world_size=1, steps=24):
    results, _ = collect_fingerprints(config, world_size=world_size, end_step=steps)
    return [r.line() for r in results]


@pytest.mark.parametrize("pretokenized", [True, False], ids=["pretokenized", "text"])
def test_stream_is_the_same_on_every_topology(windowed, make_config, pretokenized):
    config = windowed(pretokenized)
    reference = _lines(config)
    assert reference != _lines(make_config("best_fit", pretokenized=pretokenized))  # a different packing
    for world_size in (2, 4):
        assert _lines(config, world_size) == reference, f"W={world_size}"
    assert _lines(config.replace(num_workers=2), 2) == reference, "2 workers"


def test_packer_emits_each_windows_best_fit_decreasing_bins(corpus, tokenizer):
    """Lane 0's documents (computed from the hashes and the tokenizer, not by the loader) cut into
    windows of WINDOW, each packed by the pure function: the packer's rows, in order, to the end."""

    documents = expected_lane_documents(corpus.texts, corpus.keys, tokenizer, num_lanes=corpus.num_lanes,
                                        seed=corpus.seed)[0]
    pad = eos_id_of(tokenizer)
    packer = WindowedBestFitPacker(make_stream(corpus.pretokenized_path, tokenizer, 0, max_epochs=1), SEQ_LEN, pad,
                                   WINDOW)
    expected = []
    for first in range(0, len(documents), WINDOW):
        pieces = [doc[k:k + SEQ_LEN] for doc in documents[first:first + WINDOW] for k in range(0, len(doc), SEQ_LEN)]
        for members in best_fit_decreasing([len(p) for p in pieces], SEQ_LEN):
            row = [t for k in members for t in pieces[k]]
            expected.append(row + [pad] * (SEQ_LEN - len(row)))
    rows = []
    while (sequence := packer.next_sequence()) is not None:
        rows.append(sequence.input_ids.tolist())
    assert len(expected) > 2 * len(documents) // WINDOW  # several bins per window: a real test
    assert rows == expected


@pytest.mark.slow
def test_resumes_are_exact_across_topologies(windowed, epoch_edges):
    config = windowed()
    edge = epoch_edges("best_fit")[0]
    make = loader_runs(config, [{"world_size": 1}, {"world_size": 2}, {"world_size": 4, "num_workers": 2},
                                {"world_size": 1, "num_workers": 2}, {"world_size": 2, "micro_batch_size": 4}])
    report = check_resume(make, steps=30, cut_points=[0, 3, edge, edge, edge + 1, 29], expected=_lines(config, 1, 30))
    for text in report.states.values():
        for lane in json.loads(text)["lanes"].values():
            for source in lane["sources"].values():
                assert set(source["packer"]) == {"stream", "window"}  # cursors only: no bins, no tokens


def test_resume_text_lanes_mid_window(windowed):
    config = windowed(pretokenized=False)
    make = loader_runs(config, [{"world_size": 1}, {"world_size": 2}, {"world_size": 4}])
    check_resume(make, steps=12, cut_points=[1, 5, 5, 9], expected=_lines(config, 1, 12))


def _state_after(config, steps: int) -> dict:
    """The W=1 state after ``steps`` steps of a fresh loader."""
    loader = ZephonLoader(config, rank=0, world_size=1)
    try:
        for _ in range(loader.topology.micro_steps_per_step * steps):
            next(loader)
        return loader.state_dict()
    finally:
        loader.close()


def test_a_state_past_its_window_is_refused(windowed):
    config = windowed()
    state = _state_after(config, 3)
    (source,) = state["lanes"]["00000"]["sources"].values()
    source["packer"]["window"]["emitted"] = 10_000
    restored = ZephonLoader(config, rank=0, world_size=1)
    try:
        with pytest.raises(StateError, match=r"window\.emitted: window \d+ of this lane has \d+ outputs"):
            restored.load_state_dict(state)
            for _ in range(restored.topology.micro_steps_per_step):
                next(restored)
    finally:
        restored.close()
    source["packer"]["window"]["version"] = 99
    fresh = ZephonLoader(config, rank=0, world_size=1)
    try:
        with pytest.raises(StateError, match=r"window\.version: must be one of \[1\]"):
            fresh.load_state_dict(state)
    finally:
        fresh.close()


# -- the audit -------------------------------------------------------------------------------
def _pieces(report):
    return [[(p.key, p.position, p.length, p.start, p.end) for p in s.pieces] + [s.padding] for s in report.sequences]


def test_window_seek_equals_the_audit_from_a_saved_state(windowed, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_WINDOW_CACHE", str(tmp_path / "windows"))
    config = windowed()
    step = 17
    state = merge_rank_states([_state_after(config, 9)])
    seeked = audit_step(config, step)
    assert seeked.method == "window"
    assert any("counted the windows" in note for note in seeked.notes)
    from_state = audit_step(config, step, load_state=state)
    assert from_state.method == "checkpoint"
    assert _pieces(seeked) == _pieces(from_state)
    again = audit_step(config, step)  # a fresh index object: the counts come from the cache file
    assert any("every count was cached" in note for note in again.notes)
    assert _pieces(again) == _pieces(seeked)
    # and the audit's documents are the stream's: the step's token count per sequence
    loader = ZephonLoader(config, rank=0, world_size=1)
    try:
        rows = []
        for _ in range(loader.topology.micro_steps_per_step * (step + 1)):
            batch = next(loader)
            if batch["step"] == step:
                rows.extend((batch["labels"].numpy() != -100).sum(axis=1) + 0)
        used = [SEQ_LEN - s.padding for s in seeked.sequences]
        ids = [sum(p.length for p in s.pieces) for s in seeked.sequences]
        assert used == ids
        assert len(rows) == len(used)
    finally:
        loader.close()


def test_a_changed_cache_file_is_rebuilt_not_used(windowed, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "windows"
    monkeypatch.setenv("ZEPHON_WINDOW_CACHE", str(cache))
    config = windowed()
    first = audit_step(config, 11, sequence=0)  # one lane: one cache file
    files = sorted(cache.glob("*.json"))
    assert files
    for path in files:  # one more output in every window: a seek from these counts would be wrong
        data = json.loads(path.read_text())
        data["windows"] = [entry[:3] + [entry[3] + 1] for entry in data["windows"]]
        path.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        again = audit_step(config, 11, sequence=0)
    assert "does not match its key or checksum" in caplog.text
    assert any("counted the windows" in note for note in again.notes)
    assert _pieces(again) == _pieces(first)


@settings(max_examples=12, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=120), min_size=1, max_size=4))
def test_packer_resumes_at_any_output_to_the_end_of_the_data(corpus, tokenizer, cuts):
    """The windowed packer alone, through the shared harness: a text lane of two epochs cut at
    random outputs (mid-window, at window ends, repeated), saved as JSON and restored from its
    cursors, gives the uninterrupted outputs to the end of the data."""

    def make(_k):
        packer = WindowedBestFitPacker(make_stream(corpus.text_path, tokenizer, 5, max_epochs=2), SEQ_LEN,
                                       eos_id_of(tokenizer), WINDOW)
        return StageRun(packer, lambda p: p.next_sequence(), 1, digest_sequences)

    report = check_resume(make, steps=120, cut_points=cuts)
    assert 40 < len(report.baseline) < 120  # the data ends inside the run: its last window is flushed
