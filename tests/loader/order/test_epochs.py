"""Epochs: a lane that runs out replays the same documents in another, deterministic order.

Epoch 0 is the lane in order-key order; epoch ``e > 0`` is a permutation of files, row
groups and rows seeded by ``(seed, source, lane, e)``: the same for every process and run,
different for every epoch and for another loader seed.
"""

from __future__ import annotations

import numpy as np
import pytest

from loader.pipeline import ZephonLoader
from tests.loader.settings import (
    GLOBAL_BATCH, LOADER_SEED, NUM_LANES, eos_id_of, expected_lane_documents, make_stream,
)

EPOCHS = 3


@pytest.fixture(scope="module")
def lane_docs(corpus, tokenizer):
    return expected_lane_documents(corpus.texts, corpus.keys, tokenizer, num_lanes=NUM_LANES, seed=corpus.seed)


def epochs_of_stream(stream) -> list[list[tuple[int, ...]]]:
    """Drain a stream (max_epochs set) into documents per epoch, using its own document starts."""
    tokens, starts = [], []
    taken = 0
    while (chunk := stream.take(50)) is not None:
        tokens.append(chunk.tokens)
        starts.append(chunk.doc_starts + taken)
        taken += len(chunk.tokens)
    flat = np.concatenate(tokens)
    bounds = np.concatenate(starts).tolist() + [len(flat)]
    docs = [tuple(flat[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])]
    return docs


def split_epochs(docs, per_epoch: int) -> list[list[tuple[int, ...]]]:
    assert len(docs) % per_epoch == 0
    return [docs[k:k + per_epoch] for k in range(0, len(docs), per_epoch)]


@pytest.mark.parametrize("pretokenized", [False, True])
def test_each_epoch_is_a_new_permutation_of_the_same_documents(corpus, tokenizer, lane_docs, pretokenized):
    path = corpus.pretokenized_path if pretokenized else corpus.text_path
    for lane in range(NUM_LANES):
        stream = make_stream(path, tokenizer, lane, max_epochs=EPOCHS)
        epochs = split_epochs(epochs_of_stream(stream), len(lane_docs[lane]))
        assert len(epochs) == EPOCHS
        assert epochs[0] == lane_docs[lane], f"lane {lane}: epoch 0 is not the lane in order-key order"
        for e in range(1, EPOCHS):
            assert sorted(epochs[e]) == sorted(lane_docs[lane]), f"lane {lane} epoch {e}: not the same documents"
            assert epochs[e] != epochs[e - 1], f"lane {lane}: epoch {e} replays epoch {e - 1}'s order"
        assert stream.exhausted and stream.take(10) is None


def test_epoch_order_is_deterministic_and_seeded(corpus, tokenizer, lane_docs):
    lane = 5
    first = epochs_of_stream(make_stream(corpus.text_path, tokenizer, lane, max_epochs=EPOCHS))
    again = epochs_of_stream(make_stream(corpus.pretokenized_path, tokenizer, lane, max_epochs=EPOCHS))
    assert first == again
    other_seed = epochs_of_stream(make_stream(corpus.text_path, tokenizer, lane, max_epochs=EPOCHS,
                                              seed=LOADER_SEED + 1))
    n = len(lane_docs[lane])
    assert other_seed[:n] == first[:n], "the loader seed must not change epoch 0 (the Beam job's order)"
    assert other_seed[n:] != first[n:], "another loader seed must give other epoch permutations"


def test_documents_are_shuffled_across_row_groups_and_files(corpus, tokenizer, lane_docs):
    """Not only rows inside a row group: some document changes its row group between epochs."""
    moved = 0
    for lane in range(NUM_LANES):
        epochs = split_epochs(epochs_of_stream(make_stream(corpus.text_path, tokenizer, lane, max_epochs=2)),
                              len(lane_docs[lane]))
        group_of = {doc: k // 4 for k, doc in enumerate(epochs[0])}  # row groups of 4 rows (conftest)
        for k, doc in enumerate(epochs[1]):
            moved += group_of[doc] != k // 4
    assert moved > 0


def test_loader_lanes_continue_into_the_next_epoch_seamlessly(make_config, tokenizer, lane_docs):
    """Through the loader (W=1): each lane's stream is epoch 0, then a permutation of it, back to back."""
    eos = eos_id_of(tokenizer)
    config = make_config("concat")
    longest = max(sum(len(d) for d in docs) for docs in lane_docs.values())
    steps = 2 * longest // (config.seq_len * GLOBAL_BATCH // NUM_LANES) + 2
    streams: dict[int, list] = {lane: [] for lane in range(NUM_LANES)}
    with ZephonLoader(config) as loader:
        for _ in range(steps * GLOBAL_BATCH // config.micro_batch_size):
            batch = next(loader)
            for index, ids in zip(batch["global_indices"].tolist(), batch["input_ids"].numpy()):
                streams[index % NUM_LANES].append(ids)
    for lane, pieces in streams.items():
        flat = np.concatenate(pieces)
        ends = np.flatnonzero(flat == eos) + 1
        docs = [tuple(flat[a:b].tolist()) for a, b in zip(np.concatenate([[0], ends[:-1]]), ends)]
        n = len(lane_docs[lane])
        assert len(docs) >= 2 * n, f"lane {lane}: the run did not finish epoch 1"
        assert docs[:n] == lane_docs[lane]
        assert sorted(docs[n:2 * n]) == sorted(lane_docs[lane]) and docs[n:2 * n] != docs[:n]
