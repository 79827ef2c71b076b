"""Batch fingerprints: one SHA-256 per global batch, whatever the topology.

``zephon fingerprints CONFIG --world-size W --num-workers K --micro-batch M --steps A:B``
builds all ``W`` rank loaders, reassembles every global batch in global-index order and
prints ``STEP SHA256`` per step (plus ``name=count`` per source when the config mixes
several sources, and ``supervised: name=count ...`` per source when some source has a
``loss_mask``: the positions whose label is not -100 and whose loss mask is 1, counted by the
sequence's source, or by each token's source under token mixing).

Byte layout of the hash (documented in docs/guides/audit.md): for each sequence of
the global batch in increasing global index, its ``input_ids`` then its ``labels``, each as
``seq_len`` little-endian int32 values. Two runs print the same line for a step exactly
when the trainer saw the same global batch.

Image configs (a source holds images) append, after a sequence's labels, each of its images in
token order: the offset of its first placeholder token and its ``(t, h, w)`` grid as four
little-endian int64, then its ``pixel_values`` (the image's rows of the batch's array) as
little-endian float32. A sequence without images adds nothing, so text-only configs keep their
fingerprints byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from loader.checkpoint.state import dumps, loads, merge_rank_states
from loader.cli import run_command
from loader.config import LoaderConfig
from loader.errors import StateError
from loader.stages.features import IGNORE_INDEX


def sequence_bytes(input_ids, labels) -> bytes:
    """The fingerprint byte layout of one sequence."""
    ids = np.asarray(input_ids).astype("<i4", copy=False)
    lab = np.asarray(labels).astype("<i4", copy=False)
    return ids.tobytes() + lab.tobytes()


def image_bytes_by_row(batch) -> dict[int, bytes]:
    """The fingerprint bytes of each row's images in a micro-batch (rows without images absent)."""
    if "pixel_values" not in batch:
        return {}
    as_numpy = lambda v: v.numpy() if hasattr(v, "numpy") else np.asarray(v)  # noqa: E731
    pixels = as_numpy(batch["pixel_values"])
    grids = as_numpy(batch["image_grid_thw"])
    rows = as_numpy(batch["image_sequence_index"]).tolist()
    offsets = as_numpy(batch["image_token_offsets"])
    # dynamic layout: each image owns t * h * w patch rows; fixed: one [3, S, S] entry per image
    sizes = grids.prod(axis=1) if pixels.ndim == 2 else np.ones(len(grids), np.int64)
    ends = np.cumsum(sizes)
    out: dict[int, bytes] = {}
    for k, row in enumerate(rows):
        head = np.array([offsets[k], *grids[k]], dtype="<i8").tobytes()
        values = pixels[int(ends[k] - sizes[k]) : int(ends[k])].astype("<f4", copy=False).tobytes()
        out[row] = out.get(row, b"") + head + values
    return out


@dataclass
class StepFingerprint:
    step: int
    sha256: str
    source_counts: dict[str, int] = field(default_factory=dict)
    # With ``collect_fingerprints(keep_sequences=True)``: (SHA-256 of the sequence's bytes,
    # source name) per sequence in global-index order, so ``zephon diff`` can name the
    # sequences that differ. Not part of ``line()``.
    sequences: list[tuple[str, str]] = field(default_factory=list)
    # Supervised tokens per source (every source, zeros included) when some source has a
    # ``loss_mask``; empty otherwise, and then ``line()`` is the line printed before chat.
    supervised_counts: dict[str, int] = field(default_factory=dict)
    # Fill rows of the step (finite data with filled tails: rows of lanes already done);
    # reported in a note (:func:`fill_note`), not in ``line()``.
    fill_rows: int = 0

    def line(self) -> str:
        counts = " ".join(f"{name}={count}" for name, count in self.source_counts.items())
        text = f"{self.step} {self.sha256}" + (f" {counts}" if counts else "")
        if self.supervised_counts:
            supervised = " ".join(f"{name}={count}" for name, count in self.supervised_counts.items())
            text += f" {SUPERVISED_MARKER} {supervised}"
        return text


# Starts the per-source supervised-token counts of a line; has no ``=``, so it is never a
# ``name=count`` of the sequence counts before it.
SUPERVISED_MARKER = "supervised:"


def supervised_per_source(labels, loss_mask, source: int, token_sources, num_sources: int) -> np.ndarray:
    """Supervised tokens of one sequence per source id: label != -100 and loss_mask == 1, by
    ``token_sources`` (token mixing) or all on the sequence's ``source``."""
    supervised = (np.asarray(labels) != IGNORE_INDEX) & (np.asarray(loss_mask) == 1)
    if token_sources is None:
        counts = np.zeros(num_sources, np.int64)
        counts[source] = int(supervised.sum())
        return counts
    return np.bincount(np.asarray(token_sources)[supervised], minlength=num_sources)[:num_sources]


