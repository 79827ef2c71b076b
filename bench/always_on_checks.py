"""Cost of issue 28's always-on checks: each with and without, alternating rounds, medians.

    python bench/always_on_checks.py [--rounds 5]

* ``images``: ``ZephonLoader`` (k0, best fit, 3 epochs) over a generated image dataset
  (``tests/vision/image_loader_data``, 400 documents, dynamic policy), images/s with the
  read-back checks (page CRCs of ``image_bytes``, SHA-256 of each image vs ``image_sha256``)
  and with both made no-ops in the process.
* ``chat``: ``ChatTemplate.render(track_generation=True)`` of 400 generated conversations on
  the test ChatML template, conversations/s with the render bounds
  (``loader.chat.render_limits``) and without (``run_bounded`` / ``bounded_chunks`` bypassed).
* ``tokens``: ``ZephonLoader`` (k0, concat, one epoch) on a pre-tokenized dataset (6,000
  documents, 4 lanes) through ``reverse_ids`` (a tokens transform that changes every
  document, so every document's ids are range-checked), tokens/s with the id-range check
  and with it widened to nothing. A pre-tokenized
  or chat run without transforms has no new per-batch check (the template fingerprint is
  checked once per manifest read).
* ``transforms``: the same run through ``drop_random_words`` (a text-stage user transform: every
  document's text changes) on the text lanes, tokens/s with the determinism probe
  (``loader.transforms.probe``: global generators watched, re-checks at 64/1,024/16,384 documents,
  one fresh interpreter per chain and process) and with only the two calls on 8 documents (the
  probe before issue 28's round two). A fresh loader per round: the interpreter's one-time cost
  is in every round. ``transforms_steady`` leaves the interpreter out on both sides (what
  the checks cost per document); ``probe child`` times that interpreter alone.
* ``shm``: ``ZephonLoader`` with 2 workers on the pre-tokenized dataset (one epoch), tokens/s
  with each segment's pages reserved (``posix_fallocate``) and with the reservation a no-op;
  ``segment`` times creating a 16 MiB segment and writing every page, each way.

In-process, rounds interleaved so that load from other work on the machine spreads over
both sides; on a shared machine the spread of the rounds is the noise floor: read the
medians with the ``all=`` lists.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_DIR = REPO_ROOT / "bench" / "_work" / "always_on_checks"
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests"), str(REPO_ROOT / "tests" / "vision")]

import pyarrow.parquet as pq  # noqa: E402

from bench.machine import load_average  # noqa: E402
from loader.samples import default_tokenizer_path  # noqa: E402
from loader.chat import render_limits  # noqa: E402
from loader.chat.template import ChatTemplate  # noqa: E402
from loader.config import LoaderConfig  # noqa: E402
from loader.pipeline import ZephonLoader  # noqa: E402
from loader.stages.tokenizer import load_tokenizer  # noqa: E402
from loader.transforms import chain as chain_module  # noqa: E402
from loader.transforms import probe  # noqa: E402
from loader.vision import resolve  # noqa: E402
from loader.workers import shm  # noqa: E402


class _NoPageChecksums:
    """``pyarrow.parquet`` as the resolver sees it, page checksum verification dropped."""

    def __getattr__(self, name):
        return getattr(pq, name)

    @staticmethod
    def ParquetFile(*args, **kwargs):
        kwargs.pop("page_checksum_verification", None)
        return pq.ParquetFile(*args, **kwargs)


def images_case():
    from image_loader_data import DYNAMIC, image_config, image_tokenizer, shard_images

    root = WORK_DIR / "images"
    if not (root / "ds" / "manifest.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        shard_images(root, root / "ds", 400, DYNAMIC)
    tokenizer = image_tokenizer(root / "tokenizer.json")
    verify = resolve.verify_image_bytes

    def run(checked: bool) -> float:
        resolve.verify_image_bytes = verify if checked else (lambda data, stored, where: None)
        resolve.pq = pq if checked else _NoPageChecksums()
        config = image_config([{"path": str(root / "ds"), "max_epochs": 3}], tokenizer, global_batch_size=4,
                              micro_batch_size=2, num_workers=0)
        images, started = 0, time.perf_counter()
        with ZephonLoader(config, output="numpy") as loader:
            for batch in loader:
                images += len(batch["image_grid_thw"])
        return images / (time.perf_counter() - started)

    return "images/s", run


def chat_case():
    from tests.chat.chat_factory import TEMPLATES_DIR, make_records

    records = make_records(400, 3)
    template = ChatTemplate.from_string((TEMPLATES_DIR / "chatml_generation.jinja").read_text())
    bounded, chunks = render_limits.run_bounded, render_limits.bounded_chunks

    def run(checked: bool) -> float:
        render_limits.run_bounded = bounded if checked else (lambda render, origin, error: render())
        render_limits.bounded_chunks = chunks if checked else (lambda parts: parts)
        started = time.perf_counter()
        for record in records:
            template.render(record["messages"], tools=record.get("tools"), track_generation=True)
        return len(records) / (time.perf_counter() - started)

    return "conversations/s", run


def _tokens_per_s(dataset: dict, num_workers: int = 0) -> float:
    """One epoch of ``dataset`` through a fresh ``ZephonLoader`` (k0 or workers), tokens/s."""
    config = LoaderConfig(datasets=[dataset], seq_len=512, global_batch_size=16, micro_batch_size=4, seed=1,
                          tokenizer=default_tokenizer_path(), num_workers=num_workers)
    tokens, started = 0, time.perf_counter()
    with ZephonLoader(config, output="numpy") as loader:
        for batch in loader:
            tokens += batch["input_ids"].size
    return tokens / (time.perf_counter() - started)


def tokens_case():
    root = _pretokenized()
    check = chain_module.TransformChain._check_result

    def unchecked(self, position, before, result):
        limit, self.id_limit = self.id_limit, 2**62
        try:
            return check(self, position, before, result)
        finally:
            self.id_limit = limit

    def run(checked: bool) -> float:
        chain_module.TransformChain._check_result = check if checked else unchecked
        chain_module._chains.clear()
        return _tokens_per_s({"path": str(root), "max_epochs": 1,
                              "transforms": [{"function": "tests.transforms.functions:reverse_ids"}]})

    return "tokens/s", run


def _pretokenized() -> Path:
    from tests.dataset_factory import synthetic_texts, write_dataset

    root = WORK_DIR / "pretokenized"
    if not (root / "manifest.json").exists():
        write_dataset(str(root), synthetic_texts(6000, seed=3, max_words=200), num_lanes=4, seed=1,
                      tokenizer=load_tokenizer(default_tokenizer_path()))
    return root


def transforms_case(with_child: bool = True):
    """``with_child=False``: the other interpreter left out on both sides (the per-document cost)."""
    from tests.dataset_factory import synthetic_texts, write_dataset

    root = WORK_DIR / "text"
    if not (root / "manifest.json").exists():
        write_dataset(str(root), synthetic_texts(3000, seed=3, max_words=200), num_lanes=4, seed=1)
    checks = {name: getattr(chain_module, name) for name in ("call_watched", "recheck", "compare_in_child")}
    old = {"call_watched": lambda function, document, args, where: function(document, **args),
           "recheck": lambda *args: None, "compare_in_child": lambda *args: None}

    def run(checked: bool) -> float:
        for name, check in checks.items():
            on = checked and (with_child or name != "compare_in_child")
            setattr(chain_module, name, check if on else old[name])
        chain_module._chains.clear()
        return _tokens_per_s({"path": str(root), "max_epochs": 1, "transforms": [
            {"function": "tests.transforms.functions:drop_random_words", "args": {"p": 0.1}}]})

    return "tokens/s", run


def chain_cpu_seconds(checked: bool, documents: int = 3000) -> float:
    """CPU time of ``documents`` generated documents through a fresh one-transform chain alone,
    with the probe's per-document part (its interpreter left out) or with the two calls only."""
    from tests.dataset_factory import synthetic_texts

    from loader.transforms.chain import TransformChain, TransformCounts
    from loader.transforms.document import Document
    from loader.transforms.spec import TransformSpec

    checks = {name: getattr(chain_module, name) for name in ("call_watched", "recheck")}
    if not checked:
        chain_module.call_watched = lambda function, document, args, where: function(document, **args)
        chain_module.recheck = lambda *args: None
    try:
        chain = TransformChain([TransformSpec("tests.transforms.functions:drop_random_words", {"p": 0.1})], seed=1,
                               source="s", pretokenized=False)
        chain._child_checked = True
        docs = [Document(f"k{k}", text=t, seed_base=1) for k, t in enumerate(synthetic_texts(documents, seed=3,
                                                                                          max_words=200))]
        counts = TransformCounts.zeros(1)
        started = time.process_time()
        for doc in docs:
            chain.apply(doc, counts)
        return time.process_time() - started
    finally:
        for name, check in checks.items():
            setattr(chain_module, name, check)


