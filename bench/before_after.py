"""Before / after loader throughput: an old commit against the current tree, in one run (issue 17).

    python -m bench.before_after                     # old = 576b270 (the landed code before the
                                                     # per-token-features refactor), 4 cases, 7 rounds
    python -m bench.before_after --old REV --cases pre_concat_k0,pre_concat_k2 --rounds 9 --epochs 4
    python -m bench.before_after --check-only        # worktree, data and the two checks, no timing
    python -m bench.before_after --new HEAD          # the last commit (a worktree too) instead of
                                                     # the working tree, e.g. while it is mid-edit

Run it from the repository root with the project's interpreter; both trees run under that
interpreter (``--python``), each with ``PYTHONPATH`` set to its own root only.

1. **Old tree**: the commit checked out by ``git worktree add --detach`` under
   ``bench/_work/before_after/tree-<sha7>`` (git-ignored; reused when present, refused when
   its HEAD is not the commit or its files differ from it); the new tree is this checkout's
   working tree as it is (uncommitted changes included, said in the report), or with ``--new
   REV`` a worktree of that commit. Nothing else in git is touched.
2. **Data**: built once by the current Beam job (``bench.loader_throughput.build_datasets``,
   cached in ``bench/_work/loader_throughput/``); both trees read the same lane files.
3. **Checks**, one fresh process per tree: ``loader`` and ``bench.loader_throughput`` must be
   imported from that tree (``__file__`` printed; worker processes get the parent's
   ``sys.path`` in both trees), and the first ``CHECK_MICRO_BATCHES`` micro-batches of every
   packing the cases use must have the same fingerprint and the same fields in both trees:
   the old loader reads what the new job writes, the two deliver the same stream, and the
   consuming loop touches the same tensors. The run stops if any of this fails.
4. **Cases** (names as in ``bench/loader_throughput.py``): each tree runs its own
   ``bench/loader_throughput.py`` loader child (``child_loader`` of that commit, called as its
   ``--child`` does) for ``--epochs`` epochs' worth of tokens, a fresh process per run through
   the shared :class:`bench.compare.Runner`; every run reports the ``loader`` it imported and
   is refused if it is not its tree's. Every round runs each case in both trees back to back,
   the order flipped every round (old, new / new, old), so that load drifting on the machine
   hits both trees alike.
5. **Report**: tokens/s after the first micro-batch, ``(tokens - first micro-batch) /
   (seconds - start-up)``; with workers that is after they are ready in both trees: the old
   loader's first micro-batch waits for its workers, a loader with a warm start
   (``wait_for_workers``) waits for them before the child's clock starts (see ``_CHILD``). Per
   case: the median of each tree, new/old within each round (same load) with its median and
   range, the same for tokens per CPU second (main process plus workers), and one GOAL line,
   median new/old >= ``GOAL_RATIO``. The machine line with the load average is printed at the
   start and the end; everything is also saved to
   ``bench/_work/before_after/results-<old sha7>-<new sha7 or working-tree>.json``.

Reading the numbers: a 3% goal needs a quiet machine. With other work on the cores the
per-round ratios spread widely (their min-max is printed for that reason) and tokens per CPU
second is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from bench import loader_throughput as lt
from bench.compare import REPO, Runner, code_version
from bench.machine import load_average, machine_line

WORK = os.path.join(REPO, "bench", "_work", "before_after")
DEFAULT_OLD = "576b270"
GOAL_RATIO = 0.97  # issue 17: throughput within 3% of the landed code
CHECK_MICRO_BATCHES = 8
CHILD_TIMEOUT_S = 600.0
# case -> (dataset, packing, num_workers); names as in bench/loader_throughput.py
CASES = {
    "pre_concat_k0": ("pre", "concat", 0),
    "pre_concat_k2": ("pre", "concat", 2),
    "pre_best_fit_k0": ("pre", "best_fit", 0),
    "pre_best_fit_k2": ("pre", "best_fit", 2),
    "text_concat_k0": ("text", "concat", 0),
    "text_concat_k2": ("text", "concat", 2),
    "pre_concat_ids_k0": ("pre", "concat", 0),
}
# Cases whose micro-batches hold only some fields (``batch_fields``; default: all four).
CASE_FIELDS = {"pre_concat_ids_k0": ["input_ids"]}
DEFAULT_CASES = ("pre_concat_k0", "pre_concat_k2", "pre_best_fit_k0", "pre_best_fit_k2")
TREES = ("old", "new")


@dataclass(frozen=True)
class Tree:
    label: str  # "old" or "new"
    root: str
    version: str  # commit, and for the current tree whether loader/ has uncommitted changes

    def env(self, base: dict) -> dict:
        """``base`` with PYTHONPATH naming this tree only (the runner's names the current one)."""
        return dict(base, PYTHONPATH=self.root)

    def child_command(self, python: str, spec: dict) -> list[str]:
        return [python, "-c", _CHILD, self.root, json.dumps(spec)]


# The tree's own bench/loader_throughput.py child, run as its ``--child`` does (repo root first on
# sys.path, then CHILDREN[kind]), with one addition: a loader that has ``wait_for_workers`` (the
# warm start: until its workers have started, the trainer's process produces the items itself)
# waits for them right after construction, which the child does not time. Without this its
# timed window would hold the workers' start-up (imports on the same cores, items made
# in-process meanwhile), which the old loader spends before its first micro-batch.
_CHILD = r"""
import json, sys
root, spec = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, root)
from bench import loader_throughput as lt
import loader.pipeline as pipeline
waits = hasattr(pipeline.ZephonLoader, "wait_for_workers")
if waits:
    class ReadyLoader(pipeline.ZephonLoader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.wait_for_workers()
    pipeline.ZephonLoader = ReadyLoader  # child_loader imports it from loader.pipeline when called
result = lt.CHILDREN[spec.pop("kind")](**spec)
print("RESULT " + json.dumps({**result, "waited_for_workers": waits, "loader_file": pipeline.__file__}))
"""


# --------------------------------------------------------------------------------------
# Arguments and plan (pure: tested in tests/bench/test_before_after_plumbing.py).


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.before_after", description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default=DEFAULT_OLD, help=f"the commit to compare against (default {DEFAULT_OLD})")
    parser.add_argument("--new", default=None,
                        help="a commit to measure instead of the working tree (also in a worktree): a stable "
                             "snapshot while the working tree is being edited")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, of {', '.join(CASES)} (default: the pre-tokenized ones)")
    parser.add_argument("--rounds", type=int, default=7, help="runs per case and tree, interleaved (default 7)")
    parser.add_argument("--epochs", type=float, default=float(lt.PRE_EPOCHS),
                        help=f"epochs' worth of tokens per run (default {lt.PRE_EPOCHS}, as bench/loader_throughput.py)")
    parser.add_argument("--docs", type=int, default=20000, help="documents of the pre-tokenized dataset (default 20000)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for both trees (default: this one)")
    parser.add_argument("--check-only", action="store_true", help="worktree, data and checks; no timed runs")
    a = parser.parse_args(argv)
    a.cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in a.cases if c not in CASES]
    if unknown or not a.cases:
        parser.error(f"--cases {','.join(unknown) or '(empty)'}: unknown; known: {', '.join(CASES)}")
    if a.rounds < 1:
        parser.error(f"--rounds must be >= 1 (got {a.rounds})")
    if not a.epochs > 0:
        parser.error(f"--epochs must be > 0 (got {a.epochs})")
    if a.docs < 4:
        parser.error(f"--docs must be >= 4 (got {a.docs}): the text dataset has docs // 4 documents")
    return a


