"""Small datasets for the transform tests: one corpus as text lanes and pre-tokenized lanes, and
conversations sharded for online chat (tests/transforms/test_transform_chat.py).

The corpus: L = 8 lanes, two part files per lane and row groups of 4 rows, so epochs permute
files, row groups and rows, and a filter empties whole row groups. Written without Beam (fast).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from loader.stages.tokenizer import load_tokenizer
from tests.chat.chat_factory import TEMPLATES_DIR, make_records
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


# -- online chat -----------------------------------------------------------------------------------

CHAT_TEMPLATE = str(TEMPLATES_DIR / "chatml_generation.jinja")
IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]
CHAT_SEQ_LEN = 128
KEY_PREFIX = "chat.jsonl#1"  # records 1 and 10-19 (keys are input path#index)
CHAT_TRANSFORMS = (  # a records filter and map, then a tokens filter (on loss_mask) and a seeded random map
    {"function": F + "drop_long_conversations", "args": {"max_messages": 5}},
    {"function": F + "shout_replies"},
    {"function": F + "drop_unsupervised_halves"},
    {"function": F + "drop_random_tokens", "args": {"p": 0.1}},
)


def chat_job(inputs, output, *extra) -> list[str]:
    return ["--input", *map(str, inputs), "--output", str(output), "--messages-field", "messages",
            "--chat-template", CHAT_TEMPLATE, "--num-lanes", "2", "--max-reject-fraction", "1.0", *extra, *IN_MEMORY]


def write_online_chat(base: Path) -> dict:
    """48 conversations (``base/chat.jsonl``) sharded for online chat under ``base/online``."""
    (base / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_records(29, 48)), encoding="utf-8")
    shard.run(chat_job([base / "chat.jsonl"], base / "online", "--chat-max-tokens", str(CHAT_SEQ_LEN - 1),
                       "--chat-overflow", "truncate"))
    return {"base": base, "online": str(base / "online")}


def write_chat_shards(base: Path) -> dict:
    """:func:`write_online_chat`, the same conversations all rejected online, and small-file
    shards of them unfiltered and with a key filter run by the job (tombstones)."""
    shards = write_online_chat(base)
    # every conversation is longer than 4 tokens: all rejected online (too_long)
    shard.run(chat_job([base / "chat.jsonl"], base / "rejected", "--chat-max-tokens", "4"))
    # a key filter offline (tombstones in the conversation lanes), small files: epochs permute them
    flags = ("--chat-max-tokens", str(CHAT_SEQ_LEN - 1), "--chat-overflow", "truncate", "--target-file-mb", "0.004")
    shard.run(chat_job([base / "chat.jsonl"], base / "online_small", *flags))
    shard.run(chat_job([base / "chat.jsonl"], base / "filtered_offline", *flags, "--transform",
                       F + 'drop_key_prefix:{"prefix": "%s"}' % KEY_PREFIX))
    return {**shards, **{name: str(base / name) for name in ("rejected", "online_small", "filtered_offline")}}


def chat_loader_config(path: str, transforms=(), **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path, "name": "chat"}], seq_len=CHAT_SEQ_LEN, global_batch_size=4,
                  micro_batch_size=2, seed=3, tokenizer=default_tokenizer_path(), num_workers=0, prefetch=2,
                  worker_timeout_s=60.0, add_bos=False, add_eos=True, transforms=list(transforms))
    fields.update(overrides)
    return LoaderConfig(**fields)
