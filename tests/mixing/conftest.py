"""Small three-source mixes for the mixing tests (L = 8, seq_len 32, B = 28).

Three sources with the same lane count, written once per session:

* ``web``  — 240 documents, pre-tokenized;
* ``code`` — 160 documents, text (tokenized online);
* ``math`` — 64 documents, text: small, so it wraps into new epochs (or stops) within a
  few dozen steps;

plus ``odd4`` (4 lanes) for the lane-count mismatch error. B = 28 is divisible by every
world size that divides L (1, 2, 4) but not by 3, and 0.55/0.3/0.15 and 1/3 each have
fractional quotas at B = 28 (15.4/8.4/4.2 and 9.33), so every step has a remainder slot.

The suite-wide hang guard of ``tests/conftest.py`` (``timeout`` marker) applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from tokenizers import Tokenizer

from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from loader.io.manifest import Manifest
from tests.dataset_factory import synthetic_texts, write_dataset

NUM_LANES = 8
DATA_SEED = 5
LOADER_SEED = 13
SEQ_LEN = 32
GLOBAL_BATCH = 28
MICRO_BATCH = 7
WEIGHTS = {"web": 0.55, "code": 0.3, "math": 0.15}
THIRDS = {"web": 1, "code": 1, "math": 1}
SOURCES = {"web": (240, 21, True), "code": (160, 22, False), "math": (64, 23, False)}  # docs, text seed, pretok


@dataclass(frozen=True)
class MixData:
    paths: dict[str, str]  # source name -> dataset directory
    manifests: dict[str, Manifest]
    odd_lanes_path: str  # a 4-lane dataset
    tokenizer_path: str


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(default_tokenizer_path())


@pytest.fixture(scope="session")
def mix_data(tmp_path_factory, tokenizer) -> MixData:
    return write_mix_data(tmp_path_factory.mktemp("mixing"), tokenizer)


@pytest.fixture(scope="session")
def mix_config(mix_data) -> Callable[..., LoaderConfig]:
    """``mix_config(weights={name: w}, sources={name: {extra entry fields}}, **config fields)``."""
    return mix_configs(mix_data)


def write_mix_data(root: Path, tokenizer: Tokenizer) -> MixData:
    paths, manifests = {}, {}
    for name, (count, text_seed, pretokenized) in SOURCES.items():
        paths[name] = str(root / name)
        manifests[name] = write_dataset(
            paths[name], synthetic_texts(count, seed=text_seed, max_words=6), num_lanes=NUM_LANES,
            seed=DATA_SEED, source_name=name, tokenizer=tokenizer if pretokenized else None,
            files_per_lane=2, row_group_rows=4,
        )
    odd = str(root / "odd4")
    write_dataset(odd, synthetic_texts(40, seed=24, max_words=6), num_lanes=4, seed=DATA_SEED, source_name="odd4")
    return MixData(paths, manifests, odd, default_tokenizer_path())


def mix_configs(mix_data: MixData) -> Callable[..., LoaderConfig]:
    """``make(weights={name: w}, sources={name: {extra entry fields}}, **config fields)`` over ``mix_data``."""

    def make(weights: dict[str, float] = WEIGHTS, sources: dict[str, dict] | None = None, **overrides) -> LoaderConfig:
        sources = sources or {}
        datasets = [
            {"path": mix_data.paths[name], "name": name, "weight": weight, **sources.get(name, {})}
            for name, weight in weights.items()
        ]
        fields = dict(
            datasets=datasets, seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
            seed=LOADER_SEED, tokenizer=mix_data.tokenizer_path, num_workers=0,
        )
        fields.update(overrides)
        return LoaderConfig(**fields)

    return make
