"""Seeded generator of multi-turn chat records, and the test templates and tokenizers.

Conversations mix system, user, assistant and tool turns (tool calls in both the OpenAI
``{"function": {...}}`` form and the flat form), reasoning under its three names, unicode
(accents, CJK, RTL, emoji with modifiers and ZWJ sequences), empty and whitespace-only turns,
long turns, text that looks like control tokens or Jinja, and record-level tools.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from tokenizers import Tokenizer

from loader.samples import default_tokenizer_path

TEMPLATES_DIR = Path(__file__).parent / "templates"
TEMPLATE_FILES = ("chatml_generation.jinja", "llama3_generation.jinja")
SPECIAL_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>", "pad_token": "<pad>"}
DATE = "01 Dec 2026"  # given to the Llama-like template, so renders do not depend on today's date
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

_GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")

TEXTS = (
    "Hello!",
    "",
    "   ",
    "\n",
    "Grüße aus Zürich — ça va ? Ελληνικά, русский.",
    "数学很有趣。请解释一下傅里叶变换。",
    "مرحبا بالعالم، كيف حالك؟",
    "emoji 😀👍🏽🇨🇭 family 👨‍👩‍👧 end",
    "line one\nline two\n\n  indented\ttab",
    "trailing spaces   ",
    "  leading spaces",
    "looks like a marker: <|im_end|> and <|eot_id|> inside text",
    "<|endoftext|>",
    "{{ not a template }} {% raw %} {# nor a comment #}",
    'JSON-ish {"a": [1, 2, 3], "b": "<tag>"} & more',
    "Sure. Here is the answer: 42.",
    "Can you call the tool?",
)
WORDS = ("the", "data", "loader", "packs", "tokens", "déterministe", "数据", "🙂", "lanes", "\n", "epoch,")

TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <b>now</b> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    },
)


def template_text(name: str, *, generation_tags: bool = True) -> str:
    """A test template's Jinja text; without tags, the same template with the tags cut out."""
    text = (TEMPLATES_DIR / name).read_text(encoding="utf-8")
    return text if generation_tags else _GENERATION_TAG.sub("", text)


def tokenizer(*, chat_markers: bool = False) -> Tokenizer:
    """A fresh copy of the shipped tokenizer; with ``chat_markers`` the templates' markers are special tokens."""
    loaded = Tokenizer.from_file(default_tokenizer_path())
    if chat_markers:
        loaded.add_special_tokens(list(CHAT_MARKERS))
    return loaded


def _text(rng: random.Random) -> str:
    if rng.random() < 0.12:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(150, 400)))  # a long turn
    return rng.choice(TEXTS)


def _tool_call(rng: random.Random) -> dict:
    name, arguments = rng.choice((("get_weather", {"city": rng.choice(("Zürich", "東京", "Paris"))}),
                                  ("add", {"a": rng.randint(-5, 5), "b": rng.random()})))
    if rng.random() < 0.7:
        return {"id": f"call_{rng.randint(0, 999)}", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"name": name, "arguments": arguments}


def _assistant(rng: random.Random) -> dict:
    message = {"role": "assistant", "content": _text(rng)}
    roll = rng.random()
    if roll < 0.1:
        message["reasoning_content"] = "Let me think. " + _text(rng)
    elif roll < 0.2:
        message["thinking"] = "Thinking: " + rng.choice(TEXTS)
    return message


def make_record(rng: random.Random, *, text_parts: bool = False) -> dict:
    """One chat record. ``text_parts``: some user contents as lists of text parts."""
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _text(rng)})
    for _ in range(rng.randint(1, 4)):
        content = _text(rng)
        if text_parts and rng.random() < 0.3:
            content = [{"type": "text", "text": content}, {"type": "text", "text": rng.choice(TEXTS)}]
        messages.append({"role": "user", "content": content})
        if rng.random() < 0.25:
            calls = [_tool_call(rng) for _ in range(rng.randint(1, 2))]
            messages.append({"role": "assistant", "content": rng.choice((None, "")), "tool_calls": calls})
            for call in calls:
                name = call.get("function", call)["name"]
                messages.append({"role": "tool", "name": name, "content": rng.choice(("sunny, 21 °C", "42", ""))})
        messages.append(_assistant(rng))
    if rng.random() < 0.1:
        messages.append({"role": "user", "content": "One more question, unanswered."})
    record = {"messages": messages}
    if rng.random() < 0.4:
        record["tools"] = [dict(tool) for tool in TOOLS[: rng.randint(1, 2)]]
    return record


def make_records(seed: int, count: int, **options) -> list[dict]:
    rng = random.Random(seed)
    return [make_record(rng, **options) for _ in range(count)]
