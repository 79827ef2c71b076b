"""Small datasets for the transform tests: one corpus as text lanes and pre-tokenized lanes.

L = 8 lanes, two part files per lane and row groups of 4 rows, so epochs permute files, row
groups and rows, and a filter empties whole row groups. Written without Beam (fast).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from loader.stages.tokenizer import load_tokenizer
from tests.dataset_factory import synthetic_texts, write_dataset

NUM_LANES = 8
F = "tests.transforms.functions:"
TEXT_TRANSFORMS = ({"function": F + "drop_multiple_of_three"}, {"function": F + "shout_every_other_word"},
                   {"function": F + "drop_random_words", "args": {"p": 0.3}})
TOKEN_TRANSFORMS = ({"function": F + "drop_odd_length"}, {"function": F + "reverse_ids"},
                    {"function": F + "drop_random_tokens", "args": {"p": 0.2}})


@dataclass(frozen=True)
class Corpus:
    texts: list
    text_path: str
    pretokenized_path: str


@pytest.fixture(scope="session")
def transform_corpus(tmp_path_factory) -> Corpus:
    return write_transform_corpus(tmp_path_factory.mktemp("transform_corpus"))


def write_transform_corpus(base: Path) -> Corpus:
    texts = synthetic_texts(160, seed=11, max_words=40)
    options = dict(num_lanes=NUM_LANES, files_per_lane=2, row_group_rows=4)
    write_dataset(str(base / "text"), texts, **options)
    write_dataset(str(base / "pretokenized"), texts, tokenizer=load_tokenizer(default_tokenizer_path()), **options)
    return Corpus(texts, str(base / "text"), str(base / "pretokenized"))


def loader_config(path: str, transforms=(), **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path}], seq_len=48, global_batch_size=8, micro_batch_size=2, seed=5,
                  tokenizer=default_tokenizer_path(), num_workers=0, prefetch=2, worker_timeout_s=60.0,
                  transforms=list(transforms))
    fields.update(overrides)
    return LoaderConfig(**fields)
