"""Loader throughput (issue 3): tokens/s into a training loop, against two floors, in one run.

    python bench/loader_throughput.py [--quick] [--repeats 3] [--docs 20000] [--only CASE ...]

Data: the sample corpus (:mod:`loader.samples.corpus`, JSONL) sharded by the Beam job
(``python -m beam_jobs.shard``), pre-tokenized or as text; cached under
``bench/_work/loader_throughput/`` (``--writer factory`` uses ``tests.dataset_factory``
instead, for when the Beam job is unavailable). ``--docs D`` (default 20,000; quick 4,000):

* D documents, 16 lanes, pre-tokenized: the scan floor and the pre-tokenized loader runs;
* D/4 documents, 16 lanes, text: the tokenizer floor and the online-tokenization runs (its
  pre-tokenized twin only supplies the token count);
* D/4 and 10 x D/4 documents, 4 lanes, pre-tokenized: the RSS pair (4 lanes so that even
  the small one fills whole 1 MiB row groups, the Beam job's cap: below the cap a row group,
  and with it the loader's memory, grows with the data, which is not the question here).

Every measurement runs in a fresh Python process (imports and loader construction are not
timed) and the report gives the median of ``--repeats``; the cases are interleaved round by
round so that load from other work on the machine spreads over all of them. Next to wall
time each child reports its CPU time (its own plus its worker processes'): on a shared
machine ``tokens / CPU s`` is the steadier number, wall time is what the goals use.

Cases and goals:

* ``scan``       floor (a): bare pyarrow scan of the pre-tokenized lane files (every row
                 group's ``input_ids``, flattened to numpy, tokens counted; ``use_threads=False``,
                 which is faster for a single column, as the loader reads), whole passes
                 repeated for at least ``SCAN_MIN_SECONDS``. ``scan_crc``: the same with page
                 checksums verified, which the loader always does (reported, no goal).
* ``tokenizer``  floor (b): ``Tokenizer.encode_batch_fast`` on the same documents, one call
                 per row group (texts already in memory), on the tokenizer's default thread
                 pool (one thread per core).
* ``pre_concat_k0`` / ``_k2``   the loader on the pre-tokenized lanes, concat packing,
                 ``num_workers`` 0 / 2. Goal: k0 >= 0.75 x scan (issue 35).
* ``pre_best_fit_k0``           the same with best-fit packing (reported, no goal).
* ``pre_concat_ids_k0``         ``pre_concat_k0`` delivering ``input_ids`` only
                 (``batch_fields``): the token ids the scan floor delivers. Goal: >= 0.9 x scan (issue 35).
* ``pre_concat_k0_hash`` / ``_nochecks``   issue 14: ``pre_concat_k0`` (the defaults: the
                 footer, row-group and token checks on) with the full-file SHA-256 of local lane
                 files (``verify_local_files = true``), and without any lane-file check (the
                 footer, row-group, token and unlisted-file checks made no-ops in the child);
                 ``_1epoch`` pairs: one epoch instead of ``PRE_EPOCHS``, the hash's worst case
                 (it is paid once per file and process); ``pre_concat_k0_hash_1epoch`` also
                 reports the CPU time spent inside the checks (timed per call, on every thread),
                 which does not depend on the machine's load as wall-time ratios do. Ratios
                 within each round, median over rounds; run them alone with
                 ``--only scan pre_concat_k0``.
* ``pre_concat_k0_identity`` / ``pre_concat_k2_identity``   issue 19: ``pre_concat_k0`` / ``_k2``
                 with the built-in ``identity`` transform (one Python call per document, tokens
                 stage): its cost per document, as the median of within-round ratios to the run
                 without it. Goal (reported in the ratio rows): >= 0.95.
* ``text_concat_k0`` / ``_k2``  the loader on the text lanes (online tokenization). Goal:
                 k0 >= 0.8 x tokenizer (same cores: the in-process loader tokenizes on the
                 same thread pool as the floor); k2 reported.
* ``chat_floor`` floor (c), issue 17: a bare loop over an online chat dataset's conversations
                 (``--docs / 8`` generated multi-turn conversations, ``tests/chat/chat_factory``,
                 sharded without ``--tokenizer``): the ChatML test template's plain render of each,
                 then ``encode_batch_fast`` per row group, the conversations parsed beforehand
                 (:func:`bench.floors.chat_floor`), timed after its set-up (imports, tokenizer,
                 template compile) as the loader runs are timed after construction.
* ``chat_concat_k0`` / ``chat_best_fit_k0``   the loader on that dataset: online render (with
                 the assistant spans), tokenization (byte-level BPE: ``encode_batch_fast`` and
                 token byte ends from the ids; parts of a row group's renders tokenized on a
                 helper thread while the rest render, ``loader.chat.encode.TOKENIZE_PART_CHARS``),
                 loss masks and guards (:mod:`loader.chat.block`), packing. Goal: chat_concat_k0 >= 0.8 x chat_floor (tokens: conversation ids
                 plus one EOS each; the best-fit row also counts its padding, reported without
                 a goal). Its offline twin (``--tokenizer``) only supplies the token count.
                 ``CHAT_EPOCHS`` epochs, timed after one more epoch of untimed warm-up
                 (``warmup_steps``): row groups read ahead are encoded ahead on the prepare
                 thread (``loader.io.read_ahead.prepare_later``), two per lane, so a window
                 started cold would also pay for the two lane-epochs prepared for after its
                 end (at ``--docs 8000`` a lane's epoch is one row group: +25% of the work);
                 after the warm-up the window's start holds as much prepared work as its end,
                 as in a long run. Before that change (no prepare thread) 2 epochs encoded 39
                 row groups for 32 delivered (+23%), 8 epochs 138 for 128 (+8%).
* ``restore``    seconds from ``load_state_dict`` to the first batch, with states saved at
                 step 10 and step 10,000 of a small-sequence run (seq_len 32, one sequence
                 per lane per step, so 10,000 steps are cheap to reach). Goal, pre-tokenized
                 lanes, num_workers 0: step 10,000 <= 1.5 x step 10 (restore seeks, it does
                 not replay). Also reported: num_workers 2, and text lanes (the cursor is a
                 token offset in a row group, so a text restore tokenizes the group's
                 documents before it).
* ``rss``        peak RSS (``ru_maxrss``) of a process that reads the N and the 10N dataset
                 (one epoch, at most ``RSS_MAX_TOKENS``). Goal: 10N within 1.10 x N. The
                 growth above the process's RSS after its imports (torch included) is shown
                 too.

The loader runs use seq_len 2048, global batch 32, micro-batch 8, one rank, and deliver
``PRE_EPOCHS`` / ``TEXT_EPOCHS`` epochs' worth of tokens: lanes hold different token counts,
so when the run stops some lanes have read (and tokenized) part of a row group they did not
use, an overshoot of at most a row group per lane that a run of several epochs makes small,
as in training. The first micro-batch (start-up: workers spawn, first blocks read) is timed
as part of the run and also shown apart. The consuming loop sums every tensor of every
micro-batch. Delivered tokens are ``input_ids.numel()``: they include one EOS per document
(~0.2% more than the floors count).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

# Only the standard library at module level: worker processes (spawn) re-import this file.
REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_DIR = REPO_ROOT / "bench" / "_work" / "loader_throughput"
TOKENIZER = str(REPO_ROOT / "beam_jobs" / "assets" / "tokenizer.json")
NUM_LANES = 16
RSS_LANES = 4
SEED = 0

THROUGHPUT = {"seq_len": 2048, "global_batch_size": 32, "micro_batch_size": 8}
RESTORE = {"seq_len": 32, "global_batch_size": NUM_LANES, "micro_batch_size": NUM_LANES}
RESTORE_STEPS = (10, 10_000)
PRE_EPOCHS = 2
TEXT_EPOCHS = 2
RSS_MAX_TOKENS = 8_000_000
SCAN_MIN_SECONDS = 1.0

# Issue 35: in-process replay against the scan floor of the same lane files, full batch (labels,
# position_ids, cu_seqlens) and input_ids only.
GOAL_SCAN_RATIO = 0.75
GOAL_SCAN_IDS_RATIO = 0.9
GOAL_TOKENIZER_RATIO = 0.8
GOAL_RESTORE_RATIO = 1.5
GOAL_RSS_RATIO = 1.10
# Chat (issue 17): the conversations of tests/chat/chat_factory, rendered with its ChatML template.
CHAT_TEMPLATE = str(REPO_ROOT / "tests" / "chat" / "templates" / "chatml_generation.jinja")
CHAT_EPOCHS = 8  # see the docstring: 2 epochs left the end-of-run overshoot at +23% of the work
GOAL_CHAT_RATIO = 0.8


# ---------------------------------------------------------------------------------------
# Data (built once, cached)


def _dataset_dir(docs: int, pretokenized: bool, writer: str, lanes: int = NUM_LANES) -> Path:
    suffix = "" if lanes == NUM_LANES else f"_L{lanes}"
    return WORK_DIR / f"{writer}_{docs}_{'pre' if pretokenized else 'text'}{suffix}"


def _datasets(docs: int) -> list[tuple[int, bool, int]]:
    """(documents, pre-tokenized, lanes) of every dataset the run needs."""
    return [(docs, True, NUM_LANES), (docs // 4, False, NUM_LANES), (docs // 4, True, NUM_LANES),
            (docs // 4, True, RSS_LANES), (docs * 10 // 4, True, RSS_LANES)]


def build_datasets(docs: int, writer: str, datasets=None) -> None:
    """Every dataset of ``_datasets(docs)``, or only ``datasets`` (``bench.before_after``)."""
    from loader.samples.corpus import make_sample

    for count, pretokenized, lanes in datasets or _datasets(docs):
        out = _dataset_dir(count, pretokenized, writer, lanes)
        if (out / "manifest.json").exists():
            continue
        corpus = WORK_DIR / f"corpus_{count}"
        if not (corpus / "done").exists():
            make_sample(str(corpus), num_docs=count, seed=SEED, formats=("jsonl",))
            (corpus / "done").write_text("")
        print(f"building {out.name} ({writer}) ...", flush=True)
        if writer == "beam":
            cmd = [sys.executable, "-m", "beam_jobs.shard", "--input", str(corpus / "*" / "*.jsonl"),
                   "--output", str(out), "--num-lanes", str(lanes), "--seed", str(SEED),
                   "--id-field", "id", "--overwrite",
                   "--max-reject-fraction", "0.05"]  # the sample corpus has ~1% empty documents
            if pretokenized:
                cmd += ["--tokenizer", TOKENIZER]
            subprocess.run(cmd, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
        else:
            _factory_dataset(corpus, out, pretokenized, lanes)


def _chat_dataset_dir(docs: int, pretokenized: bool) -> Path:
    return WORK_DIR / f"chat_{docs // 8}_{'pre' if pretokenized else 'online'}"


def build_chat_datasets(docs: int) -> None:
    """``docs // 8`` generated conversations, sharded by the Beam job online and pre-tokenized."""
    conversations = docs // 8
    corpus = WORK_DIR / f"chat_corpus_{conversations}.jsonl"
    if not corpus.exists():
        from tests.chat.chat_factory import make_records

        corpus.write_text("".join(json.dumps(r) + "\n" for r in make_records(SEED, conversations)))
    for pretokenized in (False, True):
        out = _chat_dataset_dir(docs, pretokenized)
        if (out / "manifest.json").exists():
            continue
        print(f"building {out.name} ...", flush=True)
        cmd = [sys.executable, "-m", "beam_jobs.shard", "--input", str(corpus), "--output", str(out),
               "--num-lanes", str(NUM_LANES), "--seed", str(SEED), "--messages-field", "messages",
               "--chat-template", CHAT_TEMPLATE, "--overwrite", "--max-reject-fraction", "0.2"]
        if pretokenized:
            cmd += ["--tokenizer", TOKENIZER]
        subprocess.run(cmd, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)


