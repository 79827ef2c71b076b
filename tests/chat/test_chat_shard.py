"""Chat records through ``zephon shard`` (offline rendering + tokenization) and the loader.

Generated conversations (``chat_factory``) plus a few bad records go through one real Beam
run with the ChatML test template and the shipped tokenizer. The reference of every
conversation is :func:`loader.chat.encode_conversation` called directly on the record (itself
checked against ``transformers``' ``apply_chat_template`` in ``test_chat_masks.py``).

A delivered row is checked without the loader's layout: its tokens are parsed back into the
reference documents (``ids + [EOS]``, found by matching the ids), and then every position's
``loss_mask`` must be the reference mask (the EOS takes the last token's value), and its
label the id except -100 where the mask is 0, at a document's first token, and on padding.
Best fit keeps conversations whole (``--chat-max-tokens`` = seq_len - 1), so each row is
whole documents plus padding; concat rows of one lane are laid end to end in global order
(lane ``i mod L`` serves sequence ``i``) and parsed as one stream.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.chat import ConversationRejected, encode_conversation, load_chat_template
from loader.config import LoaderConfig
from loader.io.manifest import DOCUMENT_REJECT_REASONS
from loader.kinds.chat import CHAT_REJECT_REASONS, REJECT_REASONS
from loader.stages.tokenizer import load_tokenizer
from tests.chat.chat_factory import TEMPLATES_DIR, make_records
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.loader.io.test_features import _rows as delivered_rows  # one row collector for feature tests
from tests.loader.settings import eos_id_of

IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]
TEMPLATE = str(TEMPLATES_DIR / "chatml_generation.jinja")
NUM_LANES = 4
SEQ_LEN = 512
MAX_TOKENS = SEQ_LEN - 1  # + the loader's EOS: a conversation fills at most one row
STEPS = 4
GLOBAL_BATCH = 8
ROW_KEYS = ("input_ids", "labels", "loss_mask", "position_ids")

# Bad records, each with the reason the job must give it.
BAD_RECORDS = (
    ({"messages": [{"role": "user", "content": "no reply"}]}, "empty_loss_mask"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown_role"),
    ({"messages": [{"content": "who am I"}, {"role": "assistant", "content": "x"}]}, "missing_role"),
    ({"messages": []}, "empty_conversation"),
    ({"conversation": [{"role": "assistant", "content": "x"}]}, "missing_messages"),
    ({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]}, "non_string_content"),
    ({"messages": [{"role": "user", "content": "a\ud800b"}, {"role": "assistant", "content": "x"}]}, "invalid_utf8"),
)


def _reference(record, template, tokenizer, **options):
    """The record's EncodedConversation, or the reason it is rejected."""
    try:
        return encode_conversation(record, template, tokenizer, **options)
    except ConversationRejected as exc:
        return exc.reason


def _job_args(inputs, output, *extra) -> list[str]:
    return ["--input", *inputs, "--output", str(output), "--messages-field", "messages", "--chat-template",
            TEMPLATE, "--tokenizer", default_tokenizer_path(), "--num-lanes", str(NUM_LANES),
            "--max-reject-fraction", "1.0", *extra, *IN_MEMORY]


def _write_jsonl(path, records) -> None:
    # ensure_ascii keeps the lone surrogate of the invalid_utf8 record as a \ud800 escape
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """One Beam run over 120 conversations in two files plus the bad records."""
    base = tmp_path_factory.mktemp("chat_shard")
    records = make_records(17, 120)
    rng = random.Random(5)
    bad = list(BAD_RECORDS)
    rng.shuffle(bad)
    (base / "in").mkdir()
    _write_jsonl(base / "in" / "a.jsonl", records[:70] + [r for r, _ in bad[:3]])
    _write_jsonl(base / "in" / "b.jsonl", records[70:] + [r for r, _ in bad[3:]])
    manifest = shard.run(_job_args([str(base / "in" / "*.jsonl")], base / "out",
                                   "--chat-max-tokens", str(MAX_TOKENS), "--chat-overflow", "truncate"))
    template, tokenizer = load_chat_template(TEMPLATE), load_tokenizer(default_tokenizer_path())
    encoded = [_reference(r, template, tokenizer, max_tokens=MAX_TOKENS, overflow="truncate") for r in records]
    text_dataset = str(base / "text")
    texts = synthetic_texts(80, seed=4)
    write_dataset(text_dataset, texts, num_lanes=NUM_LANES, source_name="text", tokenizer=tokenizer,
                  keys=[f"text-{k}" for k in range(len(texts))])
    return {"base": base, "manifest": manifest, "records": records, "encoded": encoded,
            "path": str(base / "out"), "text_path": text_dataset, "eos": eos_id_of(tokenizer)}


