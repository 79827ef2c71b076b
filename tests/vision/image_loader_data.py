"""Image datasets for the loader tests: generated images sharded by ``zephon shard``, a tokenizer
that knows the placeholder tokens, and loader configs over them.

Every document names its image(s) in its text (``pic 17``), so a test can find, from a batch
alone, which stored image a run of placeholder tokens stands for and compare ``pixel_values``
with the policy's own output for those bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from tests.vision.image_datasets import write_jsonl
from tests.vision.image_factory import FORMATS, image_bytes

IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]
NUM_LANES = 4
SIZES = ((30, 40), (64, 64), (100, 20), (17, 90), (56, 28), (45, 45))
# Small dynamic images: 4 to 16 visual tokens each.
DYNAMIC = {"kind": "dynamic", "min_pixels": 28 * 28, "max_pixels": 16 * 28 * 28}
FIXED = {"kind": "fixed", "image_size": 56, "patch_size": 14}  # 16 visual tokens each
PLACEHOLDERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<image>")
PIC = re.compile(r"pic (\d+)")


def image_of(index: int) -> bytes:
    width, height = SIZES[index % len(SIZES)]
    return image_bytes(width, height, FORMATS[index % 3], seed=index)


def records(count: int, root: Path) -> list[dict]:
    """Pairs (``[image, text]``), two-image captions and interleaved documents, images on disk."""
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    out, image = [], 0

    def stored(index: int) -> str:
        (root / "imgs" / f"{index}.img").write_bytes(image_of(index))
        return f"imgs/{index}.img"

    for k in range(count):
        words = " ".join(["word"] * (k % 9))
        if k % 5 == 3:  # interleaved: text, image, text, image
            out.append({"image": [None, stored(image), None, stored(image + 1)],
                        "text": [f"doc {k} then ", None, f" pic {image} and {words} ", None]})
            image += 2
        elif k % 5 == 4:  # two images then a caption naming both
            out.append({"image": [stored(image), stored(image + 1)], "text": f"pic {image} pic {image + 1} {words}"})
            image += 2
        else:
            out.append({"image": stored(image), "text": f"pic {image} is a caption {words}"})
            image += 1
    return out


def shard_images(root: Path, output: Path, count: int, policy: Optional[dict]) -> str:
    inputs = root / "in"
    if not (inputs / "docs.jsonl").exists():
        inputs.mkdir(parents=True, exist_ok=True)
        write_jsonl(inputs / "docs.jsonl", records(count, inputs))
    args = ["--input", str(inputs / "docs.jsonl"), "--output", str(output), "--num-lanes", str(NUM_LANES),
            "--image-field", "image", *IN_MEMORY]
    if policy is not None:
        args += ["--image-policy", json.dumps(policy)]
    shard.run(args)
    return str(output)


def image_tokenizer(path: Path) -> str:
    """The shipped test tokenizer plus the placeholder tokens, as special tokens."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in PLACEHOLDERS])
    tokenizer.save(str(path))
    return str(path)


def image_config(datasets: list[dict], tokenizer: str, **overrides) -> LoaderConfig:
    fields = dict(datasets=tuple(datasets), seq_len=96, global_batch_size=8, micro_batch_size=2, seed=3,
                  tokenizer=tokenizer, packing="best_fit", best_fit_open_bins=4)
    fields.update(overrides)
    return LoaderConfig(**fields)
