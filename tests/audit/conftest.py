"""Datasets and helpers for the ``zephon audit`` tests: two small pre-tokenized sources.

L = 4 lanes, two part files per lane, row groups of 4 documents; with seq_len 32 and B = 8
a lane starts a new epoch every few steps, so later epochs (shuffled files, row groups and
rows) are reached quickly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow.parquet as pq
import pytest

from loader.config import LoaderConfig
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.loader.conftest import tokenizer, tokenizer_path  # noqa: F401 - shared fixtures


@pytest.fixture(autouse=True)
def _seek_index_key_home(tmp_path_factory, monkeypatch):
    """The seek-index key (loader.commands.seek_index.seal_key) under a temporary config home,
    never the user's own ~/.config."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.getbasetemp() / "config-home"))

NUM_LANES = 4
SEQ_LEN = 32
GLOBAL_BATCH = 8


@dataclass(frozen=True)
class Sources:
    web: str
    code: str
    web_text: str  # the web documents as text lanes (tokenized online)


@pytest.fixture(scope="session")
def sources(tmp_path_factory, tokenizer) -> Sources:
    base = tmp_path_factory.mktemp("audit")
    options = dict(num_lanes=NUM_LANES, seed=3, files_per_lane=2, row_group_rows=4)
    web = synthetic_texts(120, seed=11, max_words=12)
    code = synthetic_texts(90, seed=12, max_words=20)
    write_dataset(str(base / "web"), web, tokenizer=tokenizer, source_name="web", **options)
    write_dataset(str(base / "code"), code, tokenizer=tokenizer, source_name="code",
                  keys=[f"code-{k:05d}" for k in range(len(code))], **options)
    write_dataset(str(base / "web_text"), web, source_name="web", **options)
    return Sources(web=str(base / "web"), code=str(base / "code"), web_text=str(base / "web_text"))


@pytest.fixture(scope="session")
def make_config(sources, tokenizer_path) -> Callable[..., LoaderConfig]:
    def make(packing: str = "concat", *, mix: bool = False, **overrides) -> LoaderConfig:
        datasets = [{"path": sources.web, "weight": 0.6}] + ([{"path": sources.code, "weight": 0.4}] if mix else [])
        fields = dict(datasets=datasets, seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, micro_batch_size=4,
                      seed=5, tokenizer=tokenizer_path, packing=packing, best_fit_open_bins=3, num_workers=0)
        fields.update(overrides)
        return LoaderConfig(**fields)

    return make


def step_batch(config: LoaderConfig, step: int, *, load_state=None, world_size: int = 1) -> tuple[np.ndarray, object]:
    """``input_ids`` of global step ``step`` as the training loader delivers it (rows in global-index
    order, reassembled over ``world_size`` ranks), and rank 0's ``TokenFormat`` and pad id."""
    from loader.pipeline import ZephonLoader

    loaders = [ZephonLoader(config, rank=r, world_size=world_size) for r in range(world_size)]
    try:
        rows = {}
        for loader in loaders:
            if load_state is not None:
                loader.load_state_dict(load_state)
            while loader.step <= step:
                batch = next(loader)
                if batch["step"] == step:
                    for index, ids in zip(batch["global_indices"].tolist(), batch["input_ids"].numpy()):
                        rows[index] = ids
        spec = loaders[0].spec
        return np.stack([rows[i] for i in sorted(rows)]), (spec.token_format, spec.pad_id)
    finally:
        for loader in loaders:
            loader.close()


def rebuild_from_documents(audit, datasets: dict[str, str], token_format, pad_id: int, seq_len: int) -> np.ndarray:
    """Each audited sequence rebuilt from the lane files alone: the documented span of every
    named document (its input_ids read from its file and row, wrapped as configured), then
    padding. Checks that each piece's key is the key stored in that row."""
    tables: dict = {}
    rebuilt = []
    for seq in audit.sequences:
        out: list[int] = []
        for piece in seq.pieces:
            path = f"{datasets[piece.source]}/{piece.file}"
            if path not in tables:
                tables[path] = pq.read_table(path, columns=["key", "input_ids"])
            table = tables[path]
            assert table.column("key")[piece.row].as_py() == piece.key
            ids = np.frombuffer(table.column("input_ids")[piece.row].as_py(), "<i4").tolist()
            wrapped = ([token_format.bos_id] if token_format.bos_id is not None else []) + ids + (
                [token_format.eos_id] if token_format.eos_id is not None else [])
            assert piece.document_tokens == len(wrapped)
            assert piece.position == len(out), "pieces are listed in sequence order, back to back"
            out.extend(wrapped[piece.start:piece.end])
            assert piece.end - piece.start == piece.length
        assert len(out) == seq.padding_start
        out.extend([pad_id] * seq.padding)
        assert len(out) == seq_len
        rebuilt.append(out)
    return np.array(rebuilt, dtype=np.int64)


def audit_with_reads(config: LoaderConfig, step: int, **kwargs) -> tuple[object, list]:
    """``audit_step(config, step, **kwargs)`` and its read log as it stood before the step's
    documents were looked up: ``(source, lane, file, row group, column)`` of placing the lanes
    and producing the step (the key reads come after)."""
    import loader.commands.audit as audit_module

    captured = []
    original = audit_module._fill_documents

    def keep(sequences, lanes, loader, tokenizer, log):
        captured.extend(log.reads)
        return original(sequences, lanes, loader, tokenizer, log)

    audit_module._fill_documents = keep
    try:
        audit = audit_module.audit_step(config, step, **kwargs)
    finally:
        audit_module._fill_documents = original
    return audit, captured