def test_manifest_lanes_and_rejects(chat):
    manifest = chat["manifest"]
    assert [c["name"] for c in manifest.schema] == ["key", "order_key", "text", "input_ids", "num_tokens",
                                                    "loss_mask"]
    assert set(manifest.rejected) == set(REJECT_REASONS)  # every reason, zeros included
    kept = [e for e in chat["encoded"] if not isinstance(e, str)]
    reasons = [reason for _, reason in BAD_RECORDS] + [e for e in chat["encoded"] if isinstance(e, str)]
    expected = {reason: 0 for reason in REJECT_REASONS}
    for reason in reasons:
        expected[reason] += 1
    assert manifest.rejected == expected
    # documents in = kept + rejected
    assert manifest.documents + sum(manifest.rejected.values()) == len(chat["records"]) + len(BAD_RECORDS)
    assert manifest.documents == len(kept) > 80
    assert manifest.total_tokens == sum(len(e.input_ids) for e in kept)
    rejected = [json.loads(line) for path in sorted((chat["base"] / "out" / "_rejected").glob("*.jsonl"))
                for line in path.read_text().splitlines()]
    assert sorted(r["reason"] for r in rejected) == sorted(reasons)
    assert all(r["detail"] and r["input_file"].endswith(".jsonl") for r in rejected)

    import pyarrow.parquet as pq

    by_key = {}
    for entry in manifest.files:
        table = pq.read_table(chat["base"] / "out" / entry.path)
        assert table.schema.field("loss_mask").type == table.schema.field("input_ids").type  # binary
        footer = pq.ParquetFile(chat["base"] / "out" / entry.path).metadata.row_group(0)
        codecs = {footer.column(k).path_in_schema: footer.column(k).compression for k in range(footer.num_columns)}
        assert codecs["loss_mask"] == codecs["input_ids"] == "LZ4"  # the token codec (--token-compression)
        for row in table.to_pylist():
            by_key[row["key"]] = row
    template = load_chat_template(TEMPLATE)
    truncated = 0
    for index, (record, encoded) in enumerate(zip(chat["records"], chat["encoded"])):
        key = f"{'a' if index < 70 else 'b'}.jsonl#{index if index < 70 else index - 70}"
        if isinstance(encoded, str):
            assert key not in by_key
            continue
        row = by_key[key]
        assert np.array_equal(np.frombuffer(row["input_ids"], "<i4"), encoded.input_ids)
        assert np.array_equal(np.frombuffer(row["loss_mask"], np.uint8), encoded.loss_mask)
        assert row["num_tokens"] == len(encoded.input_ids)
        assert row["text"] == template.render(record["messages"], tools=record.get("tools")).text
        truncated += encoded.truncated
    assert truncated > 0  # the long turns exercise --chat-overflow truncate


