"""Image throughput (issue 18): images/s and tokens/s into a training loop, against a bare Pillow loop.

    python bench/image_throughput.py [--quick] [--images 2000] [--repeats 3] [--only CASE ...]

Data: ``--images N`` (default 2,000; quick 300) generated images (``tests/vision/image_factory``:
gradients, shapes and text; sizes 64..448 px, JPEG/PNG/WebP), one caption each, sharded by
the Beam job with the dynamic (Qwen2-VL) policy capped at 256 visual tokens an image, 8 lanes;
cached under ``bench/_work/image_throughput/``. Each measurement runs in a fresh process and
the report gives the median of ``--repeats``, cases interleaved round by round (the harness of
``bench/loader_throughput.py``: its clock, child runner pattern and machine line).

Cases:

* ``pillow``      floor: a bare loop over the same lane files' images: ``Image.open`` + RGB
                  convert + resize to the policy's size (bicubic) + ``(x / 255 - mean) / std``
                  in float32, no patch layout, no tokens, nothing shipped.
* ``loader_k0`` / ``loader_k2``   ``ZephonLoader`` (best fit, seq_len 2048, global batch 8,
                  micro-batch 2) with 0 / 2 worker processes, ``output="numpy"`` (each
                  micro-batch's ``pixel_values`` copied out of the worker's slot), timed from
                  the loader's construction (worker start-up included). Goal: >= 0.8 x pillow images/s with the same cores.
* ``settled_k0`` / ``settled_k2``   the same loaders in the steady state: ``--images / 4``
                  images untimed, then ``--images`` timed, CPU of the trainer's process and
                  its live workers read from /proc at both ends of the window. Goals (issue 35):
                  2 workers >= 0.95 x in-process images/s and CPU per image <= 1.3 x in-process,
                  both as within-round ratios, median over rounds.
* ``transfer``    the per-message cost of shipping image sequences through a worker slot:
                  ``write_message`` + ``read_message`` + collation of its 8 sequences (4
                  micro-batches of 2), in one process, with and without their pixels (µs, and
                  MB written to the slot, per message).
* ``rss_n`` / ``rss_4n``   peak RSS of the trainer's process (k0) reading N and 4N images'
                  worth of micro-batches from datasets of N and 4N images: flat as the data grows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_DIR = REPO_ROOT / "bench" / "_work" / "image_throughput"
POLICY = {"kind": "dynamic", "min_pixels": 28 * 28, "max_pixels": 256 * 28 * 28}
NUM_LANES = 8
SHAPE = {"seq_len": 2048, "global_batch_size": 8, "micro_batch_size": 2}
PLACEHOLDERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def _dataset_dir(images: int) -> Path:
    return WORK_DIR / f"dynamic-{images}"


def build_dataset(images: int) -> str:
    out = _dataset_dir(images)
    if (out / "manifest.json").exists():
        return str(out)
    sys.path.insert(0, str(REPO_ROOT / "tests" / "vision"))
    from image_factory import FORMATS, image_bytes

    from beam_jobs import shard

    source = WORK_DIR / f"in-{images}"
    (source / "imgs").mkdir(parents=True, exist_ok=True)
    with open(source / "docs.jsonl", "w") as fh:
        for k in range(images):
            width, height = 64 + (k * 37) % 385, 64 + (k * 53) % 385
            (source / "imgs" / f"{k}.img").write_bytes(image_bytes(width, height, FORMATS[k % 3], seed=k))
            fh.write(json.dumps({"image": f"imgs/{k}.img", "text": f"picture {k}: a drawing of shapes"}) + "\n")
    shard.run(["--input", str(source / "docs.jsonl"), "--output", str(out), "--num-lanes", str(NUM_LANES),
               "--image-field", "image", "--image-policy", json.dumps(POLICY), "--runner=FnApiRunner",
               "--direct_running_mode=in_memory"])
    return str(out)


def _tokenizer() -> str:
    path = WORK_DIR / "tokenizer.json"
    if not path.exists():
        from tokenizers import AddedToken, Tokenizer

        from loader.samples import default_tokenizer_path

        tokenizer = Tokenizer.from_file(default_tokenizer_path())
        tokenizer.add_special_tokens([AddedToken(t, special=True) for t in PLACEHOLDERS])
        WORK_DIR.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(path))
    return str(path)


def _config(dataset: str, **overrides):
    from loader.config import LoaderConfig

    return LoaderConfig(datasets=({"path": dataset},), seed=0, tokenizer=_tokenizer(), packing="best_fit",
                        **SHAPE, **overrides)


def _image_bytes(dataset: str):
    import pyarrow.parquet as pq

    manifest = json.loads(Path(dataset, "manifest.json").read_text())
    for entry in manifest["files"]:
        for row in pq.read_table(Path(dataset, entry["path"]), columns=["image_bytes"]).column(0).to_pylist():
            yield from row


# ---------------------------------------------------------------------------------------
# Children (each in a fresh process)

def child_pillow(dataset: str) -> dict:
    import io

    import numpy as np
    from PIL import Image

    from bench.loader_throughput import _Clock
    from loader.vision.policies import policy_from_dict

    policy = policy_from_dict(POLICY)
    mean = np.asarray(policy.image_mean, np.float32)[:, None, None]
    std = np.asarray(policy.image_std, np.float32)[:, None, None]
    data = list(_image_bytes(dataset))
    clock, images = _Clock(), 0
    for encoded in data:
        image = Image.open(io.BytesIO(encoded)).convert("RGB")
        height, width = policy.resized_size(image.width, image.height)
        pixels = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)
        normalised = (pixels.transpose(2, 0, 1) * np.float32(1 / 255) - mean) / std
        images += normalised.shape[0] // 3  # one image
    return {**clock.read(), "images": images}


def child_loader(dataset: str, num_workers: int, images: int, settle: int = 0) -> dict:
    """``settle`` 0: timed from the loader's construction, start-up included (worker start,
    first reads): timing from a later batch would credit the workers with what they prefetched
    meanwhile. ``settle`` > 0: ``images`` more images timed after the first ``settle``, with
    the CPU of the trainer's process and its live worker processes read from /proc at both
    ends of the window, so the CPU per image is that of the steady state (the window's start
    and end both hold a full pipeline), without the workers' imports and start-up."""
    from bench.loader_throughput import _Clock
    from bench.peers.run import tree_cpu_s
    from loader.pipeline import ZephonLoader

    config = _config(dataset, num_workers=num_workers)
    clock, seen, tokens = _Clock(), 0, 0
    with ZephonLoader(config, output="numpy") as loader:
        if settle:
            while seen < settle:
                seen += len(next(loader)["image_grid_thw"])
            seen, start_cpu, clock = 0, tree_cpu_s(), _Clock()
        while seen < images:
            batch = next(loader)
            seen += len(batch["image_grid_thw"])
            tokens += batch["input_ids"].size
        seconds = clock.read()["seconds"]
        if settle:
            end_cpu = tree_cpu_s()
            cpu_s = sum(end_cpu.values()) - sum(start_cpu.values())
            return {"seconds": seconds, "cpu_s": cpu_s, "images": seen, "tokens": tokens,
                    "workers_cpu_s": end_cpu["workers_cpu_s"] - start_cpu["workers_cpu_s"]}
    # CPU read after close(): a worker's CPU time is counted once it has exited (RUSAGE_CHILDREN)
    return {"seconds": seconds, "cpu_s": clock.read()["cpu_s"], "images": seen, "tokens": tokens}


