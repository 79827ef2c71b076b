"""Zephon itself: lane-sharded Parquet from ``beam_jobs.shard``, read by ``ZephonLoader``.

Formats (``formats/zephon``): ``web-ids`` and ``caps-ids`` (tokenized offline by the Beam job
with the benchmark tokenizer), ``web-text`` (text only: the loader tokenizes online). All
with 16 lanes and seed 0. Packing is Zephon's own ``packing="concat"`` (EOS after each doc),
mixing its per-sequence schedule over two datasets. ``zephon`` delivers ``input_ids`` only
(``batch_fields``), as the peers do; ``zephon_full`` the default full batch.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np

from bench.peers.common import Layout, Spec

NUM_LANES = 16
DATASETS = {"web-ids": ("web", True), "web-text": ("web", False), "caps-ids": ("caps", True)}
# The dataset-size pair of the RSS goal (issue 16): "web-ids" (10N) and this one (N), the first
# tenth of the web documents (the first of every ten JSONL files), built when the corpus has
# a multiple of ten files per source.
SMALL = "web-ids-tenth"


def version() -> str:
    try:
        from importlib.metadata import version as v

        return v("zephon")
    except Exception:  # noqa: BLE001
        return "working tree"


def imports() -> None:
    """What the loader imports (torch, pyarrow, tokenizers), outside the timed construction."""
    import loader.pipeline  # noqa: F401


def prepare(layout: Layout, beam_python: str = "python3") -> dict:
    out_root = layout.formats("zephon")
    os.makedirs(out_root, exist_ok=True)
    tokenizer = layout.info()["tokenizer"]
    done = {}
    jobs = {name: (source, tokenized, [os.path.join(layout.source_jsonl_dir(source), "*.jsonl")])
            for name, (source, tokenized) in DATASETS.items() if source in layout.sources()}
    files = layout.info().get("files_per_source", 4)
    if files % 10 == 0:
        tenth = [os.path.join(layout.source_jsonl_dir("web"), f"part-{i:04d}.jsonl") for i in range(0, files, 10)]
        jobs[SMALL] = ("web", True, tenth)
    for name, (source, tokenized, patterns) in jobs.items():
        out = os.path.join(out_root, name)
        if os.path.exists(os.path.join(out, "manifest.json")):
            done[name] = "cached"
            continue
        cmd = [beam_python, "-m", "beam_jobs.shard", "--input", *patterns, "--output", out,
               "--num-lanes", str(NUM_LANES), "--seed", "0", "--id-field", "id",
               "--source-name", source, "--overwrite"]
        if tokenized:
            cmd += ["--tokenizer", tokenizer]
        env = dict(os.environ)
        env.pop("VIRTUAL_ENV", None)
        proc = subprocess.run(cmd, cwd=_repo_root(), env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"beam_jobs.shard failed for {name}: " + " | ".join(tail))
        done[name] = "built"
    return {"datasets": done}


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Session:
    def __init__(self, spec: Spec, layout: Layout, **config_overrides) -> None:
        from loader.config import BATCH_FIELDS, LoaderConfig
        from loader.pipeline import ZephonLoader

        # "zephon": the token ids, which is all any peer delivers and all the loop reads;
        # "zephon_full": also labels, position ids and cu_seqlens, as a trainer gets them.
        batch_fields = BATCH_FIELDS if spec.loader == "zephon_full" else ("input_ids",)
        root = layout.formats("zephon")
        if spec.dataset:
            datasets = [{"path": os.path.join(root, spec.dataset), "weight": 1.0}]
        elif spec.mode == "pretok":
            datasets = [{"path": os.path.join(root, "web-ids"), "weight": 1.0}]
        elif spec.mode == "text":
            datasets = [{"path": os.path.join(root, "web-text"), "weight": 1.0}]
        else:
            datasets = [{"path": os.path.join(root, "web-ids"), "weight": spec.weights[0]},
                        {"path": os.path.join(root, "caps-ids"), "weight": spec.weights[1]}]
        self.cfg = LoaderConfig(datasets=datasets, seq_len=spec.seq_len, global_batch_size=spec.global_batch,
                                micro_batch_size=spec.rank_batch, seed=spec.seed,
                                tokenizer=layout.info()["tokenizer"], packing="concat",
                                num_workers=spec.num_workers, batch_fields=batch_fields,
                                **config_overrides)
        self.loader = ZephonLoader(self.cfg, rank=spec.rank, world_size=spec.world_size)
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self.loader)
        return next(self._it)["input_ids"]

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state) -> None:
        self.loader.load_state_dict(state)
        self._it = None

    def close(self) -> None:
        self.loader.close()


def open_session(spec: Spec, layout: Layout, **config_overrides) -> Session:
    """``config_overrides`` (or ``spec.options``): LoaderConfig fields for profiling runs (the
    comparison passes none)."""
    return Session(spec, layout, **{**spec.options, **config_overrides})


def merge_ranks(per_rank: list[np.ndarray]) -> np.ndarray:
    """Rank r holds global indices i = r (mod W) of each batch, in order: interleave them."""
    world = len(per_rank)
    rows = per_rank[0].shape[0]
    out = np.empty((rows * world,) + per_rank[0].shape[1:], dtype=per_rank[0].dtype)
    for r, part in enumerate(per_rank):
        out[r::world] = part
    return out

