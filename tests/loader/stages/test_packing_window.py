"""``packing_window``: best-fit-decreasing per window, exact across topologies, resumes and seeks.

The stream is compared by real batch fingerprints (ranks simulated by rank/world args, real
worker processes); the pure window packing by Hypothesis properties; the audit's window seek
against the audit from a saved state of the same step.
"""

from __future__ import annotations

import hashlib
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


@pytest.fixture()
def window_cache(tmp_path, monkeypatch):
    """An empty window-count cache, and this test's own seal key (a user of its own)."""
    monkeypatch.setenv("ZEPHON_WINDOW_CACHE", str(tmp_path / "windows"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "windows"


@pytest.mark.parametrize("pretokenized", [True, False], ids=["pretokenized", "text"])
def test_window_seek_equals_the_audit_from_a_saved_state(windowed, window_cache, pretokenized):
    """No state given: the window counts (for text lanes, of lengths the tokenizer gives) are
    counted once, cached, and place every lane as the run's own checkpoint does."""
    config = windowed(pretokenized)
    step = 17
    state = merge_rank_states([_state_after(config, 9)])
    seeked = audit_step(config, step)
    assert seeked.method == "window"
    assert any("counted the windows" in note for note in seeked.notes)
    assert any("tokenized for their lengths" in note for note in seeked.notes) == (not pretokenized)
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


def test_text_window_counts_are_bound_to_the_tokenizer(windowed, window_cache, tmp_path):
    """Another tokenizer gives a text lane other lengths: its counts live in another file."""
    from tokenizers import Tokenizer

    config = windowed(pretokenized=False)
    audit_step(config, 5, sequence=0)
    first = set(window_cache.glob("*.json"))
    other = Tokenizer.from_file(config.tokenizer)
    other.add_tokens(["zephonword"])  # a different tokenizer fingerprint
    other.save(str(tmp_path / "other.json"))
    audit_step(config.replace(tokenizer=str(tmp_path / "other.json")), 5, sequence=0)
    second = set(window_cache.glob("*.json")) - first
    assert len(first) == len(second) == 1
    bound = [json.loads(path.read_text())["binding"]["tokenizer"] for path in (*first, *second)]
    assert bound[0] != bound[1]


def _cached_files(config, window_cache, step: int = 11):
    first = audit_step(config, step, sequence=0)  # one lane: one cache file
    files = sorted(window_cache.glob("*.json"))
    assert len(files) == 1
    return first, files[0]


def _reseal(data: dict) -> dict:
    """What someone holding this user's key could write: a file sealed again after an edit."""
    from loader.commands.window_index import _seal

    return dict(data, hmac_sha256=_seal(data["binding"], data["windows"], data["next"]))


@pytest.mark.parametrize("pretokenized", [True, False], ids=["pretokenized", "text"])
def test_an_edited_or_foreign_cache_file_is_rebuilt_not_used(windowed, window_cache, caplog, pretokenized):
    config = windowed(pretokenized)
    first, path = _cached_files(config, window_cache)
    original = json.loads(path.read_text())

    def plain(data):  # re-digested the way version 1 sealed its files: not a seal
        return dict(data, hmac_sha256=hashlib.sha256(json.dumps([data["windows"], data["next"]]).encode()).hexdigest())

    more = dict(original, windows=[entry[:3] + [entry[3] + 1] for entry in original["windows"]])
    foreign = _reseal(dict(original, binding=dict(original["binding"], lane=original["binding"]["lane"] + 1)))
    cases = {"edited": (json.dumps(more), "is not sealed by this user's key"),
             "re-digested": (json.dumps(plain(more)), "is not sealed by this user's key"),
             "of another lane": (json.dumps(foreign), "was made for another lane than this lane's"),
             "of version 1": (json.dumps(dict(original, version=1)), "is of window index version 1, not 2"),
             "truncated": (json.dumps(original)[:-40], "cannot be read as JSON")}
    for name, (text, message) in cases.items():
        path.write_text(text)
        caplog.clear()
        with caplog.at_level("WARNING"):
            again = audit_step(config, 11, sequence=0)
        assert message in caplog.text, name
        assert any(message in note for note in again.notes), name  # the report says why, too
        assert any("counted the windows" in note for note in again.notes), name
        assert _pieces(again) == _pieces(first), name
        assert json.loads(path.read_text())["windows"] == original["windows"], name  # rewritten as counted


def test_a_sealed_cache_file_that_disagrees_with_the_lane_files_is_refused(windowed, window_cache):
    """Sealed with the key but wrong (lane files changed under one fingerprint, or written by
    someone with the key): the window a seek lands in is counted again, and the mismatch refused."""
    from loader.errors import WindowCountError

    config = windowed()
    _, path = _cached_files(config, window_cache)
    data = json.loads(path.read_text())
    data["windows"] = [entry[:3] + [entry[3] + k] for k, entry in enumerate(data["windows"])]
    path.write_text(json.dumps(_reseal(data)))
    with pytest.raises(WindowCountError, match=rf"window count file {path}: window \d+ of lane 0 .* delete the file"):
        audit_step(config, 11, sequence=0)


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