def child_transfer(dataset: str) -> dict:
    import math

    import numpy as np

    from loader.pipeline import ZephonLoader
    from loader.stages.producer import build_lanes
    from loader.stages.producer import Item
    from loader.workers.messages import ITEMS_PER_MESSAGE, read_message, write_message
    from loader.vision.transfer import image_slot_bytes
    from loader.workers.shm import slot_bytes

    config = _config(dataset)
    with ZephonLoader(config, output="numpy") as loader:
        lanes = build_lanes(loader.spec, [0], {})
        options, collator = loader.image_options, loader._collator
    lane = lanes[0]
    items = [Item(k * NUM_LANES, *lane.next_sequence(k * NUM_LANES), None) for k in range(ITEMS_PER_MESSAGE)]
    lane.close()
    size = slot_bytes(config.seq_len, ITEMS_PER_MESSAGE) + image_slot_bytes(
        options.policy, config.seq_len, ITEMS_PER_MESSAGE, options.wrap_tokens)
    slot = memoryview(bytearray(size))
    result = {}
    for label, keep_images in (("with_pixels", True), ("without_pixels", False)):
        for item in items:
            if not keep_images:
                item.sequence.images = None
        collator.image_policy = options.policy if keep_images else None
        timings = []
        for _ in range(20):
            started = time.perf_counter()
            descriptor = write_message(items, slot)
            shipped = read_message(descriptor, slot, None)
            for first in range(0, len(shipped), 2):  # the message's sequences as micro-batches of 2
                collator.collate(shipped[first : first + 2], first + 2)
            timings.append(time.perf_counter() - started)
        written = sum(np.dtype(dtype).itemsize * math.prod(shape) for dtype, shape, _ in descriptor["layout"].values())
        result[f"{label}_us"] = statistics.median(timings) * 1e6
        result[f"{label}_mb"] = written / 1e6
    result["seconds"] = result["cpu_s"] = 1.0
    return result


def child_rss(dataset: str, images: int) -> dict:
    import resource

    import torch  # noqa: F401 - imported before the baseline, as a trainer has it

    from loader.pipeline import ZephonLoader

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with ZephonLoader(_config(dataset), output="numpy") as loader:
        seen = 0
        while seen < images:
            seen += len(next(loader)["image_grid_thw"])
    return {"after_imports_mb": base, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "images": seen, "seconds": 1.0, "cpu_s": 1.0}