def schedule(cases: list[str], rounds: int) -> list[tuple[int, str, str]]:
    """(round, case, tree) in run order: every case once per round in both trees back to back,
    the pair's order flipped each round (old, new / new, old) so neither tree always runs first."""
    order = []
    for rnd in range(rounds):
        pair = TREES if rnd % 2 == 0 else TREES[::-1]
        order += [(rnd, case, tree) for case in cases for tree in pair]
    return order


def steady_rate(run: dict, first_tokens: int) -> float:
    """Tokens/s after the first micro-batch (start-up: workers spawned, first blocks read)."""
    return (run["tokens"] - first_tokens) / (run["seconds"] - run["startup_s"])


def cpu_rate(run: dict) -> float:
    """Tokens per CPU second of the whole run (the process and its joined workers)."""
    return run["tokens"] / run["cpu_s"]


def summarize(old: list[Optional[dict]], new: list[Optional[dict]], first_tokens: int,
              goal: float = GOAL_RATIO) -> dict:
    """Medians per tree and new/old per round. ``old[i]`` and ``new[i]`` ran back to back in
    round i (None or an ``error`` dict: failed). Rounds where either failed give no ratio."""
    ok = lambda r: r is not None and "error" not in r  # noqa: E731
    pairs = [(o, n) for o, n in zip(old, new) if ok(o) and ok(n)]
    out: dict = {"rounds": len(old), "pairs": len(pairs),
                 "errors": [r["error"] for r in old + new if r is not None and "error" in r]}
    if not pairs:
        out["status"] = "NO DATA"
        return out
    ratios = [steady_rate(n, first_tokens) / steady_rate(o, first_tokens) for o, n in pairs]
    old_rates = [steady_rate(r, first_tokens) for r in old if ok(r)]
    new_rates = [steady_rate(r, first_tokens) for r in new if ok(r)]
    out.update({
        "old_tokens_per_s": statistics.median(old_rates), "new_tokens_per_s": statistics.median(new_rates),
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "ratio_of_medians": statistics.median(new_rates) / statistics.median(old_rates),
        "cpu_ratio": statistics.median(cpu_rate(n) / cpu_rate(o) for o, n in pairs),
        "old_startup_s": statistics.median(r["startup_s"] for r in old if ok(r)),
        "new_startup_s": statistics.median(r["startup_s"] for r in new if ok(r)),
    })
    out["status"] = "PASS" if out["ratio"] >= goal else "FAIL"
    return out


