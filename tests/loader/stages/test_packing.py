"""Packing correctness, checked against documents computed without the loader.

The expected documents of a lane come from the stable hashes (lane, order key) and the
tokenizer directly (``settings.expected_lane_documents``): ``ids + [EOS]`` in lane order.

* concat: a lane's sequences, concatenated, are its documents in order, then the next epoch;
  a drained single epoch holds every token exactly once.
* best_fit: a segment is a whole document when the document fits in ``seq_len``; longer
  documents become ``seq_len`` pieces (each a sequence of its own) plus a last piece placed
  like a document; a drained epoch holds every piece exactly once.
* both: ``labels`` are -100 on padding and on each document's first token and equal
  ``input_ids`` elsewhere; ``position_ids`` restart at every segment start;
  ``cu_seqlens`` are the flattened segment starts.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from loader.stages.packing import IGNORE_INDEX, ConcatRow
from loader.pipeline import ZephonLoader
from tests.loader.settings import (
    GLOBAL_BATCH, NUM_LANES, SEQ_LEN, eos_id_of, expected_lane_documents, make_packer, make_stream,
)

STEPS = 30


@pytest.fixture(scope="module")
def lane_docs(corpus, tokenizer) -> dict[int, list[tuple[int, ...]]]:
    docs = expected_lane_documents(corpus.texts, corpus.keys, tokenizer, num_lanes=NUM_LANES, seed=corpus.seed)
    eos = eos_id_of(tokenizer)
    # Preconditions of the checks below: EOS marks document ends unambiguously, every lane
    # has documents, and some documents are longer than seq_len.
    assert all(eos not in doc[:-1] for lane in docs.values() for doc in lane)
    assert all(len(lane) >= 5 for lane in docs.values())
    assert sum(len(doc) > SEQ_LEN for lane in docs.values() for doc in lane) >= 10
    assert sum(len(doc) > 2 * SEQ_LEN for lane in docs.values() for doc in lane) >= 3
    return docs


def expected_pieces(doc: tuple[int, ...], seq_len: int = SEQ_LEN) -> list[tuple[int, ...]]:
    """best_fit: a document that fits stays whole; a longer one is cut every seq_len tokens."""
    return [doc[k:k + seq_len] for k in range(0, len(doc), seq_len)]


def check_batch_layout(batch: dict, seq_len: int = SEQ_LEN) -> None:
    """position_ids count up from 0 and restart only at segment starts; cu_seqlens match them."""
    ids = batch["input_ids"].numpy()
    labels = batch["labels"].numpy()
    positions = batch["position_ids"].numpy()
    rows = ids.shape[0]
    assert ids.shape == labels.shape == positions.shape == (rows, seq_len)
    for row in positions:
        assert row[0] == 0
        assert np.all((row[1:] == 0) | (row[1:] == row[:-1] + 1)), f"position_ids do not restart cleanly: {row}"
    cu = batch["cu_seqlens"].numpy()
    starts = np.flatnonzero(positions.reshape(-1) == 0)
    assert cu.tolist() == starts.tolist() + [rows * seq_len], "cu_seqlens disagree with position_ids"
    assert batch["cu_seqlens"].dtype.is_floating_point is False and str(batch["cu_seqlens"].dtype) == "torch.int32"


def segments_of(positions: np.ndarray) -> list[tuple[int, int]]:
    starts = np.flatnonzero(positions == 0).tolist()
    return list(zip(starts, starts[1:] + [len(positions)]))


def loader_rows(config, steps: int) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``global index -> (input_ids, labels, position_ids)`` of a W=1 run, layout-checked per micro-batch."""
    rows = {}
    with ZephonLoader(config) as loader:
        for _ in range(steps * GLOBAL_BATCH // config.micro_batch_size):
            batch = next(loader)
            check_batch_layout(batch, config.seq_len)
            for index, ids, labels, pos in zip(batch["global_indices"].tolist(), batch["input_ids"].numpy(),
                                               batch["labels"].numpy(), batch["position_ids"].numpy()):
                rows[index] = (ids, labels, pos)
    return rows


@pytest.mark.parametrize("pretokenized", [False, True])
def test_concat_lane_streams_are_the_documents_in_lane_order(make_config, lane_docs, tokenizer, pretokenized,
                                                             monkeypatch):
    eos = eos_id_of(tokenizer)
    # The batch builder has two paths per row (rows cut in bulk, which carry only their
    # document starts, and rows across a block boundary): the run must mix them in a batch.
    kinds_per_batch = []
    collate = ZephonLoader._collate

    def spy(self, items):
        kinds_per_batch.append({type(item.sequence) is ConcatRow for item in items})
        return collate(self, items)

    monkeypatch.setattr(ZephonLoader, "_collate", spy)
    rows = loader_rows(make_config("concat", pretokenized=pretokenized), STEPS)
    assert {True, False} in kinds_per_batch
    for lane in range(NUM_LANES):
        seqs = [rows[i] for i in sorted(rows) if i % NUM_LANES == lane]
        stream = np.concatenate([ids for ids, _, _ in seqs])
        epoch0 = np.array([t for doc in lane_docs[lane] for t in doc])
        assert len(stream) > len(epoch0), f"lane {lane}: the run did not finish epoch 0"
        np.testing.assert_array_equal(stream[: len(epoch0)], epoch0, err_msg=f"lane {lane}: epoch 0 stream")
        # Every document of the stream (epoch 0 and beyond) starts right after an EOS.
        doc_start = np.zeros(len(stream), dtype=bool)
        doc_start[0] = True
        doc_start[np.flatnonzero(stream[:-1] == eos) + 1] = True
        for k, (ids, labels, positions) in enumerate(seqs):
            here = doc_start[k * SEQ_LEN:(k + 1) * SEQ_LEN]
            want_labels = np.where(here, IGNORE_INDEX, ids)
            np.testing.assert_array_equal(labels, want_labels, err_msg=f"lane {lane} output {k}: labels")
            starts = np.flatnonzero(here).tolist()
            if 0 not in starts:
                starts = [0] + starts  # a sequence that begins mid-document still restarts positions
            want_positions = np.arange(SEQ_LEN) - np.repeat(starts, np.diff(starts + [SEQ_LEN]))
            np.testing.assert_array_equal(positions, want_positions, err_msg=f"lane {lane} output {k}: positions")


def test_best_fit_never_splits_a_document_that_fits(make_config, lane_docs, tokenizer):
    pad = eos_id_of(tokenizer)
    rows = loader_rows(make_config("best_fit"), STEPS)
    seen_multi_doc = seen_padding = seen_long_piece = 0
    for index, (ids, labels, positions) in sorted(rows.items()):
        lane = index % NUM_LANES
        firsts = {p: k == 0 for doc in lane_docs[lane] for k, p in enumerate(expected_pieces(doc))}
        segments = segments_of(positions)
        lo, hi = segments[-1]
        if np.all(labels[lo:hi] == IGNORE_INDEX):  # the padding tail
            assert np.all(ids[lo:hi] == pad), f"index {index}: padding is not pad_id"
            segments = segments[:-1]
            seen_padding += 1
        assert segments, f"index {index}: a sequence of padding only"
        seen_multi_doc += len(segments) > 1
        for lo, hi in segments:
            piece = tuple(ids[lo:hi].tolist())
            assert piece in firsts, (
                f"index {index}: segment {lo}:{hi} is not a whole document or a seq_len piece of a long one"
            )
            if hi - lo == SEQ_LEN:
                seen_long_piece += 1
            want = list(piece)
            if firsts[piece]:
                want[0] = IGNORE_INDEX
            assert labels[lo:hi].tolist() == want, f"index {index}: labels of segment {lo}:{hi}"
    assert seen_multi_doc and seen_padding and seen_long_piece  # the run exercised every case


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_one_drained_epoch_holds_every_token_exactly_once(corpus, tokenizer, lane_docs, packing):
    """Straight on the packers, one epoch (max_epochs=1), every lane, drained to the end."""
    pad = eos_id_of(tokenizer)
    for lane in range(NUM_LANES):
        packer = make_packer(packing, make_stream(corpus.text_path, tokenizer, lane, max_epochs=1), tokenizer)
        sequences = []
        while (seq := packer.next_sequence()) is not None:
            assert len(seq.input_ids) == len(seq.labels) == SEQ_LEN
            sequences.append(seq)
        docs = lane_docs[lane]
        if packing == "concat":
            tokens = np.concatenate([s.input_ids for s in sequences])
            epoch = np.array([t for doc in docs for t in doc])
            used = len(epoch) - (len(sequences) - 1) * SEQ_LEN
            assert 0 < used <= SEQ_LEN, f"lane {lane}: {len(sequences)} sequences for {len(epoch)} tokens"
            np.testing.assert_array_equal(tokens[: len(epoch)], epoch)
            last = sequences[-1]
            assert np.all(last.input_ids[used:] == pad) and np.all(last.labels[used:] == IGNORE_INDEX)
            if used < SEQ_LEN:
                assert used in last.segment_starts.tolist(), "the padding tail starts its own segment"
        else:
            got = Counter()
            for seq in sequences:
                starts = seq.segment_starts.tolist() + [SEQ_LEN]
                for lo, hi in zip(starts[:-1], starts[1:]):
                    if np.all(seq.labels[lo:hi] == IGNORE_INDEX) and hi == SEQ_LEN and lo > 0:
                        continue  # padding tail
                    got[tuple(seq.input_ids[lo:hi].tolist())] += 1
            want = Counter(p for doc in docs for p in expected_pieces(doc))
            assert got == want, f"lane {lane}: pieces delivered != pieces of the lane's documents (exactly once)"
        assert packer.next_sequence() is None  # stays ended


def test_best_fit_places_a_piece_in_the_tightest_open_bin(tokenizer):
    """The documented placement rule, on a hand-made stream (seq_len 10, 2 open bins)."""
    from loader.io.blocks import Chunk
    from loader.stages.packing import BestFitPacker

    class FakeStream:
        feature_names: tuple = ()  # the stream protocol's: no features, origins not tracked
        last_origin = None

        def __init__(self, docs):
            self.docs = [np.array(d, dtype=np.int32) for d in docs]

        def take(self, n, within_document=False):
            assert within_document
            if not self.docs:
                return None
            doc = self.docs[0]
            piece, rest = doc[:n], doc[n:]
            first = not getattr(self, "continuing", False)
            self.continuing = len(rest) > 0
            if len(rest):
                self.docs[0] = rest
            else:
                self.docs.pop(0)
            return Chunk(tokens=piece, doc_starts=np.array([0] if first else [], dtype=np.int64))

    # 6 -> new bin A; 5 -> new bin B (A has only 4 left); 3 -> A (tightest fit: 4 left vs 5);
    # 4 -> B; 7 fits nowhere and both bins are open: emit the fullest (A and B tie at 9: the
    # older, A) and open C; 12 -> a full 10-token piece is a sequence on its own, its last 2
    # tokens go to C (B has 1 left). At the end the fullest open bins are flushed, oldest first.
    docs = [[1] * 6, [2] * 5, [3] * 3, [4] * 4, [5] * 7, [6] * 12]
    packer = BestFitPacker(FakeStream(docs), seq_len=10, pad_id=0, open_bins=2)
    out = []
    while (seq := packer.next_sequence()) is not None:
        out.append((seq.input_ids.tolist(), seq.labels.tolist(), seq.segment_starts.tolist()))
    I = IGNORE_INDEX
    assert out == [
        ([1] * 6 + [3] * 3 + [0], [I] + [1] * 5 + [I] + [3] * 2 + [I], [0, 6, 9]),
        ([6] * 10, [I] + [6] * 9, [0]),
        ([2] * 5 + [4] * 4 + [0], [I] + [2] * 4 + [I] + [4] * 3 + [I], [0, 5, 9]),
        ([5] * 7 + [6] * 2 + [0], [I] + [5] * 6 + [6, 6] + [I], [0, 7, 9]),
    ]
