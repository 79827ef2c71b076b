"""The fixed inputs of ``test_golden_kinds.py``: small chat, image, image-chat and transformed
datasets, built by the suite's factories and the Beam job, and the loader configs over them.

Everything here is part of the pins: changing a count, a seed, a flag or a config field changes
the pinned values (so it is a re-pin, said in the commit message, never a side effect).

The data is built only from the suite's generators (``tests/dataset_factory.py``,
``tests/chat/chat_factory.py``, ``tests/vision/image_factory.py``, the test templates), the
transforms of :mod:`tests.golden.kinds_transforms` and built-in ones, and the public entry
points (``beam_jobs.shard.run``, ``loader.config.LoaderConfig``), so moving code inside
``loader/`` or ``beam_jobs/`` cannot change the inputs of a pin, only its outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from tests.chat.chat_factory import TEMPLATES_DIR, make_records
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.vision.image_factory import FORMATS, image_bytes

NUM_LANES = 4
DATA_SEED = 3  # the Beam job's / factory's --seed
LOADER_SEED = 11
GLOBAL_BATCH = 8
MICRO_BATCH = 2
OPEN_BINS = 4
BEAM_IN_MEMORY = ("--runner=FnApiRunner", "--direct_running_mode=in_memory")
TARGET_FILE_MB = "0.002"

CHAT_TEMPLATE = str(TEMPLATES_DIR / "chatml_generation.jinja")
IMAGE_CHAT_TEMPLATE = str(Path(__file__).parent.parent / "vision" / "templates" / "qwen2_vl_generation.jinja")
CHAT_SEQ_LEN = 512
CHAT_MAX_TOKENS = CHAT_SEQ_LEN - 1  # + the loader's EOS: a conversation fits one best-fit row
CHAT_RECORDS = dict(seed=17, count=48)  # make_records arguments
IMAGE_SEQ_LEN = 128
IMAGE_DOCS = 30
IMAGE_CONVERSATIONS = 24
IMAGE_SIZES = ((30, 40), (64, 64), (100, 20), (17, 90), (56, 28), (45, 45))
# Small dynamic images (Qwen2-VL smart_resize): 4 to 16 visual tokens each.
IMAGE_POLICY = {"kind": "dynamic", "min_pixels": 28 * 28, "max_pixels": 16 * 28 * 28}
IMAGE_PLACEHOLDERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<image>")
TEXT_DOCS = dict(count=40, seed=7, max_words=30)  # synthetic_texts arguments (the mixes' text source)
TRANSFORM_DOCS = dict(count=64, seed=5, max_words=20)
TRANSFORM_SEQ_LEN = 48

G = "tests.golden.kinds_transforms:"
# Online: built-in filters and a seeded map of each stage (the text lanes tokenized by the loader,
# the token transforms on pre-tokenized lanes).
TEXT_TRANSFORMS = ({"function": "drop_regex", "args": {"pattern": "^doc[0-9]*7 "}},
                   {"function": "length_chars", "args": {"min": 40}}, {"function": G + "title_seeded_words"})
TOKEN_TRANSFORMS = ({"function": "length_tokens", "args": {"max": 60}}, {"function": G + "rotate_ids_by_seed"},
                    {"function": "truncate_tokens", "args": {"max_tokens": 40}})
# Offline (``zephon shard --transform``): a metadata filter, a text map, then token-stage ones;
# every dropped document stays as a tombstone row.
SHARD_TRANSFORMS = ('drop_metadata:{"field": "lang", "values": ["fr"]}', G + "title_seeded_words",
                    'length_tokens:{"min": 24}', G + "rotate_ids_by_seed", 'truncate_tokens:{"max_tokens": 40}')


def _write_jsonl(path: Path, records: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _shard(*args: str) -> None:
    # Small files: several per lane, so that epochs permute files as well as rows.
    shard.run([*args, "--num-lanes", str(NUM_LANES), "--seed", str(DATA_SEED), "--target-file-mb", TARGET_FILE_MB,
               *BEAM_IN_MEMORY])


def build_chat(base: Path) -> dict[str, str]:
    """The same conversations sharded offline (``--tokenizer``: input_ids + loss_mask) and online."""
    source = _write_jsonl(base / "in" / "chat.jsonl", make_records(**CHAT_RECORDS))
    common = ("--input", source, "--messages-field", "messages", "--chat-template", CHAT_TEMPLATE,
              "--chat-max-tokens", str(CHAT_MAX_TOKENS), "--chat-overflow", "truncate",
              "--max-reject-fraction", "1.0")
    paths = {"chat_offline": str(base / "chat_offline"), "chat_online": str(base / "chat_online")}
    _shard(*common, "--output", paths["chat_offline"], "--tokenizer", default_tokenizer_path())
    _shard(*common, "--output", paths["chat_online"])
    return paths


def image_of(index: int) -> bytes:
    width, height = IMAGE_SIZES[index % len(IMAGE_SIZES)]
    return image_bytes(width, height, FORMATS[index % 3], seed=index)


def _stored_image(root: Path, index: int) -> str:
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    (root / "imgs" / f"{index}.img").write_bytes(image_of(index))
    return f"imgs/{index}.img"


def image_records(root: Path) -> list[dict]:
    """Captions (one image), two-image captions and interleaved documents, images on disk."""
    out, image = [], 0
    for k in range(IMAGE_DOCS):
        words = " ".join(["word"] * (k % 7))
        if k % 3 == 1:  # interleaved: text, image, text, image
            out.append({"image": [None, _stored_image(root, image), None, _stored_image(root, image + 1)],
                        "text": [f"doc {k} then ", None, f" pic {image} and {words} ", None]})
            image += 2
        else:
            out.append({"image": _stored_image(root, image), "text": f"pic {image} is a caption {words}"})
            image += 1
    return out


def image_conversations(root: Path) -> list[dict]:
    """Conversations with images in user turns (one or two), one text-only, one image in a reply."""
    out, image = [], 100

    def image_part(key: str = "image") -> dict:
        nonlocal image
        image += 1
        return {"type": "image", key: _stored_image(root, image)}

    for k in range(IMAGE_CONVERSATIONS):
        messages = [{"role": "system", "content": "You describe pictures."}] if k % 3 == 0 else []
        if k % 6 == 2:
            messages += [{"role": "user", "content": f"Tell me {k}."}, {"role": "assistant", "content": "No."}]
        else:
            user = [image_part(), {"type": "text", "text": f"What is this ({k})?"}]
            if k % 4 == 1:
                user = [image_part("url"), *user]
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": f"It is {k}."}]
        if k % 5 == 4:
            messages += [{"role": "user", "content": "Draw it."},
                         {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, image_part("path"),
                                                            {"type": "text", "text": "done."}]}]
        out.append({"messages": messages})
    return out


def image_tokenizer(path: Path) -> str:
    """The shipped tokenizer plus the image placeholder tokens, as special tokens."""
    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in IMAGE_PLACEHOLDERS])
    tokenizer.save(str(path))
    return str(path)


def build_images(base: Path) -> dict[str, str]:
    """An image (caption) shard and an image-chat shard by the Beam job, and their tokenizer."""
    policy = json.dumps(IMAGE_POLICY)
    captions = _write_jsonl(base / "in" / "captions.jsonl", image_records(base / "in"))
    chats = _write_jsonl(base / "in" / "image_chat.jsonl", image_conversations(base / "in"))
    paths = {"image": str(base / "image"), "image_chat": str(base / "image_chat"),
             "image_tokenizer": image_tokenizer(base / "image_tokenizer.json")}
    _shard("--input", captions, "--output", paths["image"], "--image-field", "image", "--image-policy", policy)
    _shard("--input", chats, "--output", paths["image_chat"], "--messages-field", "messages",
           "--chat-template", IMAGE_CHAT_TEMPLATE, "--image-policy", policy)
    return paths


def transform_records() -> list[dict]:
    texts = synthetic_texts(**TRANSFORM_DOCS)
    return [{"id": f"t{k:04d}", "text": t, "lang": ("en", "de", "fr")[k % 3]} for k, t in enumerate(texts)]


def build_transformed(base: Path) -> dict[str, str]:
    """The transform corpus as factory text and pre-tokenized lanes, and sharded by the job with
    ``--transform`` (a tombstoned dataset)."""
    records = transform_records()
    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    paths = {name: str(base / name) for name in ("transform_text", "transform_pretokenized", "tombstoned")}
    layout = dict(num_lanes=NUM_LANES, seed=DATA_SEED, files_per_lane=2, row_group_rows=3,
                  keys=[r["id"] for r in records])
    texts = [r["text"] for r in records]
    write_dataset(paths["transform_text"], texts, **layout)
    write_dataset(paths["transform_pretokenized"], texts, tokenizer=tokenizer, **layout)
    source = _write_jsonl(base / "in" / "docs.jsonl", records)
    flags = [flag for spec in SHARD_TRANSFORMS for flag in ("--transform", spec)]
    _shard("--input", source, "--output", paths["tombstoned"], "--id-field", "id", "--keep-fields", "lang",
           "--tokenizer", default_tokenizer_path(), *flags)
    return paths


def build_text(base: Path) -> dict[str, str]:
    """A pretraining text source for the mixes (factory, text lanes)."""
    texts = synthetic_texts(**TEXT_DOCS)
    path = str(base / "text")
    write_dataset(path, texts, num_lanes=NUM_LANES, seed=DATA_SEED, source_name="text", row_group_rows=4,
                  keys=[f"text-{k:05d}" for k in range(len(texts))])
    return {"text": path}


def build_all(base: Path) -> dict[str, str]:
    return {**build_chat(base / "chat"), **build_images(base / "images"), **build_transformed(base / "transforms"),
            **build_text(base / "text")}


# name -> (sources as (dataset, weight, source name, per-source fields), config fields)
Source = tuple[str, float, str, dict]
CONFIGS: dict[str, tuple[tuple[Source, ...], dict[str, Any]]] = {
    "chat_offline_concat": ((("chat_offline", 1.0, "chat", {}),), dict(packing="concat")),
    "chat_offline_best_fit": ((("chat_offline", 1.0, "chat", {}),), dict(packing="best_fit")),
    "chat_online_concat": ((("chat_online", 1.0, "chat", {}),), dict(packing="concat")),
    "chat_online_best_fit": ((("chat_online", 1.0, "chat", {}),), dict(packing="best_fit")),
    "image": ((("image", 1.0, "image", {}),), dict(packing="best_fit", seq_len=IMAGE_SEQ_LEN)),
    "image_chat": ((("image_chat", 0.6, "image_chat", {}), ("text", 0.4, "text", {})),
                   dict(packing="best_fit", seq_len=IMAGE_SEQ_LEN)),
    "transforms_text": ((("transform_text", 1.0, "web", {"transforms": list(TEXT_TRANSFORMS)}),),
                        dict(packing="concat", seq_len=TRANSFORM_SEQ_LEN)),
    "transforms_tokens": ((("transform_pretokenized", 1.0, "web", {"transforms": list(TOKEN_TRANSFORMS)}),),
                          dict(packing="best_fit", seq_len=TRANSFORM_SEQ_LEN)),
    "tombstoned": ((("tombstoned", 1.0, "web", {}),), dict(packing="concat", seq_len=TRANSFORM_SEQ_LEN)),
    "mix_token_chat": ((("chat_online", 0.5, "chat", {}), ("text", 0.5, "text", {})),
                       dict(packing="concat", mixing_unit="token")),
}
IMAGE_CONFIGS = ("image", "image_chat")


def kinds_config(paths: dict[str, str], name: str, **replace: Any) -> LoaderConfig:
    sources, overrides = CONFIGS[name]
    entries = [{"path": paths[dataset], "name": source_name, "weight": weight, **extra}
               for dataset, weight, source_name, extra in sources]
    tokenizer = paths["image_tokenizer"] if name in IMAGE_CONFIGS else default_tokenizer_path()
    fields = dict(datasets=entries, seq_len=CHAT_SEQ_LEN, global_batch_size=GLOBAL_BATCH,
                  micro_batch_size=MICRO_BATCH, seed=LOADER_SEED, tokenizer=tokenizer,
                  best_fit_open_bins=OPEN_BINS, num_workers=0, prefetch=2, worker_timeout_s=60.0)
    fields.update(overrides)
    fields.update(replace)
    return LoaderConfig(**fields)