def collect_fingerprints(
    config: LoaderConfig,
    *,
    world_size: int = 1,
    start_step: int = 0,
    end_step: int,
    load_state: Optional[dict] = None,
    save_state_step: Optional[int] = None,
    keep_sequences: bool = False,
    transform_counts: Optional[dict] = None,
    balance_stats: Optional[dict] = None,
) -> tuple[list[StepFingerprint], Optional[dict]]:
    """Fingerprints of steps ``[start_step, end_step)`` and the merged state at ``save_state_step``.

    Without ``load_state`` the loaders start at step 0 and steps before ``start_step`` are
    consumed but not printed. ``transform_counts``: a dict filled with what the transforms did
    by the end, summed over the ranks (``ZephonLoader.transform_counts``). ``balance_stats``: a dict
    filled with the balancer's max/mean rank costs (``balance`` set; ``LoaderMetrics.balance``).
    """
    from loader.pipeline import ZephonLoader, ranks_have_step  # torch: not for a config or state file that is refused first

    # The fingerprint hashes labels; the supervised counts read loss_mask and token sources
    # (runtime fields: adding them never changes the batches).
    missing = tuple(f for f in ("labels", "loss_mask", "token_source_ids") if f not in config.batch_fields)
    if missing:
        config = config.replace(batch_fields=config.batch_fields + missing)
    if config.model_inputs is not None:  # the same stream, as the loader's own batches (step, global_indices)
        config = config.replace(model_inputs=None)
    loaders = [ZephonLoader(config, rank=r, world_size=world_size) for r in range(world_size)]
    saved: Optional[dict] = None
    results: list[StepFingerprint] = []
    try:
        if load_state is not None:
            for loader in loaders:
                loader.load_state_dict(load_state)
        first = loaders[0].step
        if load_state is not None and first != start_step:
            raise StateError(f"the loaded state resumes at step {first}, but --steps starts at {start_step}")
        names = loaders[0].source_names
        micro_per_step = loaders[0].topology.micro_steps_per_step
        count_supervised = "loss_mask" in loaders[0].features
        for step in range(first, end_step):
            if save_state_step is not None and step == save_state_step:
                saved = merge_rank_states([loader.state_dict() for loader in loaders])
            # Simulated ranks agree on the end of finite data as real ranks do (all-reduce).
            if not ranks_have_step(loaders):
                break
            rows: dict[int, tuple[bytes, int]] = {}
            supervised_rows: dict[int, np.ndarray] = {}
            for loader in loaders:
                for _ in range(micro_per_step):
                    batch = next(loader)
                    if batch["step"] != step:
                        raise RuntimeError(f"rank produced step {batch['step']} while step {step} was expected")
                    images = image_bytes_by_row(batch)
                    for row, (index, ids, labels, source) in enumerate(zip(
                        batch["global_indices"].tolist(), batch["input_ids"].numpy(),
                        batch["labels"].numpy(), batch["source_ids"].tolist(),
                    )):
                        rows[index] = (sequence_bytes(ids, labels) + images.get(row, b""), source)
                        if count_supervised:
                            token_sources = batch["token_source_ids"][row].numpy() if "token_source_ids" in batch else None
                            supervised_rows[index] = supervised_per_source(
                                labels, batch["loss_mask"][row].numpy(), source, token_sources, len(names))
            expected = range(step * config.global_batch_size, (step + 1) * config.global_batch_size)
            if sorted(rows) != list(expected):
                raise RuntimeError(f"step {step}: ranks did not cover the global batch exactly")
            digest = hashlib.sha256()
            counts: Counter = Counter()
            for index in expected:
                digest.update(rows[index][0])
                counts[rows[index][1]] += 1
            if step >= start_step:
                source_counts = {name: counts.get(k, 0) for k, name in enumerate(names)} if len(names) > 1 else {}
                sequences = [(hashlib.sha256(rows[i][0]).hexdigest(), names[rows[i][1]] if rows[i][1] >= 0 else "fill")
                             for i in expected] \
                    if keep_sequences else []
                supervised_counts = {}
                if count_supervised:
                    totals = np.sum([supervised_rows[i] for i in expected], axis=0)
                    supervised_counts = {name: int(totals[k]) for k, name in enumerate(names)}
                results.append(StepFingerprint(step, digest.hexdigest(), source_counts, sequences, supervised_counts,
                                               fill_rows=counts.get(-1, 0)))
        if save_state_step is not None and save_state_step == end_step:
            saved = merge_rank_states([loader.state_dict() for loader in loaders])
        if balance_stats is not None:  # balance: every rank's balancer sees the whole step (rank 0's)
            balance_stats.update(loaders[0].metrics().balance)
        if transform_counts is not None:
            for loader in loaders:  # each rank counts its own lanes
                for source, per_transform in loader.transform_counts().items():
                    into = transform_counts.setdefault(source, {})
                    for label, counts in per_transform.items():
                        total = into.setdefault(label, {"dropped": 0, "changed": 0})
                        total["dropped"] += counts["dropped"]
                        total["changed"] += counts["changed"]
    finally:
        for loader in loaders:
            loader.close()
    return results, saved


