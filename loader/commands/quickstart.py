"""``zephon quickstart``: the whole pipeline end to end on generated data, no cloud account.

1. generate a sample corpus (``zephon make-sample``);
2. shard two sources with the Beam job (local FnApiRunner): ``prose`` as text lanes
   (tokenized online by the loader) and ``code`` pre-tokenized offline;
3. inspect both datasets;
4. write a loader config mixing them 0.7 / 0.3, stream global batches as 1 rank and as
   4 simulated ranks with 2 worker processes each, and show the fingerprints agree;
5. checkpoint at a step, resume with another world size, and show the stream continues
   identically.

Each stage prints its wall time when it ends, the sharding job its summary (documents,
rejects, bytes, time, per-lane balance: :mod:`beam_jobs.progress`), and the run ends with a
table of the stages' times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

from loader.cli import run_command
from beam_jobs import inspect_dataset, shard
from loader.samples import corpus as sample_data
from beam_jobs.progress import StageTimer
from loader.config import LoaderConfig
from loader.commands.fingerprints import collect_fingerprints


def _say(message: str, timer=None, stage: str = "") -> None:
    """Start a stage: the previous stage's wall time, then this one's title."""
    if timer is not None:
        _took(timer)
        timer.start(stage)
    print(f"\n== {message}", flush=True)


def _took(timer) -> None:
    seconds = timer.stop()
    if seconds is not None:
        print(f"   ({timer.stages[-1][0]}: {seconds:.1f} s)", flush=True)


def next_steps(out: str, config_path: str, num_lanes: int) -> str:
    """The two things a newcomer does next, as commands that run as printed."""
    mine = os.path.join(out, "my-dataset")
    first_batch = (f"python -c \"import loader; data = loader.ZephonLoader(loader.LoaderConfig.from_file("
                   f"'{config_path}'), dp_rank=0, dp_world_size=1); batch = next(iter(data)); "
                   "print({k: tuple(v.shape) for k, v in batch.items() if hasattr(v, 'shape')}); data.close()\"")
    return "\n".join([
        "next:",
        "  1. shard your own JSONL (here: the sample's prose files; use your --input and --text-field):",
        f"     zephon shard --input '{os.path.join(out, 'raw', 'prose', '*')}' --output {mine} "
        f"--num-lanes {num_lanes} --id-field id --max-reject-fraction 0.05 --overwrite",
        "  2. plug the loader into your trainer (recipes for HF Trainer, Lightning, torchrun, DCP: "
        "docs/guides/trainers.md); the first micro-batch:",
        f"     {first_batch}",
    ])


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zephon quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="quickstart", help="working directory (default: %(default)s)")
    parser.add_argument("--docs", type=int, default=3000, help="sample documents to generate (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=8, help="global batches to stream (default: %(default)s)")
    parser.add_argument("--num-lanes", type=int, default=8, help="lanes per dataset (default: %(default)s)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``zephon quickstart``: errors are reported by :func:`loader.cli.run_command`."""
    return run_command("quickstart", argv)


def command(argv: Sequence[str]) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    for option, value, minimum in (("--docs", args.docs, 1), ("--steps", args.steps, 2), ("--num-lanes", args.num_lanes, 1)):
        if value < minimum:  # --steps: step 5 resumes from a checkpoint inside the run
            parser.error(f"{option} must be >= {minimum} (got {value})")

    out = os.path.abspath(args.out)
    raw, datasets = os.path.join(out, "raw"), os.path.join(out, "datasets")
    tokenizer = sample_data.default_tokenizer_path()
    started = time.monotonic()
    timer = StageTimer()

    _say(f"1. generating {args.docs} sample documents in {raw}", timer, "generate")
    sample_data.make_sample(raw, num_docs=args.docs, seed=0)

    _say("2. sharding with Apache Beam (FnApiRunner): prose as text, code pre-tokenized", timer, "shard")
    for name, extra in (("prose", []), ("code", ["--tokenizer", tokenizer])):
        options, pipeline_args = shard.parse_args([
            "--input", os.path.join(raw, name, "*"), "--output", os.path.join(datasets, name),
            "--source-name", name, "--id-field", "id", "--num-lanes", str(args.num_lanes),
            "--seed", "0", "--overwrite", "--max-reject-fraction", "0.05", *extra,
        ])
        shard.run_shard(options, pipeline_args, on_summary=lambda summary, name=name: print(
            f"   {name}: " + summary.text().replace("\n", "\n   ")))

    _say("3. inspecting", timer, "inspect")
    for name in ("prose", "code"):
        inspect_dataset.main([os.path.join(datasets, name)])

    _say("4. streaming a 0.7/0.3 mix with online tokenization and concat packing", timer, "stream")
    config_path = os.path.join(out, "loader.json")
    with open(config_path, "w") as fh:
        json.dump({
            "datasets": [
                {"path": os.path.join(datasets, "prose"), "weight": 0.7},
                {"path": os.path.join(datasets, "code"), "weight": 0.3},
            ],
            "seq_len": 256, "global_batch_size": 16, "micro_batch_size": 4, "seed": 1234,
            "tokenizer": tokenizer, "packing": "concat", "num_workers": 0,
        }, fh, indent=1)
    config = LoaderConfig.from_file(config_path)
    reference, _ = collect_fingerprints(config, world_size=1, end_step=args.steps)
    for line in reference:
        print("   " + line.line())
    elastic, _ = collect_fingerprints(
        config.replace(num_workers=2, micro_batch_size=2), world_size=4, end_step=args.steps
    )
    same = [a.line() == b.line() for a, b in zip(reference, elastic)]
    print(f"   4 ranks x 2 workers, micro-batch 2: {sum(same)}/{len(same)} steps identical to 1 rank")

    _say("5. checkpoint at step 3 on 4 ranks, resume on 2 ranks", timer, "checkpoint and resume")
    cut = min(3, args.steps - 1)
    _, state = collect_fingerprints(config, world_size=4, end_step=cut, save_state_step=cut)
    state_path = os.path.join(out, f"state-step{cut}.json")
    with open(state_path, "w") as fh:
        json.dump(state, fh)
    resumed, _ = collect_fingerprints(
        config, world_size=2, start_step=cut, end_step=args.steps, load_state=state
    )
    same_resume = [a.line() == b.line() for a, b in zip(reference[cut:], resumed)]
    print(f"   state: {os.path.getsize(state_path)} bytes of JSON at {state_path}")
    print(f"   resumed steps {cut}..{args.steps - 1}: {sum(same_resume)}/{len(same_resume)} identical")
    _took(timer)
    print("\nstage times:\n" + timer.table())
    print(f"\ndone in {time.monotonic() - started:.1f} s; loader config: {config_path}")
    print(next_steps(out, config_path, args.num_lanes))
    ok = all(same) and all(same_resume)
    if not ok:
        print("ERROR: fingerprints differ; please report this with the output above", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
