"""Train a tiny GPT with Zephon as the data source: DDP on gloo, checkpoints with DCP, elastic resume.

Launch (any world size W that divides the lane count and the global batch)::

    python -m torch.distributed.run --nproc_per_node=4 examples/train_gpt.py \\
        --config demo.toml --steps 40 --ckpt-dir ckpt --ckpt-every 10 --log-file run.jsonl
    # later, on 2 processes, with another micro-batch size and worker count:
    python -m torch.distributed.run --nproc_per_node=2 examples/train_gpt.py \\
        --config demo.toml --steps 60 --resume ckpt/step_000040 --micro-batch 8 --num-workers 2 --log-file resumed.jsonl

Without ``torchrun`` the script runs as a single process (W = 1).

What it guarantees, and how:

* **Fixed global batch.** Every optimizer step consumes one global batch of
  ``global_batch_size`` sequences from the config. Each rank gets ``B / W`` of them in
  micro-batches of ``--micro-batch``; gradients are accumulated over the rank's micro-batches
  (``DDP.no_sync`` except the last) and each micro-batch's summed cross-entropy is scaled by
  ``W / N`` where ``N`` is the all-reduced number of predicted tokens of the whole global
  batch. DDP averages over ``W``, so the gradient is the mean over the global batch's tokens
  whatever ``W`` and the micro-batch size are. (``W`` is a power of two here, so scaling by
  ``W`` and DDP's division by ``W`` are exact in floating point.)
* **One checkpoint for model, optimizer and data.** Every ``--ckpt-every`` steps,
  ``torch.distributed.checkpoint`` saves ``{"model", "optim", "trainer", "data"}`` to
  ``CKPT_DIR/step_NNNNNN``; model and optimizer go through ``get_state_dict`` /
  ``set_state_dict``, the loader through ``LoaderStateful`` (one entry per lane, so a
  checkpoint written by W ranks loads on W' ranks). ``--resume`` takes that directory (or
  ``CKPT_DIR``: the latest complete one).
* **Batch fingerprints.** After each step the ranks' sequences are gathered on rank 0 with
  their global indices, ordered by global index and hashed exactly like ``zephon
  fingerprints`` (``loader.commands.fingerprints.sequence_bytes``: input_ids then labels as ``<i4``).
  Rank 0 appends one JSON line per step to ``--log-file``: step, loss (global-batch token mean),
  fingerprint, tokens, per-source counts, learning rate, topology.

The model masks attention to each document (see ``examples/tiny_gpt.py``). Randomness: the
model is initialised from ``--seed`` on every rank (DDP also broadcasts rank 0's weights);
there is no dropout, and the learning rate is a pure function of the step (linear warm-up,
then constant), so nothing but the checkpoint is needed to continue.

``--loader baseline`` swaps Zephon for the pre-packed ``DistributedSampler`` pipeline of
``examples/baseline_data.py`` (same datasets, tokenizer, global batch), for comparison;
``--loader baseline_online`` for its other pipeline: ``DistributedSampler`` over the
documents, tokenized and concat-packed on each rank. Both resume by skipping the
micro-batches already consumed. A ``baseline_online`` global batch is fingerprinted with
its sequences in byte order (its rows have no global index that means the same on every
world size), so its fingerprint names the batch's multiset of sequences.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.baseline_data import BaselineData, OnlineBaselineData, load_or_prepack
from examples.tiny_gpt import GPTConfig, TinyGPT, lm_loss_sum
from loader.config import LoaderConfig
from loader.commands.fingerprints import sequence_bytes
from loader.pipeline import ZephonLoader
from loader.stages.tokenizer import load_tokenizer
from loader.integrations.torch_data import LoaderStateful

log = logging.getLogger("train_gpt")

LOADERS = ("zephon", "baseline", "baseline_online")
CKPT_PREFIX = "step_"


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="Zephon loader config (.toml/.json); fixes datasets, seq_len, global batch, seed")
    p.add_argument("--steps", type=int, required=True, help="train until this global step (exclusive), counting from 0")
    p.add_argument("--ckpt-dir", help="directory for DCP checkpoints CKPT_DIR/step_NNNNNN")
    p.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (default 0: only at the end); needs --ckpt-dir")
    p.add_argument("--resume", help="checkpoint directory to resume from, or a --ckpt-dir (its latest checkpoint)")
    p.add_argument("--micro-batch", type=int, help="micro-batch size (default: the config's micro_batch_size)")
    p.add_argument("--num-workers", type=int, help="loader worker processes per rank (default: the config's)")
    p.add_argument("--log-file", help="JSONL metrics log written by rank 0 (appended to when resuming); "
                   "not --log: torchrun would take that for an abbreviation of its --log-dir")
    p.add_argument("--loader", choices=LOADERS, default="zephon", help="data source (default: zephon)")
    p.add_argument("--baseline-cache", help="--loader baseline: .npz file for the pre-packed list (built by rank 0 if missing)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed (default: 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default: 1e-3; 3e-3 spikes on the demo data)")
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps (default: 10)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default: 0.1)")
    p.add_argument("--d-model", type=int, default=64, help="model width (default: 64)")
    p.add_argument("--layers", type=int, default=2, help="decoder blocks (default: 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default: 1)")
    return p


# -- distributed setup -----------------------------------------------------------------------
def init_distributed() -> tuple[int, int]:
    if "RANK" not in os.environ:  # plain `python train_gpt.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def lr_at(step: int, base_lr: float, warmup: int) -> float:
    return base_lr * min(1.0, (step + 1) / max(1, warmup))


# -- data ------------------------------------------------------------------------------------
class ZephonData:
    """The rank's micro-batches of one global step from a ZephonLoader."""

    def __init__(self, config: LoaderConfig) -> None:
        self.loader = ZephonLoader(config)  # rank / world size from the torchrun environment
        self.source_names = self.loader.source_names
        self.micro_per_step = self.loader.topology.micro_steps_per_step

    def next_step(self) -> list[dict]:
        step = self.loader.step
        batches = [next(self.loader) for _ in range(self.micro_per_step)]
        if any(b["step"] != step for b in batches):
            raise RuntimeError(f"loader returned micro-batches of steps {[b['step'] for b in batches]}, expected {step}")
        return batches

    def close(self) -> None:
        self.loader.close()


