"""Session-wide small lane datasets and loader configs for the loader tests.

One corpus of synthetic documents is written twice with the same keys, seed and layout:
as text lanes (tokenized online by the loader) and pre-tokenized with the shipped
tokenizer. L = 8 lanes, two part files per lane and small row groups, so epochs replay a
real permutation of files, row groups and rows, and an epoch ends every ~10 steps of
B = 16 at seq_len 64. About a fifth of the documents are longer than seq_len.

Every test runs under a SIGALRM guard (``timeout`` marker, default 120 s): a loader hang
fails the test instead of the suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
from tokenizers import Tokenizer

from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from loader.commands.fingerprints import collect_fingerprints
from loader.io.manifest import Manifest
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.resume_harness import epoch_edge_steps

from tests.loader.settings import (
    DATA_SEED, GLOBAL_BATCH, LOADER_SEED, MICRO_BATCH, NUM_DOCS, NUM_LANES, OPEN_BINS,
    PACKINGS, SEQ_LEN,
)


@dataclass(frozen=True)
class Corpus:
    texts: list[str]
    keys: list[str]
    text_path: str  # text lanes, tokenized by the loader
    pretokenized_path: str  # the same lanes with input_ids
    manifest: Manifest
    num_lanes: int = NUM_LANES
    seed: int = DATA_SEED


@pytest.fixture(scope="session")
def tokenizer_path() -> str:
    return default_tokenizer_path()


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path) -> Tokenizer:
    return Tokenizer.from_file(tokenizer_path)


def _write(path, texts, tokenizer=None, **kwargs) -> Manifest:
    options = dict(num_lanes=NUM_LANES, seed=DATA_SEED, files_per_lane=2, row_group_rows=4)
    options.update(kwargs)
    return write_dataset(str(path), texts, tokenizer=tokenizer, **options)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, tokenizer) -> Corpus:
    base = tmp_path_factory.mktemp("corpus")
    texts = synthetic_texts(NUM_DOCS, seed=7, max_words=40)
    manifest = _write(base / "text", texts)
    _write(base / "pretokenized", texts, tokenizer)
    return Corpus(
        texts=texts, keys=[f"doc-{k:07d}" for k in range(len(texts))],
        text_path=str(base / "text"), pretokenized_path=str(base / "pretokenized"), manifest=manifest,
    )


@pytest.fixture(scope="session")
def other_datasets(tmp_path_factory, corpus) -> dict[str, str]:
    """Datasets a checkpoint of ``corpus`` must not resume on: other content, other lane count."""
    base = tmp_path_factory.mktemp("other")
    texts = synthetic_texts(NUM_DOCS, seed=8, max_words=40)
    _write(base / "other_content", texts)
    _write(base / "four_lanes", corpus.texts, num_lanes=4)
    return {"other_content": str(base / "other_content"), "four_lanes": str(base / "four_lanes")}


@pytest.fixture(scope="session")
def make_config(corpus, tokenizer_path) -> Callable[..., LoaderConfig]:
    """``make_config(packing, pretokenized=False, **overrides)``: the suite's loader config."""

    def make(packing: str = "concat", *, pretokenized: bool = False, **overrides) -> LoaderConfig:
        path = corpus.pretokenized_path if pretokenized else corpus.text_path
        fields = dict(
            datasets=[{"path": path}], seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH,
            micro_batch_size=MICRO_BATCH, seed=LOADER_SEED, tokenizer=tokenizer_path, packing=packing,
            best_fit_open_bins=OPEN_BINS, num_workers=0, prefetch=2, worker_timeout_s=60.0,
        )
        fields.update(overrides)
        return LoaderConfig(**fields)

    return make


@pytest.fixture(scope="session")
def baseline(make_config) -> Callable[..., list[str]]:
    """``baseline(packing, steps)``: fingerprint lines of one uninterrupted W=1 in-process run (cached)."""
    cache: dict = {}

    def get(packing: str, steps: int, **overrides) -> list[str]:
        key = (packing, steps, tuple(sorted(overrides.items())))
        if key not in cache:
            results, _ = collect_fingerprints(make_config(packing, **overrides), world_size=1, end_step=steps)
            cache[key] = [r.line() for r in results]
        return cache[key]

    return get


@pytest.fixture(scope="session")
def epoch_edges(make_config) -> Callable[[str], list[int]]:
    """``epoch_edges(packing)``: steps (< 30) right after some lane started a new epoch (cached)."""
    cache: dict = {}

    def get(packing: str) -> list[int]:
        if packing not in cache:
            cache[packing] = epoch_edge_steps(make_config(packing), 30)
        return cache[packing]

    return get


@pytest.fixture(params=PACKINGS)
def packing(request) -> str:
    return request.param

