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
from loader.vision import resolve  # noqa: E402


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


def tokens_case():
    from tests.dataset_factory import synthetic_texts, write_dataset

    root = WORK_DIR / "pretokenized"
    if not (root / "manifest.json").exists():
        write_dataset(str(root), synthetic_texts(6000, seed=3, max_words=200), num_lanes=4, seed=1,
                      tokenizer=load_tokenizer(default_tokenizer_path()))
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
        dataset = {"path": str(root), "max_epochs": 1,
                   "transforms": [{"function": "tests.transforms.functions:reverse_ids"}]}
        config = LoaderConfig(datasets=[dataset], seq_len=512, global_batch_size=16, micro_batch_size=4, seed=1,
                              tokenizer=default_tokenizer_path(), num_workers=0)
        tokens, started = 0, time.perf_counter()
        with ZephonLoader(config, output="numpy") as loader:
            for batch in loader:
                tokens += batch["input_ids"].size
        return tokens / (time.perf_counter() - started)

    return "tokens/s", run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"load average before: {load_average()}")
    for name, case in (("images", images_case), ("chat", chat_case), ("tokens", tokens_case)):
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