def _expected_rows_check(rows: dict[int, dict], documents: list[tuple[np.ndarray, np.ndarray]], eos: int,
                         packing: str, skip=frozenset()) -> int:
    """Check every row against the reference documents; returns the supervised tokens seen."""
    by_head: dict[tuple, list] = {}
    for ids, mask in documents:
        full_ids = np.append(ids, eos)
        full_mask = np.append(mask, mask[-1])  # the EOS takes the last token's mask value
        by_head.setdefault(tuple(full_ids[:4].tolist()), []).append((full_ids, full_mask))

    def parse(ids: np.ndarray, at_start: bool):
        """``(expected mask, expected doc-start flags, end of the parsed part)`` of a token run."""
        mask, starts, p = np.zeros(len(ids), np.uint8), np.zeros(len(ids), bool), 0
        while p < len(ids):
            candidates = by_head.get(tuple(ids[p : p + 4].tolist()), [])
            match = [(d, m) for d, m in candidates if np.array_equal(ids[p : p + len(d)], d[: len(ids) - p])]
            if not match:
                break
            d, m = match[0]
            n = min(len(d), len(ids) - p)
            assert all(np.array_equal(m[:n], other[:n]) for _, other in match)
            mask[p : p + n], starts[p] = m[:n], True
            p += n
        return mask, starts, p

    supervised = 0
    if packing == "best_fit":
        runs = [([index], row["input_ids"]) for index, row in sorted(rows.items())]
    else:  # one run per lane of the chat source's rows, in global order
        lanes: dict[int, list[int]] = {}
        for index in sorted(rows):
            if index not in skip:
                lanes.setdefault(index % NUM_LANES, []).append(index)
        runs = [(indices, np.concatenate([rows[i]["input_ids"] for i in indices])) for indices in lanes.values()]
    for indices, ids in runs:
        if set(indices) & skip:
            continue
        mask, starts, end = parse(ids, True)
        if packing == "best_fit":
            assert end > 0 and (ids[end:] == eos).all(), f"row {indices}: not whole documents + padding"
        else:
            assert end == len(ids), f"lane run {indices}: the stream is not the reference documents"
        labels = np.where((mask == 0) | starts, -100, ids)
        labels[end:] = -100
        for k, index in enumerate(indices):
            row, window = rows[index], slice(k * SEQ_LEN, (k + 1) * SEQ_LEN)
            np.testing.assert_array_equal(row["loss_mask"], mask[window], err_msg=f"row {index}: loss_mask")
            np.testing.assert_array_equal(row["labels"], labels[window], err_msg=f"row {index}: labels")
            supervised += int((row["labels"] != -100).sum())
    return supervised


def _config(datasets, packing: str, **overrides) -> LoaderConfig:
    fields = dict(datasets=datasets, seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, micro_batch_size=2, seed=11,
                  tokenizer=default_tokenizer_path(), packing=packing, best_fit_open_bins=4, num_workers=0,
                  prefetch=2, worker_timeout_s=60.0, add_bos=False, add_eos=True)
    fields.update(overrides)
    return LoaderConfig(**fields)


def _rows(config: LoaderConfig, *, world_size: int = 1) -> dict[int, dict]:
    """Every global index's row over ``STEPS`` steps, ranks simulated in one process."""
    return delivered_rows(config, world_size=world_size, steps=STEPS, output="numpy")


def _documents(chat) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(e.input_ids, e.loss_mask) for e in chat["encoded"] if not isinstance(e, str)]


@pytest.mark.parametrize("packing", ("best_fit", "concat"))
def test_batches_carry_the_reference_masks_and_labels(chat, packing):
    rows = _rows(_config([{"path": chat["path"]}], packing))
    assert len(rows) == STEPS * GLOBAL_BATCH
    supervised = _expected_rows_check(rows, _documents(chat), chat["eos"], packing)
    tokens = sum(int((r["input_ids"] != chat["eos"]).sum()) for r in rows.values())
    assert 0 < supervised < tokens  # masks are neither empty nor all ones


def test_batches_are_the_same_on_every_topology(chat):
    config = _config([{"path": chat["path"]}], "best_fit")
    reference = _rows(config)
    for world_size, workers in ((2, 0), (1, 2)):
        rows = _rows(config.replace(num_workers=workers), world_size=world_size)
        assert rows.keys() == reference.keys()
        for index, row in rows.items():
            for key in ROW_KEYS:
                np.testing.assert_array_equal(row[key], reference[index][key],
                                              err_msg=f"W={world_size} workers={workers} row {index}: {key}")


def test_a_mix_with_a_pretraining_text_source(chat):
    datasets = [{"path": chat["path"], "name": "chat", "weight": 0.5},
                {"path": chat["text_path"], "name": "text", "weight": 0.5}]
    rows = _rows(_config(datasets, "best_fit"))
    text_rows = {i for i, r in rows.items() if int(r["source_ids"]) == 1}
    assert text_rows and len(text_rows) < len(rows)
    _expected_rows_check({i: r for i, r in rows.items() if i not in text_rows}, _documents(chat), chat["eos"],
                         "best_fit")
    for index in text_rows:  # pretraining rows: mask 1 on every token but the padding tail
        row = rows[index]
        content = np.flatnonzero(row["input_ids"] != chat["eos"])
        padding = np.zeros(SEQ_LEN, bool)
        padding[content.max() + 2 :] = True  # after the last document's EOS
        np.testing.assert_array_equal(row["loss_mask"], np.where(padding, 0, 1), err_msg=f"row {index}")
        assert (row["labels"][padding] == -100).all()
        # the mask takes nothing away: labels are the ids but at document starts (a continued
        # long document's piece starts a segment too, with its label kept)
        ignored = (row["labels"] == -100) & ~padding
        assert (row["position_ids"][ignored] == 0).all() and ignored[0]
        np.testing.assert_array_equal(row["labels"][~ignored & ~padding], row["input_ids"][~ignored & ~padding])