def report(summaries: dict[str, dict], goal: float = GOAL_RATIO) -> list[str]:
    lines = ["| case | old tok/s (median) | new tok/s (median) | new/old per round: median (min-max) | "
             "ratio of medians | new/old tok per CPU s | start-up old / new s | pairs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for case, s in summaries.items():
        if s["status"] == "NO DATA":
            lines.append(f"| {case} | FAILED: {(s['errors'] or ['?'])[0][:120]} | | | | | | 0 |")
            continue
        lines.append(
            f"| {case} | {s['old_tokens_per_s'] / 1e6:.2f} M | {s['new_tokens_per_s'] / 1e6:.2f} M | "
            f"{s['ratio']:.3f} ({s['ratio_min']:.3f}-{s['ratio_max']:.3f}) | {s['ratio_of_medians']:.3f} | "
            f"{s['cpu_ratio']:.3f} | {s['old_startup_s']:.2f} / {s['new_startup_s']:.2f} | {s['pairs']}/{s['rounds']} |")
    lines.append("")
    for case, s in summaries.items():
        ratio = f"{s['ratio']:.3f}" if "ratio" in s else "-"
        lines.append(f"GOAL {case} new/old >= {goal}: {ratio} {s['status']}")
    return lines


# --------------------------------------------------------------------------------------
# The old tree, the data, the checks.


def git(*args: str, cwd: str = REPO) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} (in {cwd}) failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def worktree(label: str, rev: str) -> Tree:
    """The commit in a worktree under bench/_work/before_after/ (added once, then reused)."""
    sha = git("rev-parse", "--verify", rev + "^{commit}")
    root = os.path.join(WORK, f"tree-{sha[:7]}")
    if not os.path.exists(root):
        os.makedirs(WORK, exist_ok=True)
        git("worktree", "add", "--detach", root, sha)
    head = git("rev-parse", "HEAD", cwd=root)
    if head != sha:
        raise SystemExit(f"{root} is at {head[:7]}, not {sha[:7]}: remove it (git worktree remove) and rerun")
    dirty = git("status", "--porcelain", cwd=root)
    if dirty:
        raise SystemExit(f"{root} differs from {sha[:7]}:\n{dirty}\nrestore it (git -C {root} checkout -- .) and rerun")
    return Tree(label, root, f"{sha[:7]} ({git('log', '-1', '--format=%s', sha)[:70]})")


