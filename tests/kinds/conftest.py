"""The test-only ``utf8-bytes`` kind's dataset: documents of multi-byte words sharded by the real
job (in-memory runner) with ``--kind utf8-bytes``, and the loader config over it.

Importing this module registers the kind (loader and Beam sides), as a user's import would.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import tests.kinds.utf8_bytes_kind as utf8_bytes_kind  # registers the kind (loader and Beam sides)
from beam_jobs import shard
from loader.config import LoaderConfig
from loader.samples import default_tokenizer_path

BEAM_IN_MEMORY = ("--runner=FnApiRunner", "--direct_running_mode=in_memory")
NUM_LANES = 8
WORDS = ("zephon", "lane", "naïve", "façade", "日本語", "данные", "🙂", "Ω", "straße", "kind", "bytes", "ok")


def _documents(count: int) -> list[str]:
    rng = random.Random(33)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 16))) + f" #{k}" for k in range(count)]


def write_utf8_dataset(base: Path) -> tuple[str, list[str]]:
    """400 documents sharded with ``--kind utf8-bytes`` into tiny files (several per lane):
    the lanes' path and the documents."""
    texts = _documents(400)
    source = base / "in.jsonl"
    source.write_text("".join(json.dumps({"id": k, "text": t}, ensure_ascii=False) + "\n"
                              for k, t in enumerate(texts)), encoding="utf-8")
    output = str(base / "lanes")
    shard.run(["--input", str(source), "--output", output, "--id-field", "id", "--kind", utf8_bytes_kind.NAME,
               "--num-lanes", str(NUM_LANES), "--target-file-mb", "0.001", *BEAM_IN_MEMORY])
    return output, texts


def utf8_config(path: str, **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path}], seq_len=64, global_batch_size=8, micro_batch_size=2, seed=5,
                  tokenizer=default_tokenizer_path(), num_workers=0, prefetch=2, worker_timeout_s=60.0)
    fields.update(overrides)
    return LoaderConfig(**fields)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, list[str]]:
    return write_utf8_dataset(tmp_path_factory.mktemp("utf8_bytes"))
