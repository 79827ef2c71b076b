"""The chat tests' shared data: the same conversations sharded offline (``--tokenizer``: ids and
loss masks in the lanes) and online (conversations rendered and tokenized by the loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from beam_jobs import shard
from loader.chat import ConversationRejected, encode_conversation, load_chat_template
from loader.samples import default_tokenizer_path
from loader.stages.tokenizer import load_tokenizer
from tests.chat.chat_factory import make_records
from tests.chat.test_chat_shard import MAX_TOKENS, TEMPLATE, _job_args, _write_jsonl
from tests.loader.settings import eos_id_of


def online_args(inputs, output, *extra) -> list[str]:
    """The job's arguments of :func:`_job_args` without ``--tokenizer``: conversations stay text."""
    args = _job_args(inputs, output, *extra)
    at = args.index("--tokenizer")
    return args[:at] + args[at + 2 :]


def outcome(record, template, tokenizer, **options):
    """The record's encoding, or the reason it is rejected."""
    try:
        return encode_conversation(record, template, tokenizer, **options)
    except ConversationRejected as exc:
        return exc.reason


def write_offline_and_online(base: Path) -> dict[str, Any]:
    """The same conversations sharded offline and online (those both accept: rejects online
    are counted, offline they never reach the lanes), under ``base/offline`` and ``base/online``."""
    template, tokenizer = load_chat_template(TEMPLATE), load_tokenizer(default_tokenizer_path())
    options = dict(max_tokens=MAX_TOKENS, overflow="truncate")
    records = [r for r in make_records(41, 70) if not isinstance(outcome(r, template, tokenizer, **options), str)]
    (base / "in").mkdir()
    _write_jsonl(base / "in" / "chat.jsonl", records)
    extra = ("--chat-max-tokens", str(MAX_TOKENS), "--chat-overflow", "truncate")
    offline = shard.run(_job_args([str(base / "in" / "chat.jsonl")], base / "offline", *extra))
    online = shard.run(online_args([str(base / "in" / "chat.jsonl")], base / "online", *extra))
    return {"base": base, "records": records, "offline": offline, "online": online,
            "eos": eos_id_of(tokenizer), "template": template, "tokenizer": tokenizer}