def datasets_for(cases: list[str], docs: int) -> dict[str, tuple[str, str]]:
    """Dataset kind -> (lane dataset, dataset whose manifest gives the token count): the text
    lanes' manifest has no token counts, their pre-tokenized twin does (as in loader_throughput)."""
    kinds = {CASES[c][0] for c in cases}
    out = {}
    if "pre" in kinds:
        pre = str(lt._dataset_dir(docs, True, "beam"))
        out["pre"] = (pre, pre)
    if "text" in kinds:
        out["text"] = (str(lt._dataset_dir(docs // 4, False, "beam")), str(lt._dataset_dir(docs // 4, True, "beam")))
    return out


def build_data(cases: list[str], docs: int) -> None:
    wanted = []
    if any(CASES[c][0] == "pre" for c in cases):
        wanted.append((docs, True, lt.NUM_LANES))
    if any(CASES[c][0] == "text" for c in cases):
        wanted += [(docs // 4, False, lt.NUM_LANES), (docs // 4, True, lt.NUM_LANES)]
    lt.WORK_DIR.mkdir(parents=True, exist_ok=True)
    lt.build_datasets(docs, "beam", datasets=wanted)


_CHECK = r"""
import hashlib, json, sys
root, streams, micro_batches = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, root)  # what bench/loader_throughput.py does before it imports loader
import loader
from bench import loader_throughput as lt
from loader.pipeline import ZephonLoader
out = {"loader_file": loader.__file__, "bench_file": lt.__file__, "throughput": lt.THROUGHPUT, "streams": {}}
for name, (dataset, packing) in streams.items():
    digest, fields = hashlib.sha256(), None
    zl = ZephonLoader(lt._config(dataset, lt.THROUGHPUT, packing=packing, num_workers=0))
    for _ in range(micro_batches):
        batch = next(zl)
        fields = sorted(batch)
        for key in fields:
            value = batch[key]
            digest.update(key.encode() + (value.numpy().tobytes() + str(value.dtype).encode()
                                          if hasattr(value, "numpy") else repr(value).encode()))
    zl.close()
    out["streams"][name] = {"fingerprint": digest.hexdigest()[:16], "fields": fields}
print("RESULT_JSON: " + json.dumps(out))
"""


def under(path: str, root: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def check(r: Runner, python: str, trees: dict[str, Tree], cases: list[str], data: dict) -> dict:
    """Both trees import their own code and deliver the same stream on the same lane files."""
    streams = {f"{kind}/{packing}": (data[kind][0], packing) for kind, packing, _ in sorted({CASES[c] for c in cases})}
    got = {}
    for label, tree in trees.items():
        res = r.run_command([python, "-c", _CHECK, tree.root, json.dumps(streams), str(CHECK_MICRO_BATCHES)],
                            CHILD_TIMEOUT_S, cwd=tree.root, env=tree.env(r.env))
        if "error" in res:
            raise SystemExit(f"check of the {label} tree failed: {res['error']} (log: {r.log.name})")
        for key in ("loader_file", "bench_file"):
            if not under(res[key], tree.root):
                raise SystemExit(f"the {label} tree imported {res[key]}, not a file under {tree.root}")
        print(f"[check] {label}: loader from {res['loader_file']}, bench from {res['bench_file']}", flush=True)
        got[label] = res
    if got["old"]["throughput"] != got["new"]["throughput"]:
        raise SystemExit(f"THROUGHPUT shapes differ: old {got['old']['throughput']}, new {got['new']['throughput']}")
    for name in streams:
        old, new = got["old"]["streams"][name], got["new"]["streams"][name]
        if old != new:
            raise SystemExit(f"{name}: the trees deliver different micro-batches (old {old}, new {new}): "
                             "not the same work, so no throughput comparison")
        print(f"[check] {name}: first {CHECK_MICRO_BATCHES} micro-batches identical in both trees "
              f"(fingerprint {new['fingerprint']}, fields {','.join(new['fields'])})", flush=True)
    return got


# --------------------------------------------------------------------------------------
# The run.


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    command = "python -m bench.before_after" + "".join(" " + shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    os.makedirs(WORK, exist_ok=True)
    r = Runner(a.python, os.path.join(WORK, "before_after.log"))
    trees = {"old": worktree("old", a.old),
             "new": worktree("new", a.new) if a.new else Tree("new", REPO, code_version())}
    print(f"[before_after] {command}", flush=True)
    print(f"[before_after] {machine_line(load=True)}", flush=True)
    print(f"[before_after] interpreter {a.python}; log {r.log.name}", flush=True)
    for tree in trees.values():
        print(f"[before_after] {tree.label}: {tree.version} at {tree.root}", flush=True)
    build_data(a.cases, a.docs)
    data = datasets_for(a.cases, a.docs)
    shape = check(r, a.python, trees, a.cases, data)["new"]["throughput"]
    if a.check_only:
        return 0
    per_step = shape["seq_len"] * shape["global_batch_size"]
    first_tokens = shape["seq_len"] * shape["micro_batch_size"]
    specs = {}
    for case in a.cases:
        kind, packing, workers = CASES[case]
        tokens = lt._dataset_tokens(data[kind][1])
        steps = max(2, int(a.epochs * tokens) // per_step)
        specs[case] = {"kind": "loader", "dataset": data[kind][0], "packing": packing, "num_workers": workers,
                       "steps": steps, **({"batch_fields": CASE_FIELDS[case]} if case in CASE_FIELDS else {})}
        print(f"[before_after] {case}: {steps} steps x {per_step:,} tokens ({a.epochs:g} epochs of "
              f"{tokens:,} tokens), {workers} workers, {packing}", flush=True)
    results: dict[str, dict[str, list]] = {c: {t: [None] * a.rounds for t in TREES} for c in a.cases}
    t0 = time.perf_counter()
    for rnd, case, label in schedule(a.cases, a.rounds):
        tree = trees[label]
        res = r.run_command(tree.child_command(a.python, specs[case]), CHILD_TIMEOUT_S, cwd=tree.root,
                            env=tree.env(r.env), prefix="RESULT ")
        if "error" not in res and not under(res["loader_file"], tree.root):
            res = {"error": f"imported {res['loader_file']}, not the {label} tree's loader"}
        results[case][label][rnd] = res
        shown = res["error"] if "error" in res else (
            f"{steady_rate(res, first_tokens) / 1e6:7.2f} M tok/s, {cpu_rate(res) / 1e6:6.2f} M tok/CPU s, "
            f"start-up {res['startup_s']:.2f} s" + (", after wait_for_workers" if res["waited_for_workers"]
                                                    and specs[case]["num_workers"] else ""))
        print(f"  [{rnd + 1}/{a.rounds}] {case:16s} {label}: {shown}  (load {load_average()})", flush=True)
    summaries = {c: summarize(results[c]["old"], results[c]["new"], first_tokens) for c in a.cases}
    minutes = (time.perf_counter() - t0) / 60
    print(f"\nold = {trees['old'].version}; new = {trees['new'].version}. Tokens/s after the first micro-batch, "
          f"{a.rounds} round(s), old/new back to back in each (order flipped every round), {minutes:.1f} min.")
    print("\n".join(report(summaries)))
    print(f"[before_after] at the end: {machine_line(load=True)}", flush=True)
    new_name = os.path.basename(trees["new"].root)[5:] if a.new else "working-tree"
    out = os.path.join(WORK, f"results-{os.path.basename(trees['old'].root)[5:]}-{new_name}.json")
    with open(out, "w") as fh:
        json.dump({"command": command, "trees": {k: vars(v) for k, v in trees.items()}, "specs": specs,
                   "results": results, "summaries": summaries}, fh, indent=1)
    print(f"[before_after] saved {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