CHILDREN = {"pillow": child_pillow, "loader": child_loader, "transfer": child_transfer, "rss": child_rss}


def plan(images: int) -> dict[str, dict]:
    small, large = build_dataset(images), build_dataset(4 * images)
    return {
        "pillow": {"kind": "pillow", "dataset": small},
        "loader_k0": {"kind": "loader", "dataset": small, "num_workers": 0, "images": images},
        "loader_k2": {"kind": "loader", "dataset": small, "num_workers": 2, "images": images},
        # the steady state: a quarter of the dataset untimed, then as many images as the dataset holds
        "settled_k0": {"kind": "loader", "dataset": small, "num_workers": 0, "images": images, "settle": images // 4},
        "settled_k2": {"kind": "loader", "dataset": small, "num_workers": 2, "images": images, "settle": images // 4},
        "transfer": {"kind": "transfer", "dataset": small},
        "rss_n": {"kind": "rss", "dataset": small, "images": images},
        "rss_4n": {"kind": "rss", "dataset": large, "images": images},
    }


def report(results: dict[str, list[dict]]) -> list[str]:
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    rate = lambda runs, key, per="seconds": statistics.median(r[key] / r[per] for r in runs)  # noqa: E731
    lines = []
    floor = rate(results["pillow"], "images") if results.get("pillow") else None
    if floor:
        lines.append(f"pillow floor        {floor:9.1f} images/s   ({rate(results['pillow'], 'images', 'cpu_s'):.1f} "
                     "images per CPU s)")
    for name in ("loader_k0", "loader_k2"):
        runs = results.get(name)
        if runs:
            images, tokens = rate(runs, "images"), rate(runs, "tokens")
            ratio = f" = {images / floor:.2f} x pillow (goal >= 0.8: {'PASS' if images >= 0.8 * floor else 'FAIL'})" \
                if floor else ""
            lines.append(f"{name:<19} {images:9.1f} images/s {tokens:11,.0f} tok/s{ratio}; "
                         f"{rate(runs, 'images', 'cpu_s'):.1f} images per CPU s")
    settled = {name: results.get(name) for name in ("settled_k0", "settled_k2")}
    for name, runs in settled.items():
        if runs:
            lines.append(f"{name:<19} {rate(runs, 'images'):9.1f} images/s; {1e3 * rate(runs, 'cpu_s', 'images'):.2f} "
                         "ms CPU per image (trainer process and workers, steady state)")
    if all(settled.values()):
        # within each round (the cases interleave round by round), median over rounds
        speed = statistics.median(b["images"] / b["seconds"] / (a["images"] / a["seconds"])
                                  for a, b in zip(settled["settled_k0"], settled["settled_k2"]))
        cpu = statistics.median(b["cpu_s"] / b["images"] / (a["cpu_s"] / a["images"])
                                for a, b in zip(settled["settled_k0"], settled["settled_k2"]))
        lines.append(f"GOAL 2 workers >= 0.95 x in-process images/s (steady state): {speed:.2f} "
                     f"{'PASS' if speed >= 0.95 else 'FAIL'}")
        lines.append(f"GOAL 2 workers CPU per image <= 1.3 x in-process (steady state): {cpu:.2f} "
                     f"{'PASS' if cpu <= 1.3 else 'FAIL'}")
    if results.get("transfer"):
        runs = results["transfer"]
        lines.append(f"transfer per message of 8 sequences: {med(runs, 'with_pixels_us'):.0f} us with pixels "
                     f"({med(runs, 'with_pixels_mb'):.1f} MB), {med(runs, 'without_pixels_us'):.0f} us without "
                     f"({med(runs, 'without_pixels_mb'):.2f} MB): write + read views + collate")
    for name in ("rss_n", "rss_4n"):
        if results.get(name):
            runs = results[name]
            lines.append(f"{name:<7} peak RSS {med(runs, 'peak_mb'):.0f} MB (after imports "
                         f"{med(runs, 'after_imports_mb'):.0f} MB)")
    return lines


def main(argv=None) -> int:
    from bench.loader_throughput import add_run_options, child_main, run_and_report

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 images, 1 repeat")
    parser.add_argument("--images", type=int, default=None, help="images in the dataset (default 2000)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child_main(CHILDREN, args.child)
    images = args.images or (300 if args.quick else 2000)
    repeats = args.repeats or (1 if args.quick else 3)
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    cases = plan(images)
    if args.only:
        cases = {n: c for n, c in cases.items() if any(n.startswith(p) for p in args.only)}
    run_and_report(cases, repeats, report, argv, script=str(Path(__file__).resolve()),
                   data=f"{images:,} generated images (and {4 * images:,} for rss_4n), {NUM_LANES} lanes, "
                        f"policy {POLICY}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