def test_too_long_rejects_and_option_errors(chat, tmp_path):
    inputs = [str(chat["base"] / "in" / "b.jsonl")]
    manifest = shard.run(_job_args(inputs, tmp_path / "reject", "--chat-max-tokens", "300", "--chat-loss-on", "last",
                                   "--num-lanes", "1"))
    template, tokenizer = load_chat_template(TEMPLATE), load_tokenizer(default_tokenizer_path())
    outcomes = [_reference(r, template, tokenizer, loss_on="last", max_tokens=300) for r in chat["records"][70:]]
    too_long = outcomes.count("too_long")
    assert 0 < too_long and manifest.rejected["too_long"] == too_long
    assert manifest.documents == sum(not isinstance(o, str) for o in outcomes)
    # text jobs keep recording the document reasons only (their manifests are unchanged)
    assert set(DOCUMENT_REJECT_REASONS) & set(CHAT_REJECT_REASONS) == set()

    online, _ = shard.parse_args(["--input", "x.jsonl", "--output", "o", "--messages-field", "messages",
                                  "--chat-template", TEMPLATE])  # without --tokenizer: encoded online
    assert online.chat and online.chat_online
    with pytest.raises(shard.ShardConfigError, match="--chat-max-tokens apply to chat records only"):
        shard.parse_args(["--input", "x.jsonl", "--output", "o", "--chat-max-tokens", "9"])
    with pytest.raises(shard.ShardConfigError, match="needs --chat-template"):
        shard.parse_args(["--input", "x.jsonl", "--output", "o", "--messages-field", "m", "--tokenizer", "t.json"])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(shard.ShardConfigError, match="--chat-template .*broken.jinja"):
        shard.run(_job_args(inputs, tmp_path / "broken", "--chat-template", str(broken)))
    text_input = tmp_path / "doc.txt"
    text_input.write_text("a text file is one document, not a conversation")
    with pytest.raises(shard.ShardConfigError, match="cannot apply to text input"):
        shard.run(_job_args([str(text_input)], tmp_path / "text"))


def test_a_tokenizer_config_template_and_files_changed_under_the_job(tmp_path):
    """--chat-template may be a tokenizer_config.json; workers refuse a template or tokenizer
    whose fingerprint differs from the one taken at launch."""
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": (TEMPLATES_DIR / "chatml_generation.jinja").read_text(),
                                  "eos_token": "<|endoftext|>"}))
    options, _ = shard.parse_args(["--input", "x.jsonl", "--output", str(tmp_path / "o"), "--messages-field",
                                   "messages", "--chat-template", str(config), "--tokenizer", default_tokenizer_path()])
    from beam_jobs.chat_records import ChatEncoder
    from loader.stages.tokenizer import describe

    spec = shard.load_chat_spec(options)
    assert spec.tokenizer_fingerprint == describe(load_tokenizer(default_tokenizer_path())).fingerprint
    encoder = ChatEncoder.load(spec)
    assert encoder.template.special_tokens["eos_token"] == "<|endoftext|>"
    text, (ids, mask) = encoder.encode(make_records(3, 1)[0])
    assert text.startswith("<|im_start|>") and len(ids) == 4 * len(mask) and 0 < sum(mask) < len(mask)
    from dataclasses import replace

    for changed in (replace(spec, template_fingerprint="0" * 64), replace(spec, tokenizer_fingerprint="0" * 64)):
        with pytest.raises(RuntimeError, match="changed while the job ran"):
            ChatEncoder.load(changed)
    padded = load_tokenizer(default_tokenizer_path())
    padded.enable_padding()
    padded.save(str(tmp_path / "padded.json"))
    with pytest.raises(shard.ShardConfigError, match="truncation or padding enabled"):
        shard.load_chat_spec(replace(options, tokenizer=str(tmp_path / "padded.json")))
