"""The image-chat tests' data (tests/vision/test_image_chat.py, and its row of the elastic matrix):
conversations whose messages hold image parts, with conversations the job rejects (bad images)
and ones the loader rejects online (a literal pad, too long once its image is expanded), sharded
by ``zephon shard``, and a pre-tokenized text source to mix them with.
"""

from __future__ import annotations

import json
from pathlib import Path

from beam_jobs import shard
from loader.config import LoaderConfig
from loader.stages.tokenizer import load_tokenizer
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.vision.image_datasets import write_jsonl
from tests.vision.image_factory import FORMATS, image_bytes
from tests.vision.image_loader_data import DYNAMIC, IN_MEMORY, NUM_LANES, image_config, image_tokenizer

TEMPLATE = Path(__file__).parent / "templates" / "qwen2_vl_generation.jinja"
SIZES = ((30, 40), (64, 64), (100, 20), (17, 90), (56, 28), (45, 45))
CONVERSATIONS = 36
SEQ_LEN = 256


def image_of(index: int) -> bytes:
    width, height = SIZES[index % len(SIZES)]
    return image_bytes(width, height, FORMATS[index % 3], seed=100 + index)


def conversations(root: Path) -> list[dict]:
    """Generated conversations; every image part is followed by a text part naming it (``pic N``)."""
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    out, next_image = [], 0

    def image_part(key: str = "image") -> tuple[dict, dict]:
        nonlocal next_image
        index, next_image = next_image, next_image + 1
        (root / "imgs" / f"{index}.img").write_bytes(image_of(index))
        return {"type": "image", key: f"imgs/{index}.img"}, {"type": "text", "text": f" pic {index} "}

    for k in range(CONVERSATIONS):
        messages = [{"role": "system", "content": "You describe pictures."}] if k % 3 == 0 else []
        if k % 6 == 2:  # no image at all: a text conversation in the same source
            messages += [{"role": "user", "content": f"Tell me {k}."}, {"role": "assistant", "content": "No."}]
        else:
            user = [*image_part(), {"type": "text", "text": f"What is this ({k})?"}]
            if k % 4 == 1:
                user = [*image_part("url"), *user]  # two images, the first named by "url"
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": f"It is {k}."}]
        if k % 5 == 4:  # the assistant answers with an image: its tokens are still never trained on
            messages += [{"role": "user", "content": "Draw it."},
                         {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, *image_part("path"),
                                                            {"type": "text", "text": "done."}]}]
        out.append({"messages": messages})
    return out


def bad_conversations(root: Path) -> list[dict]:
    (root / "imgs" / "broken.png").write_bytes(b"not an image at all, just text")
    ask = {"type": "text", "text": "What?"}
    answer = {"role": "assistant", "content": "Nothing."}
    return [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/gone.png"}, ask]}, answer]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, ask]}, answer]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/broken.png"}, ask]}, answer]},
    ]


def online_rejects() -> list[dict]:
    """Conversations the job accepts and the loader refuses: a literal pad in the text, and one
    too long for a sequence once its image is expanded."""
    return [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/0.img"},
                                                   {"type": "text", "text": "a <|image_pad|> here"}]},
                      {"role": "assistant", "content": "Odd."}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/1.img"},
                                                   {"type": "text", "text": "long " * 300}]},
                      {"role": "assistant", "content": "Yes."}]},
    ]


def job_args(inputs: Path, output: Path, *extra: str) -> list[str]:
    return ["--input", str(inputs), "--output", str(output), "--messages-field", "messages", "--chat-template",
            str(TEMPLATE), "--image-policy", json.dumps(DYNAMIC), "--num-lanes", str(NUM_LANES),
            "--max-reject-fraction", "1.0", *extra, *IN_MEMORY]


def write_image_chat(root: Path) -> dict:
    """The good, bad and online-rejected conversations sharded under ``root/chat``, their
    tokenizer, and 40 pre-tokenized text documents under ``root/text``."""
    inputs = root / "in"
    good = conversations(inputs)
    write_jsonl(inputs / "chat.jsonl", good + bad_conversations(inputs) + online_rejects())
    tokenizer = image_tokenizer(root / "tokenizer.json")
    shard.run(job_args(inputs / "chat.jsonl", root / "chat"))
    texts = synthetic_texts(40, seed=7, max_words=30)
    write_dataset(str(root / "text"), texts, num_lanes=NUM_LANES, source_name="text",
                  tokenizer=load_tokenizer(tokenizer), keys=[f"text-{k}" for k in range(len(texts))])
    return {"root": root, "inputs": inputs, "good": good, "chat": str(root / "chat"), "text": str(root / "text"),
            "tokenizer": tokenizer}


def chat_and_text_config(data: dict) -> LoaderConfig:
    """The image chat mixed 1:1 with the text, best-fit packed in sequences of ``SEQ_LEN``."""
    datasets = [{"path": data["chat"], "name": "chat", "weight": 0.5},
                {"path": data["text"], "name": "text", "weight": 0.5}]
    return image_config(datasets, data["tokenizer"], seq_len=SEQ_LEN)