def balance_line(stats: dict, world_size: int) -> str:
    """``# balance ...``: max/mean rank cost with ``balance`` and as the default layout had it."""
    return (f"# balance attention W={world_size}: rank cost max/mean over {stats['steps']} steps: mean "
            f"{stats['mean_max_over_mean']:.4f} (unbalanced {stats['mean_max_over_mean_unbalanced']:.4f}); last step "
            f"{stats['max_over_mean']:.4f} (unbalanced {stats['max_over_mean_unbalanced']:.4f})")


def transform_count_lines(transform_counts: dict) -> list[str]:
    """``# transforms SOURCE: POSITION:FUNCTION dropped=N changed=N, ...`` per source with
    transforms (``#`` lines: a fingerprint log's comments, skipped by ``zephon diff``)."""
    return [f"# transforms {source}: " + ", ".join(f"{label} dropped={c['dropped']} changed={c['changed']}"
                                                  for label, c in per_transform.items())
            for source, per_transform in transform_counts.items()]


def fill_note(results: Sequence[StepFingerprint], global_batch_size: int) -> Optional[str]:
    """``# fill rows: N of M rows (steps A..B)`` where some step held fill rows (finite data with
    filled tails, docs/guides/finite-epochs.md), else None; a comment line, which ``zephon diff``
    skips."""
    steps = [r.step for r in results if r.fill_rows]
    if not steps:
        return None
    fill = sum(r.fill_rows for r in results)
    rows = len(results) * global_batch_size
    return f"# fill rows: {fill} of {rows} rows ({fill / rows:.2%}), in steps {steps[0]}..{steps[-1]}"


def _parse_steps(text: str) -> tuple[int, int]:
    try:
        start, end = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps takes START:END, e.g. 0:100 (got {text!r})") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"--steps needs 0 <= START < END (got {text!r})")
    return start, end


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon fingerprints",
        description="Print `STEP SHA256` per global batch, reassembled from all ranks in global-index order.",
    )
    parser.add_argument("config", help="loader config file (.toml or .json)")
    parser.add_argument("--world-size", type=int, default=1, help="number of data-parallel ranks to simulate (default 1)")
    parser.add_argument("--num-workers", type=int, default=None, help="worker processes per rank (default: the config's)")
    parser.add_argument("--micro-batch", type=int, default=None, help="micro-batch size (default: the config's)")
    parser.add_argument("--prefetch", type=int, default=None, help="prefetch depth (default: the config's)")
    parser.add_argument("--steps", type=_parse_steps, required=True, help="START:END, steps START..END-1")
    parser.add_argument("--load-state", metavar="FILE", help="resume from a merged state written by --save-state")
    parser.add_argument("--save-state", nargs=2, metavar=("STEP", "FILE"),
                        help="write the merged global state as it stands before step STEP is produced")
    return parser


def read_state_file(path: str) -> dict:
    """A merged state written by ``--save-state``: read as JSON only, never unpickled."""
    with open(path, "rb") as fh:  # a missing file or a directory: the CLI reports the OSError
        raw = fh.read()
    fix = "pass the JSON file written by --save-state (a pickle or torch checkpoint is never loaded)"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StateError(f"--load-state {path}: a loader state must be JSON text (not UTF-8: {exc}); {fix}") from exc
    try:
        return loads(text)
    except StateError as exc:
        raise StateError(f"--load-state {path}: {exc}; {fix}") from exc


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``zephon fingerprints``: errors are reported by :func:`loader.cli.run_command`."""
    return run_command("fingerprints", argv)


def command(argv: Sequence[str]) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    overrides = {}
    if args.num_workers is not None:
        overrides["num_workers"] = args.num_workers
    if args.micro_batch is not None:
        overrides["micro_batch_size"] = args.micro_batch
    if args.prefetch is not None:
        overrides["prefetch"] = args.prefetch
    config = LoaderConfig.from_file(args.config, **overrides)
    start, end = args.steps
    save_step, save_file = None, None
    if args.save_state:
        step_text, save_file = args.save_state
        if not step_text.isdigit() or not start <= int(step_text) <= end:
            parser.error(f"--save-state STEP must be an integer in {start}..{end} (got {step_text!r})")
        save_step = int(step_text)
    load_state = read_state_file(args.load_state) if args.load_state else None
    transform_counts: dict = {}
    balance_stats: dict = {}
    results, saved = collect_fingerprints(
        config, world_size=args.world_size, start_step=start, end_step=end,
        load_state=load_state, save_state_step=save_step, transform_counts=transform_counts,
        balance_stats=balance_stats,
    )
    for result in results:
        print(result.line())
    for line in transform_count_lines(transform_counts):
        print(line)
    if balance_stats:
        print(balance_line(balance_stats, args.world_size))
    note = fill_note(results, config.global_batch_size)
    if note is not None:
        print(note)
    if save_file is not None and saved is not None:
        with open(save_file, "w") as fh:
            fh.write(dumps(saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