def _factory_dataset(corpus: Path, out: Path, pretokenized: bool, lanes: int) -> None:
    from tokenizers import Tokenizer

    from tests.dataset_factory import write_dataset

    texts, keys = [], []
    for path in sorted(corpus.glob("*/*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["text"].strip():
                texts.append(record["text"])
                keys.append(record["id"])
    write_dataset(str(out), texts, keys=keys, num_lanes=lanes, seed=SEED, row_group_rows=1024,
                  tokenizer=Tokenizer.from_file(TOKENIZER) if pretokenized else None)


def _manifest(dataset: str) -> dict:
    return json.loads(Path(dataset, "manifest.json").read_text())


def _lane_files(dataset: str) -> list[str]:
    return [str(Path(dataset, f["path"])) for f in _manifest(dataset)["files"] if f["rows"] > 0]


def _dataset_tokens(dataset: str) -> int:
    return sum(f["tokens"] or 0 for f in _manifest(dataset)["files"])


# ---------------------------------------------------------------------------------------
# Children: one measurement each, in a fresh process; print one RESULT line


class _Clock:
    """Wall time and CPU time (this process's threads plus its finished child processes)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), self._cpu()

    @staticmethod
    def _cpu() -> float:
        import resource

        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def read(self) -> dict:
        return {"seconds": time.perf_counter() - self.wall, "cpu_s": self._cpu() - self.cpu}


def child_scan(dataset: str, page_checksums: bool = False) -> dict:
    clock = _Clock()
    tokens = 0
    # Whole passes until SCAN_MIN_SECONDS: one pass over the lz4 token column takes ~0.1 s,
    # too short a window to time on a shared machine (single passes varied 2x).
    while tokens == 0 or clock.read()["seconds"] < SCAN_MIN_SECONDS:
        tokens += _scan_pass(dataset, page_checksums)
    return {"tokens": tokens, **clock.read()}


def _scan_pass(dataset: str, page_checksums: bool) -> int:
    from bench.floors import scan_pass  # the one scan floor (also bench.compare's); repo root on sys.path

    return scan_pass(_lane_files(dataset), page_checksums)


def child_tokenizer(dataset: str) -> dict:
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(TOKENIZER)
    batches = []
    for path in _lane_files(dataset):
        parquet = pq.ParquetFile(path)
        for group in range(parquet.metadata.num_row_groups):
            batches.append(parquet.read_row_group(group, columns=["text"]).column(0).to_pylist())
    clock = _Clock()
    tokens = 0
    for texts in batches:
        tokens += sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False))
    return {"tokens": tokens, **clock.read()}


def child_chat_floor(dataset: str) -> dict:
    from bench.floors import chat_floor, chat_row_groups  # the one chat floor; repo root on sys.path

    groups = chat_row_groups(_lane_files(dataset), max_docs=1 << 30)
    # Timed by chat_floor after its set-up (imports, tokenizer, template compile: ~0.2 CPU s, a
    # fifth of a pass here), as the loader runs are timed after the loader is built.
    result = chat_floor(TOKENIZER, CHAT_TEMPLATE, groups, min_seconds=SCAN_MIN_SECONDS)
    return {key: result[key] for key in ("tokens", "seconds", "cpu_s")}


def _config(dataset: str, shape: dict, **overrides):
    from loader.config import LoaderConfig

    return LoaderConfig.from_dict({"datasets": [{"path": dataset}], "seed": SEED, "tokenizer": TOKENIZER,
                                   **shape, **overrides})


def _consume(batch) -> int:
    """What a training loop does at least: touch every tensor of the micro-batch."""
    import torch

    total = 0
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            total += int(value.sum())
    return total


def _integrity_bindings(names) -> list:
    """``(module, name)`` for every ``loader.io`` module that calls one of the integrity checks
    ``names`` by its own binding (``from loader.io.integrity import ...``): patching the
    integrity module alone would leave those bindings running. Raises if a check is bound
    nowhere, so that a move of the code cannot make a measurement silently patch nothing."""
    import importlib
    import pkgutil

    import loader.io
    from loader.io import integrity

    bindings, found = [], set()
    for info in pkgutil.iter_modules(loader.io.__path__):
        module = importlib.import_module(f"loader.io.{info.name}")
        for name in names:
            if module is not integrity and getattr(module, name, None) is getattr(integrity, name):
                bindings.append((module, name))
                found.add(name)
    missing = sorted(set(names) - found)
    if missing:
        raise RuntimeError(f"no loader.io module calls {missing}: update bench/loader_throughput.py")
    return bindings


INTEGRITY_CHECKS = ("check_footer", "check_row_group", "check_no_unlisted_files")


def _disable_integrity_checks() -> None:
    """The lane-file checks of issue 14 made no-ops (footer against the manifest, rows of every
    row group, tokens of every file, unlisted files): only for measuring their cost."""
    from loader.io.lane_files import LaneFiles

    for module, name in _integrity_bindings(INTEGRITY_CHECKS):
        setattr(module, name, lambda *args: None)
    LaneFiles.note_group_tokens = lambda self, *args: None


def _account_integrity_checks() -> dict:
    """Wrap the lane-file checks so that the CPU time spent inside them (on whichever thread:
    ``thread_time``) adds up in the returned dict: ``hash_cpu_s`` (the full-file SHA-256),
    ``checks_cpu_s`` (the rest). Exact attribution where wall-time ratios drown in load."""
    from loader.io.lane_files import LaneFiles

    spent = {"hash_cpu_s": 0.0, "checks_cpu_s": 0.0}

    def timed(fn, key):
        def wrapper(*args):
            start = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent[key] += time.thread_time() - start
        return wrapper

    for module, name in _integrity_bindings(("verify_local_file",)):
        setattr(module, name, timed(getattr(module, name), "hash_cpu_s"))
    for module, name in _integrity_bindings(INTEGRITY_CHECKS):
        setattr(module, name, timed(getattr(module, name), "checks_cpu_s"))
    LaneFiles.note_group_tokens = timed(LaneFiles.note_group_tokens, "checks_cpu_s")
    return spent


class _NoMetrics:
    """A metrics recorder that counts nothing (``metrics=False``: bench/metrics_overhead.py)."""

    copies_token_sources = False

    def count(self, items, batch, wait_s, rank_position) -> None:
        pass


METRICS_PROBE_CALLS = 16


def _probed_count(recorder, spent: dict):
    """``recorder.count`` that, after each real call, times ``METRICS_PROBE_CALLS`` calls of a
    twin recorder with the same items (so the clock's cost, ~1 us here, is spread over many
    calls) and adds the time per call to ``spent["metrics_s"]``: the accounting's cost on this
    run's real items, step ends included. Slows the run: its throughput is not compared."""
    import copy

    twin = copy.deepcopy(recorder)
    real = recorder.count

    def count(items, batch, wait_s, rank_position):
        real(items, batch, wait_s, rank_position)
        start = time.perf_counter()
        for _ in range(METRICS_PROBE_CALLS):
            twin.count(items, batch, wait_s, rank_position)
        spent["metrics_s"] += (time.perf_counter() - start) / METRICS_PROBE_CALLS
        spent["micro_batches"] += 1
    return count


def child_loader(dataset: str, packing: str, num_workers: int, steps: int, batch_fields=None,
                 verify_local_files: bool = None, integrity_checks: bool = True,
                 account_checks: bool = False, metrics: bool = True, account_metrics: bool = False,
                 transforms=None, warmup_steps: int = 0) -> dict:
    from loader.pipeline import ZephonLoader

    # Both only patch this process: the cases with them run with num_workers 0.
    if not integrity_checks:
        _disable_integrity_checks()
    spent = _account_integrity_checks() if account_checks else {}
    fields = {"batch_fields": batch_fields} if batch_fields else {}
    if verify_local_files is not None:
        fields["verify_local_files"] = verify_local_files
    if transforms:
        fields["transforms"] = transforms
    config = _config(dataset, THROUGHPUT, packing=packing, num_workers=num_workers, **fields)
    micro_batches = steps * config.global_batch_size // config.micro_batch_size
    loader = ZephonLoader(config)
    if not metrics:  # loader.metrics' accounting off (its two clock reads per micro-batch stay)
        loader._metrics = _NoMetrics()
    elif account_metrics:  # the accounting's own time, measured in place (bench/metrics_overhead.py)
        spent.update(metrics_s=0.0, micro_batches=0)
        loader._metrics.count = _probed_count(loader._metrics, spent)
    clock = _Clock()
    batch = next(loader)  # start-up: workers spawn, the first lanes' first blocks are read
    _consume(batch)
    startup = clock.read()["seconds"]
    tokens = batch["input_ids"].numel()
    if warmup_steps:  # untimed: the window starts in the steady state (see the chat cases)
        for _ in range(warmup_steps * config.global_batch_size // config.micro_batch_size):
            _consume(next(loader))
        clock, tokens = _Clock(), 0
    for _ in range(micro_batches - 1):
        batch = next(loader)
        _consume(batch)
        tokens += batch["input_ids"].numel()
    seconds = clock.read()["seconds"]
    loader.close()  # joins the workers, so that their CPU time is counted
    return {"tokens": tokens, **clock.read(), "seconds": seconds, "startup_s": startup, **spent}


def _state_path(dataset: str, step: int) -> Path:
    return WORK_DIR / f"state_{Path(dataset).name}_step{step}.json"


def child_make_states(dataset: str) -> dict:
    """Run the small-sequence config to the restore steps once and save the states (cached)."""
    from loader.pipeline import ZephonLoader
    from loader.checkpoint.state import dumps

    config = _config(dataset, RESTORE)
    clock = _Clock()
    with ZephonLoader(config) as loader:
        for step in range(max(RESTORE_STEPS) + 1):
            if step in RESTORE_STEPS:
                _state_path(dataset, step).write_text(dumps(loader.state_dict()))
            next(loader)
    return {**clock.read(), "steps": max(RESTORE_STEPS)}


def child_restore(dataset: str, step: int, num_workers: int) -> dict:
    from loader.pipeline import ZephonLoader
    from loader.checkpoint.state import loads

    config = _config(dataset, RESTORE, num_workers=num_workers)
    state = loads(_state_path(dataset, step).read_text())
    with ZephonLoader(config) as loader:
        clock = _Clock()
        loader.load_state_dict(state)
        batch = next(loader)
        seconds = clock.read()["seconds"]
        if batch["step"] != step:
            raise RuntimeError(f"restored at step {batch['step']}, expected {step}")
    return {"seconds": seconds}


def _peak_rss_mb(who: int) -> float:
    import resource

    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


def child_rss(dataset: str, num_workers: int) -> dict:
    import resource

    import torch  # noqa: F401 - imported before the baseline, as a trainer has it

    from loader.pipeline import ZephonLoader

    base = _peak_rss_mb(resource.RUSAGE_SELF)
    config = _config(dataset, THROUGHPUT, num_workers=num_workers)
    tokens = min(_dataset_tokens(dataset), RSS_MAX_TOKENS)
    micro_batches = max(1, tokens // (config.seq_len * config.micro_batch_size))
    with ZephonLoader(config) as loader:
        for _ in range(micro_batches):
            _consume(next(loader))
    return {
        "after_imports_mb": base,
        "peak_mb": _peak_rss_mb(resource.RUSAGE_SELF),
        "workers_peak_mb": _peak_rss_mb(resource.RUSAGE_CHILDREN) if num_workers else 0.0,
        "tokens": micro_batches * config.seq_len * config.micro_batch_size,
    }


CHILDREN = {
    "scan": child_scan, "tokenizer": child_tokenizer, "loader": child_loader, "chat_floor": child_chat_floor,
    "make_states": child_make_states, "restore": child_restore, "rss": child_rss,
}


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """``--repeats``, ``--only`` and the hidden ``--child`` of every bench script of this harness."""
    parser.add_argument("--repeats", type=int, default=None, help="repeats per case (default 3; quick 1)")
    parser.add_argument("--only", nargs="+", default=None, metavar="CASE", help="run only these cases (prefixes)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def child_main(children: dict, spec_text: str) -> int:
    """Run one ``--child`` case and print the ``RESULT`` line :func:`run_child` reads."""
    spec = json.loads(spec_text)
    result = children[spec.pop("kind")](**spec)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def run_child(kind: str, script: Optional[str] = None, **kwargs) -> dict:
    """Run child ``kind`` of ``script`` (default this file; bench/image_throughput.py shares it)."""
    cmd = [sys.executable, script or str(Path(__file__).resolve()), "--child", json.dumps({"kind": kind, **kwargs})]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {kwargs} failed:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


# ---------------------------------------------------------------------------------------
# Orchestration


def plan(docs: int, writer: str) -> dict[str, dict]:
    """Case name -> child arguments."""
    pre = str(_dataset_dir(docs, True, writer))
    text = str(_dataset_dir(docs // 4, False, writer))
    per_step = THROUGHPUT["seq_len"] * THROUGHPUT["global_batch_size"]
    pre_steps = max(2, PRE_EPOCHS * _dataset_tokens(pre) // per_step)
    text_steps = max(2, TEXT_EPOCHS * _dataset_tokens(str(_dataset_dir(docs // 4, True, writer))) // per_step)
    cases = {
        "scan": {"kind": "scan", "dataset": pre},
        "scan_crc": {"kind": "scan", "dataset": pre, "page_checksums": True},
        "tokenizer": {"kind": "tokenizer", "dataset": text},
    }
    for name, dataset, packing, k, steps in (
        ("pre_concat_k0", pre, "concat", 0, pre_steps),
        ("pre_concat_k2", pre, "concat", 2, pre_steps),
        ("pre_best_fit_k0", pre, "best_fit", 0, pre_steps),
        ("text_concat_k0", text, "concat", 0, text_steps),
        ("text_concat_k2", text, "concat", 2, text_steps),
    ):
        cases[name] = {"kind": "loader", "dataset": dataset, "packing": packing, "num_workers": k, "steps": steps}
    cases["pre_concat_ids_k0"] = dict(cases["pre_concat_k0"], batch_fields=["input_ids"])
    # Issue 14: the cost of the integrity checks. pre_concat_k0 has the defaults: the footer,
    # row-group and token checks on, the full-file SHA-256 (verify_local_files) off.
    cases["pre_concat_k0_hash"] = dict(cases["pre_concat_k0"], verify_local_files=True)
    cases["pre_concat_k0_nochecks"] = dict(cases["pre_concat_k0"], integrity_checks=False)
    # The SHA-256 is paid once per file and process, in the first epoch: its worst case is a run of one.
    for name in ("pre_concat_k0", "pre_concat_k0_hash"):
        cases[f"{name}_1epoch"] = dict(cases[name], steps=max(2, pre_steps // PRE_EPOCHS))
    cases["pre_concat_k0_hash_1epoch"]["account_checks"] = True  # CPU time inside the checks, reported apart
    # Issue 19: the per-document cost of a transform, the built-in identity (a Python call per document).
    for name in ("pre_concat_k0", "pre_concat_k2"):
        cases[f"{name}_identity"] = dict(cases[name], transforms=[{"function": "identity"}])
    for data, dataset, workers in (("pre", pre, (0, 2)), ("text", text, (0,))):
        for k in workers:
            for step in RESTORE_STEPS:
                cases[f"restore_{data}_step{step}_k{k}"] = {
                    "kind": "restore", "dataset": dataset, "step": step, "num_workers": k}
    chat, chat_twin = (str(_chat_dataset_dir(docs, pretokenized)) for pretokenized in (False, True))
    if Path(chat_twin, "manifest.json").exists():  # built unless --only leaves the chat cases out
        chat_steps = max(2, CHAT_EPOCHS * _dataset_tokens(chat_twin) // per_step)
        cases["chat_floor"] = {"kind": "chat_floor", "dataset": chat}
        for packing in ("concat", "best_fit"):
            cases[f"chat_{packing}_k0"] = {"kind": "loader", "dataset": chat, "packing": packing, "num_workers": 0,
                                           "steps": chat_steps, "warmup_steps": chat_steps // CHAT_EPOCHS}
    for label, count in (("n", docs // 4), ("10n", docs * 10 // 4)):
        for k in (0, 2):
            cases[f"rss_{label}_k{k}"] = {
                "kind": "rss", "dataset": str(_dataset_dir(count, True, writer, RSS_LANES)), "num_workers": k}
    return cases


def measure(cases: dict[str, dict], repeats: int, script: Optional[str] = None) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {name: [] for name in cases}
    for round_ in range(repeats):
        for name, args in cases.items():
            args = dict(args)
            result = run_child(args.pop("kind"), script, **args)
            results[name].append(result)
            shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
            print(f"  round {round_ + 1}/{repeats} {name}: {shown}", flush=True)
    return results


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _rate(runs: list[dict], per: str = "seconds") -> float:
    """Median tokens per wall second (or per CPU second) over repeats."""
    return statistics.median(r["tokens"] / r[per] for r in runs)


def _status(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(results: dict[str, list[dict]]) -> list[str]:
    """The results table (Markdown) and one GOAL line per goal."""
    lines = ["| case | median | ratio | goal | status | tok / CPU s (ratio) |", "|---|---:|---:|---|---|---:|"]
    has = lambda *names: all(results.get(n) for n in names)  # noqa: E731
    verdicts = []
    for name, label in (("scan", "floor (a): bare pyarrow scan, pre-tokenized lanes"),
                        ("scan_crc", "(a) with page checksums verified, as the loader reads (no goal)"),
                        ("tokenizer", "floor (b): tokenizers encode_batch_fast, default threads"),
                        ("chat_floor", "floor (c): chat template render + encode_batch_fast, bare loop")):
        if has(name):
            lines.append(f"| {label} | {_rate(results[name]) / 1e6:.2f} M tok/s | 1.00 | | | "
                         f"{_rate(results[name], 'cpu_s') / 1e6:.2f} M |")
    for name, floor, goal in (
        ("pre_concat_k0", "scan", GOAL_SCAN_RATIO), ("pre_concat_k2", "scan", None),
        ("pre_best_fit_k0", "scan", None), ("pre_concat_ids_k0", "scan", GOAL_SCAN_IDS_RATIO),
        ("pre_concat_k0_hash", "scan", None), ("pre_concat_k0_nochecks", "scan", None),
        ("pre_concat_k0_1epoch", "scan", None), ("pre_concat_k0_hash_1epoch", "scan", None),
        ("text_concat_k0", "tokenizer", GOAL_TOKENIZER_RATIO), ("text_concat_k2", "tokenizer", None),
        ("chat_concat_k0", "chat_floor", GOAL_CHAT_RATIO), ("chat_best_fit_k0", "chat_floor", None),
    ):
        if not has(name, floor):
            continue
        rate = _rate(results[name])
        ratio = rate / _rate(results[floor])
        cpu_ratio = _rate(results[name], "cpu_s") / _rate(results[floor], "cpu_s")
        goal_text, status = "", ""
        if goal is not None:
            goal_text, status = f">= {goal} x {floor}", _status(ratio >= goal)
            verdicts.append((f"{name} >= {goal} x {floor}", ratio, status))
        startup = _median(results[name], "startup_s")
        lines.append(f"| loader {name} (start-up {startup:.2f} s) | {rate / 1e6:.2f} M tok/s | "
                     f"{ratio:.2f} x {floor} | {goal_text} | {status} | "
                     f"{_rate(results[name], 'cpu_s') / 1e6:.2f} M ({cpu_ratio:.2f}) |")
    for name, base, what in (
        ("pre_concat_k0", "pre_concat_k0_nochecks", "issue 14: the footer, row-group and token checks (the defaults)"),
        ("pre_concat_k0_hash", "pre_concat_k0", "issue 14: the full-file SHA-256 (verify_local_files)"),
        ("pre_concat_k0_hash_1epoch", "pre_concat_k0_1epoch", "issue 14: the full-file SHA-256, a one-epoch run"),
        ("pre_concat_k0_identity", "pre_concat_k0", "issue 19: an identity transform per document (goal >= 0.95)"),
        ("pre_concat_k2_identity", "pre_concat_k2", "issue 19: an identity transform per document, 2 workers"),
    ):
        if has(name, base):  # median over rounds of the ratio within a round (same machine load)
            ratio, cpu_ratio = (statistics.median(a["tokens"] / a[per] / (b["tokens"] / b[per])
                                                  for a, b in zip(results[name], results[base]))
                                for per in ("seconds", "cpu_s"))
            lines.append(f"| cost of {what}: {name} / {base} | {ratio:.3f} | | | | ({cpu_ratio:.3f}) |")
    if has("pre_concat_k0_hash_1epoch"):
        runs = results["pre_concat_k0_hash_1epoch"]
        for key, what in (("hash_cpu_s", "the full-file SHA-256"), ("checks_cpu_s", "the footer, row-group and token checks")):
            share = statistics.median(r[key] / r["cpu_s"] for r in runs)
            lines.append(f"| issue 14, CPU inside {what}, one epoch: {_median(runs, key) * 1e3:.1f} ms | "
                         f"{share:.2%} of the run's CPU | | | | |")
    for data, k in (("pre", 0), ("pre", 2), ("text", 0)):
        early, late = (f"restore_{data}_step{s}_k{k}" for s in RESTORE_STEPS)
        if has(early, late):
            a, b = _median(results[early], "seconds"), _median(results[late], "seconds")
            ratio = b / a
            goal_text, status = "", ""
            if (data, k) == ("pre", 0):
                goal_text, status = f"<= {GOAL_RESTORE_RATIO}", _status(ratio <= GOAL_RESTORE_RATIO)
                verdicts.append((f"restore step {RESTORE_STEPS[1]} / step {RESTORE_STEPS[0]} (pre, k0)", ratio, status))
            lines.append(f"| restore to first batch ({data}, num_workers={k}): step {RESTORE_STEPS[0]} / "
                         f"{RESTORE_STEPS[1]:,} | {a * 1e3:.0f} / {b * 1e3:.0f} ms | {ratio:.2f} | {goal_text} | "
                         f"{status} | |")
    for k in (0, 2):
        small, large = f"rss_n_k{k}", f"rss_10n_k{k}"
        if has(small, large):
            peak = lambda runs: max(_median(runs, "peak_mb"), _median(runs, "workers_peak_mb"))  # noqa: E731
            grow = lambda runs: _median(runs, "peak_mb") - _median(runs, "after_imports_mb")  # noqa: E731
            a, b = peak(results[small]), peak(results[large])
            ratio = b / a
            goal_text, status = "", ""
            if k == 0:
                goal_text, status = f"<= {GOAL_RSS_RATIO}", _status(ratio <= GOAL_RSS_RATIO)
                verdicts.append(("peak RSS 10N / N documents (k0)", ratio, status))
            what = "max of main and workers" if k else "main process"
            lines.append(f"| peak RSS, {what}, num_workers={k}: N / 10N docs (main above its imports: "
                         f"{grow(results[small]):.0f} / {grow(results[large]):.0f} MB) | {a:.0f} / {b:.0f} MB | "
                         f"{ratio:.2f} | {goal_text} | {status} | |")
    lines.append("")
    for what, ratio, status in verdicts:
        lines.append(f"GOAL {what}: {ratio:.2f} {status}")
    return lines


def machine_line() -> str:
    import pyarrow
    import tokenizers
    import torch

    from bench.machine import cpu_model, load_average  # the repo root is on sys.path by now

    model, load = cpu_model(), load_average()
    return (f"nproc {os.cpu_count()}, {model}, Python {platform.python_version()}, torch {torch.__version__}, "
            f"pyarrow {pyarrow.__version__}, tokenizers {tokenizers.__version__}; load average {load}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small data (--docs 4000) and 1 repeat")
    parser.add_argument("--docs", type=int, default=None, help="documents of the throughput dataset (default 20000)")
    parser.add_argument("--writer", choices=("beam", "factory"), default="beam", help="how lane datasets are built")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child_main(CHILDREN, args.child)
    docs = args.docs or (4000 if args.quick else 20000)
    repeats = args.repeats or (1 if args.quick else 3)
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    build_datasets(docs, args.writer)
    if not args.only or any(p.startswith("chat") for p in args.only):
        build_chat_datasets(docs)  # always by the Beam job: only it renders and validates conversations
    cases = plan(docs, args.writer)
    if args.only:
        cases = {n: c for n, c in cases.items() if any(n.startswith(p) for p in args.only)}
    for dataset in sorted({c["dataset"] for c in cases.values() if c["kind"] == "restore"}):
        if not all(_state_path(dataset, s).exists() for s in RESTORE_STEPS):
            made = run_child("make_states", dataset=dataset)
            print(f"{Path(dataset).name}: states at steps {RESTORE_STEPS} saved "
                  f"(running {made['steps']:,} steps took {made['seconds']:.1f} s)", flush=True)
    pre = str(_dataset_dir(docs, True, args.writer))
    run_and_report(cases, repeats, report, argv, data=f"{docs:,} sample documents, {_dataset_tokens(pre):,} "
                   f"tokens in {NUM_LANES} lanes")
    return 0


def run_and_report(cases: dict[str, dict], repeats: int, report, argv, *, data: str,
                   script: Optional[str] = None) -> None:
    """The run of a bench script of this harness: machine, command and data lines, every case
    ``repeats`` times (rounds interleaved), ``report(results)``'s lines, the load at the end."""
    script = script or str(Path(__file__).resolve())
    print(machine_line())
    print(f"command: python bench/{Path(script).name} " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    print(f"data: {data}; {repeats} repeat(s), median")
    results = measure(cases, repeats, script)
    print("\n".join(report(results)))
    print(f"load average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
