"""Constants and small helpers shared by the loader tests (conftest.py builds the fixtures)."""

from __future__ import annotations

import os

PACKINGS = ("concat", "best_fit")
NUM_LANES = 8
DATA_SEED = 3  # the Beam job's seed: lanes and order keys
LOADER_SEED = 11  # the loader's seed: epoch permutations, mixing
SEQ_LEN = 64
GLOBAL_BATCH = 16
MICRO_BATCH = 2
OPEN_BINS = 4
NUM_DOCS = 160


def pids_alive(pids) -> list[int]:
    """The pids that still exist (a zombie still exists; a reaped child does not)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def eos_id_of(tokenizer) -> int:
    from loader.stages.tokenizer import EOS_CANDIDATES, resolve_special_token

    return resolve_special_token(tokenizer, None, EOS_CANDIDATES, "eos_token")


def expected_lane_documents(texts, keys, tokenizer, *, num_lanes: int, seed: int) -> dict[int, list[tuple[int, ...]]]:
    """Each lane's documents as ``ids + [EOS]`` in epoch-0 order, computed without the loader.

    Lane and order come straight from the stable hashes (``H(seed, key) mod L``, order key),
    token ids straight from the tokenizer.
    """
    from loader.order.hashing import lane_of_key, order_key_of

    eos = eos_id_of(tokenizer)
    encoded = [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    by_lane: dict[int, list] = {lane: [] for lane in range(num_lanes)}
    for key, ids in zip(keys, encoded):
        by_lane[lane_of_key(seed, key, num_lanes)].append((order_key_of(seed, key), tuple(ids) + (eos,)))
    return {lane: [doc for _, doc in sorted(docs)] for lane, docs in by_lane.items()}


def make_stream(dataset_path: str, tokenizer, lane_id: int, *, max_epochs=None, seed: int = LOADER_SEED):
    """A ``LaneTokenStream`` of one lane of a test dataset, EOS after every document."""
    from loader.io.blocks import TokenFormat
    from loader.io.lane_reader import LaneTokenStream
    from loader.io.manifest import read_manifest

    manifest = read_manifest(dataset_path)
    return LaneTokenStream(
        dataset_path=dataset_path, manifest=manifest, source_name=manifest.source_name, lane_id=lane_id,
        seed=seed, token_format=TokenFormat(bos_id=None, eos_id=eos_id_of(tokenizer)),
        tokenizer=None if manifest.pretokenized else tokenizer, max_epochs=max_epochs,
    )


def make_packer(packing: str, stream, tokenizer, *, seq_len: int = SEQ_LEN, open_bins: int = OPEN_BINS):
    from loader.stages.packing import BestFitPacker, ConcatPacker

    pad = eos_id_of(tokenizer)
    if packing == "concat":
        return ConcatPacker(stream, seq_len, pad)
    return BestFitPacker(stream, seq_len, pad, open_bins)