def probe_child_seconds() -> float:
    from loader.transforms.chain import TransformChain, TransformCounts
    from loader.transforms.document import Document
    from loader.transforms.spec import TransformSpec

    chain = TransformChain([TransformSpec("tests.transforms.functions:drop_random_words", {"p": 0.1})], seed=1,
                           source="s", pretokenized=False)
    chain._child_checked = True  # the interpreter is timed alone, below
    for k in range(8):
        chain.apply(Document(f"k{k}", text="some words of a document " * 20, seed_base=1), TransformCounts.zeros(1))
    started = time.perf_counter()
    probe.compare_in_child(list(chain._probes), chain.specs, chain._where)
    return time.perf_counter() - started


def shm_case():
    root = _pretokenized()
    reserve = shm.reserve

    def run(checked: bool) -> float:
        shm.reserve = reserve if checked else (lambda fd, size, directory, worker_id: None)
        return _tokens_per_s({"path": str(root), "max_epochs": 1}, num_workers=2)

    return "tokens/s", run


def segment_seconds(reserved: bool, size: int = 16 * 2**20) -> float:
    import numpy as np

    reserve = shm.reserve
    shm.reserve = reserve if reserved else (lambda fd, size, directory, worker_id: None)
    try:
        started = time.perf_counter()
        segment = shm.Segment.create(num_slots=1, slot_size=size, worker_id=0)
        np.frombuffer(segment.view(0), dtype=np.uint8)[::4096] = 1  # a write per page
        elapsed = time.perf_counter() - started
        segment.unlink()
        segment.close()
        return elapsed
    finally:
        shm.reserve = reserve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="images,chat,tokens,transforms,transforms_steady,shm",
                        help="comma-separated: images, chat, tokens, transforms, transforms_steady, shm")
    args = parser.parse_args()
    print(f"load average before: {load_average()}")
    cases = {"images": images_case, "chat": chat_case, "tokens": tokens_case, "transforms": transforms_case,
             "transforms_steady": lambda: transforms_case(with_child=False), "shm": shm_case}
    wanted = args.cases.split(",")
    if {"transforms", "transforms_steady"} & set(wanted):
        child = sorted(probe_child_seconds() for _ in range(args.rounds))
        print(f"probe child (one fresh interpreter, 8 documents) s median {statistics.median(child):.3f}  all "
              f"{[round(v, 3) for v in child]}")
        cpu = {True: [], False: []}
        for _ in range(args.rounds):
            for checked in (False, True):
                cpu[checked].append(chain_cpu_seconds(checked))
        ratio = statistics.median(on / off for on, off in zip(cpu[True], cpu[False]))
        print(f"chain alone, 3,000 documents, CPU ms: two calls only {[round(v * 1e3, 1) for v in cpu[False]]}, "
              f"probe {[round(v * 1e3, 1) for v in cpu[True]]}, median ratio {ratio:.3f}")
    if "shm" in wanted:
        for reserved in (False, True):
            times = sorted(segment_seconds(reserved) for _ in range(args.rounds))
            print(f"segment 16 MiB create + a write per page, reserved={reserved}: ms median "
                  f"{statistics.median(times) * 1e3:.2f}  all {[round(v * 1e3, 2) for v in times]}")
    for name, case in ((name, cases[name]) for name in wanted):
        unit, run = case()
        rates: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.rounds):
            for side in ("off", "on"):
                rates[side].append(run(side == "on"))
        ratio = statistics.median(on / off for on, off in zip(rates["on"], rates["off"]))
        for side, values in rates.items():
            print(f"{name:7s} checks {side:3s} {unit} median {statistics.median(values):>12,.0f}  "
                  f"all {[round(v) for v in values]}")
        print(f"{name:7s} on/off ratio (median of rounds) {ratio:.3f}")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
