"""One best-fit rule (``loader.order.best_fit``) for the packer and the audit's replay.

* the rule against a plain restatement of it (bins as objects, ``min`` over a key: the code the
  packer ran before the rule had one home), on random sizes under Hypothesis;
* the packer on lane files of random document lengths, pieces cut in bulk per block and one by
  one, against the rule on the pieces' lengths alone (what the audit replays) and each other:
  same sequences, same state after every sequence.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from loader.checkpoint.state import to_jsonable
from loader.order.best_fit import OpenBins, best_fit_bins
from loader.stages.packing import BestFitPacker
from tests.dataset_factory import write_dataset
from tests.loader.settings import eos_id_of, make_stream


def _reference(sizes, images, seq_len, max_open, max_images):
    """The rule restated: emitted bins as piece indices, in order, then the flushed ones."""
    bins, serial, out = [], 0, []
    key = lambda b: (seq_len - b["used"], b["serial"])  # noqa: E731 - the fullest, oldest on ties
    for k, (size, held) in enumerate(zip(sizes, images)):
        if size == seq_len:
            out.append([k])
            continue
        fitting = [b for b in bins if seq_len - b["used"] >= size]
        if max_images is not None and held:
            fitting = [b for b in fitting if b["images"] + held <= max_images]
        if fitting:
            target = min(fitting, key=key)
            target["pieces"].append(k)
            target["used"] += size
            target["images"] += held
            if target["used"] == seq_len:
                bins.remove(target)
                out.append(target["pieces"])
            continue
        evicted = min(bins, key=key) if len(bins) >= max_open else None
        bins.append({"pieces": [k], "used": size, "serial": serial, "images": held})
        serial += 1
        if evicted is not None:
            bins.remove(evicted)
            out.append(evicted["pieces"])
    while bins:
        fullest = min(bins, key=key)
        bins.remove(fullest)
        out.append(fullest["pieces"])
    return out


@settings(max_examples=300, deadline=None)
@given(seq_len=st.integers(1, 40), max_open=st.integers(1, 6), data=st.data(),
       max_images=st.one_of(st.none(), st.integers(0, 3)))
def test_the_rule_is_the_documented_rule(seq_len, max_open, data, max_images):
    sizes = data.draw(st.lists(st.integers(1, seq_len), max_size=60))
    images = data.draw(st.lists(st.integers(0, 2), min_size=len(sizes), max_size=len(sizes)))
    bins, out = OpenBins(seq_len, max_open, max_images), []
    for k, (size, held) in enumerate(zip(sizes, images)):
        emitted = bins.place(size, k, held)
        if emitted is not None:
            out.append(emitted)
        assert len(bins) <= max_open
        assert all(0 < used < seq_len for _, used, _ in bins.bins())
    while (emitted := bins.flush()) is not None:
        out.append(emitted)
    assert out == _reference(sizes, images, seq_len, max_open, max_images)
    if max_images is None:
        assert out == best_fit_bins(sizes, seq_len, max_open)


def _random_lane_files(tmp_path, tokenizer, seed: int) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    # Mostly short documents, some longer than a sequence (cut into pieces), small row groups
    # (many block boundaries, documents ending at a block's end).
    texts = [" ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 5, 9, 20, 40, 90])))
             for _ in range(300)]
    path = str(tmp_path / f"random-{seed}")
    write_dataset(path, texts, num_lanes=2, seed=seed, tokenizer=tokenizer, row_group_rows=rng.choice([3, 7, 16]))
    return path


def _run(packer, max_sequences: int = 10_000):
    """(sequence arrays, JSON state after each) until the packer ends."""
    out = []
    while len(out) < max_sequences and (sequence := packer.next_sequence()) is not None:
        state = json.dumps(to_jsonable(packer.get_state()), sort_keys=True)
        out.append(((sequence.input_ids.tolist(), sequence.labels.tolist(), sequence.segment_starts.tolist(),
                     sequence.padding), state))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_packer_makes_the_rules_bins_in_bulk_and_piece_by_piece(tmp_path, tokenizer, seed):
    dataset = _random_lane_files(tmp_path, tokenizer, seed)
    seq_len, open_bins, pad = 48, 3, eos_id_of(tokenizer)
    for lane in range(2):
        bulk = BestFitPacker(make_stream(dataset, tokenizer, lane, max_epochs=2), seq_len, pad, open_bins)
        assert bulk._bulk
        slow = BestFitPacker(make_stream(dataset, tokenizer, lane, max_epochs=2), seq_len, pad, open_bins)
        slow._bulk = False
        fast_out, slow_out = _run(bulk), _run(slow)
        assert fast_out == slow_out, f"lane {lane}: bulk pieces made other sequences or states"
        # The pieces' lengths, in stream order, packed by the rule alone: the same bins.
        pieces = []
        stream = make_stream(dataset, tokenizer, lane, max_epochs=2)
        while (chunk := stream.take(seq_len, within_document=True)) is not None:
            pieces.append(len(chunk.tokens))
        expected = [[pieces[k] for k in members] for members in best_fit_bins(pieces, seq_len, open_bins)]
        got = [np.diff(starts + ([] if padding else [seq_len])).tolist() for (_, _, starts, padding), _ in fast_out]
        assert got == expected and len(got) > 20
        assert any(padding for (_, _, _, padding), _ in fast_out)


def test_a_restored_packer_continues_as_the_uninterrupted_one(tmp_path, tokenizer):
    dataset = _random_lane_files(tmp_path, tokenizer, 4)
    seq_len, open_bins, pad = 48, 3, eos_id_of(tokenizer)
    whole = _run(BestFitPacker(make_stream(dataset, tokenizer, 0, max_epochs=2), seq_len, pad, open_bins))
    for cut in (1, 7, 30):
        first = BestFitPacker(make_stream(dataset, tokenizer, 0, max_epochs=2), seq_len, pad, open_bins)
        _run(first, cut)
        resumed = BestFitPacker(make_stream(dataset, tokenizer, 0, max_epochs=2), seq_len, pad, open_bins)
        resumed.set_state(json.loads(json.dumps(to_jsonable(first.get_state()))))
        assert _run(resumed) == whole[cut:], cut