def build_data(args, config: LoaderConfig, rank: int, world_size: int):
    if args.loader == "zephon":
        return ZephonData(config)
    if args.loader == "baseline_online":
        return OnlineBaselineData(config, rank=rank, world_size=world_size,
                                  micro_batch=config.micro_batch_size, num_workers=config.num_workers)
    packed = load_or_prepack(config, args.baseline_cache, rank=rank, barrier=dist.barrier)
    return BaselineData(packed, config, rank=rank, world_size=world_size,
                        micro_batch=config.micro_batch_size, num_workers=config.num_workers)


# -- checkpoints -----------------------------------------------------------------------------
def checkpoint_path(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"{CKPT_PREFIX}{step:06d}")


def resolve_resume(path: str) -> str:
    """``path`` itself if it is a complete DCP checkpoint, else its latest complete ``step_*``."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    candidates = sorted(
        d for d in (os.listdir(path) if os.path.isdir(path) else [])
        if d.startswith(CKPT_PREFIX) and os.path.exists(os.path.join(path, d, ".metadata"))
    )
    if not candidates:
        raise FileNotFoundError(f"--resume {path}: no complete checkpoint (a directory with .metadata) there")
    return os.path.join(path, candidates[-1])


# torch.distributed.checkpoint is imported where it is used: it costs ~2 s per process (and per
# spawned loader worker, which re-imports this module) in runs that never checkpoint.
def _state(model, optim, data, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "trainer": {"step": torch.tensor(step, dtype=torch.int64)}}
    if isinstance(data, ZephonData):
        state["data"] = LoaderStateful(data.loader)
    return state


def save_checkpoint(path: str, model, optim, data, step: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optim, data, step), checkpoint_id=path)


def load_checkpoint(path: str, model, optim, data) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optim, data, 0)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = int(state["trainer"]["step"])
    if isinstance(data, ZephonData):
        if data.loader.step != step:
            raise RuntimeError(f"checkpoint {path}: trainer step {step} but loader state at step {data.loader.step}")
    else:
        data.start_at(step)  # the baseline resumes by skipping consumed micro-batches
    return step


# -- fingerprints ----------------------------------------------------------------------------
def fingerprint_rows(micro_batches: list[dict]) -> list[tuple]:
    rows = []
    for b in micro_batches:
        seq_ids = b.get("sequence_ids", [None] * len(b["global_indices"]))
        for i, ids, labels, src, sid in zip(b["global_indices"].tolist(), b["input_ids"].numpy(),
                                            b["labels"].numpy(), b["source_ids"].tolist(), list(seq_ids)):
            rows.append((i, sequence_bytes(ids, labels), src, None if sid is None else int(sid)))
    return rows


def global_fingerprint(all_rows: list[list[tuple]], step: int, batch_size: int, exact_indices: bool,
                       by_content: bool = False):
    """SHA-256 over the step's sequences in global-index order (``by_content``: in byte order)."""
    key = (lambda r: r[1]) if by_content else (lambda r: r[0])
    rows = sorted((r for rank_rows in all_rows for r in rank_rows), key=key)
    indices = [r[0] for r in rows]
    if exact_indices and indices != list(range(step * batch_size, (step + 1) * batch_size)):
        raise RuntimeError(f"step {step}: the ranks' sequences do not cover the global batch exactly")
    digest = hashlib.sha256()
    for r in rows:
        digest.update(r[1])
    return digest.hexdigest(), rows


# -- training --------------------------------------------------------------------------------
def train(args, config: LoaderConfig, data, rank: int, world_size: int) -> None:
    torch.manual_seed(args.seed)
    vocab = load_tokenizer(config.tokenizer).get_vocab_size()
    model = TinyGPT(GPTConfig(vocab, config.seq_len, args.d_model, args.layers, args.heads))
    ddp = DDP(model)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                              weight_decay=args.weight_decay, foreach=False)
    step = 0
    if args.resume:
        path = resolve_resume(args.resume)
        step = load_checkpoint(path, model, optim, data)
        if rank == 0:
            log.info("resumed from %s at step %d (world size %d)", path, step, world_size)
    log_file = open(args.log_file, "a" if args.resume else "w") if (rank == 0 and args.log_file) else None
    t_start = time.perf_counter()
    while step < args.steps:
        t0 = time.perf_counter()
        micro = data.next_step()
        count = torch.tensor([sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)], dtype=torch.int64)
        dist.all_reduce(count)
        n_tokens = int(count)
        lr = lr_at(step, args.lr, args.warmup)
        for group in optim.param_groups:
            group["lr"] = lr
        optim.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for j, b in enumerate(micro):
            sync = contextlib.nullcontext() if j == len(micro) - 1 else ddp.no_sync()
            with sync:
                ce, _ = lm_loss_sum(ddp(b["input_ids"], b["position_ids"]), b["labels"])
                (ce * (world_size / n_tokens)).backward()
            loss_sum += float(ce.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total)
        rows = fingerprint_rows(micro)
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
        if rank == 0:
            sha, ordered = global_fingerprint(gathered, step, config.global_batch_size, args.loader == "zephon",
                                              by_content=args.loader == "baseline_online")
            counts = {name: sum(1 for r in ordered if r[2] == k) for k, name in enumerate(data.source_names)}
            record = {
                "event": "step", "step": step, "loss": float(total) / n_tokens, "fingerprint": sha,
                "tokens": n_tokens, "sequences": len(ordered), "sources": counts, "lr": lr,
                "loader": args.loader, "world_size": world_size, "micro_batch": config.micro_batch_size,
                "num_workers": config.num_workers, "step_time_s": round(time.perf_counter() - t0, 4),
            }
            if args.loader == "baseline":
                record["sequence_ids"] = [r[3] for r in ordered]
            elif args.loader == "baseline_online":  # no stable ids: name each sequence by its content
                record["sequence_keys"] = [hashlib.sha256(r[1]).hexdigest()[:16] for r in ordered]
            if log_file:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            if step % 10 == 0 or step == args.steps - 1:
                log.info("step %d loss %.5f fp %s", step, record["loss"], sha[:12])
        step += 1
        if args.ckpt_dir and ((args.ckpt_every and step % args.ckpt_every == 0) or step == args.steps):
            save_checkpoint(checkpoint_path(args.ckpt_dir, step), model, optim, data, step)
            if rank == 0:
                log.info("saved checkpoint %s", checkpoint_path(args.ckpt_dir, step))
    if rank == 0:
        log.info("done: steps to %d in %.1f s", step, time.perf_counter() - t_start)
    if log_file:
        log_file.close()


def shutdown_distributed(clean: bool) -> None:
    """Tear down gloo without the exit-time deadlock seen with torch 2.13.

    Destroying the last reference to a gloo process group (from DDP's reducer at interpreter
    exit) joins gloo's worker threads while holding the GIL; a worker still releasing the
    tensors of the last ``gather_object`` needs the GIL, and both wait forever. So: DDP is
    already gone (``train`` returned), every rank waits in a barrier (GIL released, gloo's
    threads finish) and only then is the group destroyed.
    """
    if clean:
        dist.barrier()
        time.sleep(0.05)
    gc.collect()
    dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.ckpt_every and not args.ckpt_dir:
        raise SystemExit("--ckpt-every needs --ckpt-dir")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    rank, world_size = init_distributed()
    clean = False
    data = None
    try:
        overrides = {k: v for k, v in (("micro_batch_size", args.micro_batch), ("num_workers", args.num_workers))
                     if v is not None}
        config = LoaderConfig.from_file(args.config, **overrides)
        data = build_data(args, config, rank, world_size)
        train(args, config, data, rank, world_size)
        clean = True
    finally:
        if data is not None:
            data.close()
        shutdown_distributed(clean)
    return 0


if __name__ == "__main__":
    status = main()
    # Everything is closed above; spare the interpreter's exit-time garbage collections over
    # torch's ~250k objects (seconds per process on a busy 2-core machine).
    gc.freeze()
    sys.exit(status)
