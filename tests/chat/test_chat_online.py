"""Online chat: conversations stored by ``zephon shard`` without ``--tokenizer`` and rendered,
tokenized and masked by the loader (``loader.chat.block``).

* Offline and online lanes hold the same conversations in the same layout (their batches are
  compared on every topology by the elastic matrix, ``tests/elastic``).
* Online rejects (``empty_loss_mask``, ``full_loss_mask``, ``too_long``) are counted per
  reason in each micro-batch's ``chat_rejects``, the same on every topology and across a
  resume, and their conversations never reach a batch.
* ``best_fit`` never splits a conversation: with no length bound in the manifest the loader
  cuts at ``seq_len`` minus its EOS; every segment of every row (``cu_seqlens``) is one whole
  reference conversation, position ids restart at each one. A pre-tokenized chat source
  whose conversations may not fit is refused.
* A resume on a dataset re-sharded with another template is refused.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Optional

import numpy as np
import pyarrow.parquet as pq
import pytest

from beam_jobs import shard
from loader.chat import load_chat_template
from loader.chat import block as chat_block
from loader.chat.block import ONLINE_REJECT_REASONS, ChatConfigError
from loader.checkpoint.state import StateError
from loader.io.manifest import read_manifest
from loader.pipeline import ZephonLoader
from tests.chat.chat_factory import TEMPLATES_DIR, make_records
from tests.chat.conftest import online_args, outcome, write_offline_and_online
from tests.chat.test_chat_shard import MAX_TOKENS, NUM_LANES, _config, _job_args, _write_jsonl
from tests.resume_harness import MaskedLoaderRun, RecordingLoader, check_resume

STEPS = 4
# W 1 uninterrupted; cut: W 2 with 2 workers, W 4, then W 1 again.
RESUME = ({"world_size": 1, "num_workers": 0, "micro_batch_size": 4},
          {"world_size": 2, "num_workers": 2, "micro_batch_size": 2},
          {"world_size": 4, "num_workers": 0, "micro_batch_size": 2})


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Any]:
    return write_offline_and_online(tmp_path_factory.mktemp("chat_online"))


def _dataset(shards, kind: str) -> list[dict]:
    return [{"path": str(shards["base"] / kind), "name": "chat"}]


def test_online_lanes_hold_the_conversations_with_the_offline_layout(shards):
    online, offline = shards["online"], shards["offline"]
    assert [c["name"] for c in online.schema] == ["key", "order_key", "text", "conversation"]
    assert not online.pretokenized and online.online_chat and online.total_tokens is None
    assert online.chat.tokenized is False and offline.chat.tokenized is True
    assert online.chat.template["sources"]["default"] == (TEMPLATES_DIR / "chatml_generation.jinja").read_text()
    assert online.chat.template_fingerprint == offline.chat.template_fingerprint
    assert (online.chat.max_tokens, online.chat.overflow, online.chat.loss_on) == (MAX_TOKENS, "truncate", "all")
    # the same documents in the same files and row groups (the text column is the same render)
    assert online.documents == offline.documents == len(shards["records"])
    assert [(f.path, f.rows, f.row_groups) for f in online.files] == [(f.path, f.rows, f.row_groups) for f in offline.files]
    by_key = {}
    for entry in offline.files:
        for row in pq.read_table(shards["base"] / "offline" / entry.path, columns=["key", "text"]).to_pylist():
            by_key[row["key"]] = row["text"]
    for entry in online.files:
        table = pq.read_table(shards["base"] / "online" / entry.path)
        for row in table.to_pylist():
            assert row["text"] == by_key[row["key"]]
            record = shards["records"][int(row["key"].rsplit("#", 1)[1])]
            conversation = json.loads(row["conversation"])
            assert [m["role"] for m in conversation["messages"]] == [m["role"] for m in record["messages"]]
            assert conversation.get("tools") == record.get("tools")
    # the chat entry is part of the dataset fingerprint
    assert online.dataset_fingerprint != offline.dataset_fingerprint


# -- online rejects -----------------------------------------------------------------------

# A template whose generation tags cover the whole conversation: every conversation whose
# render holds user text is a full_loss_mask reject.
TAG_EVERYTHING = ("{% generation %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{% endgeneration %}")
REJECT_MAX_TOKENS = 500  # < seq_len - 1: the same bound under both packings


class _RejectRecording(RecordingLoader):
    """Also sums each micro-batch's ``chat_rejects`` into ``totals`` (per step, via ``sink``)."""

    def __init__(self, loader, sink: dict[int, bytes], rejects: list) -> None:
        super().__init__(loader, sink)
        self._rejects = rejects

    def __next__(self) -> dict:
        batch = super().__next__()
        assert list(batch["chat_rejects"]) == list(ONLINE_REJECT_REASONS)  # every reason, zeros included
        self._rejects.append(dict(batch["chat_rejects"]))
        return batch


class RejectLoaderRun(MaskedLoaderRun):
    """A step line that also says how many conversations were rejected online during the step."""

    def __init__(self, config, world_size: int = 1, **options) -> None:
        super().__init__(config, world_size, **options)
        self.rejects: list = []
        self.loaders = [_RejectRecording(loader._loader, self.masks, self.rejects) for loader in self.loaders]

    def _step(self) -> Optional[str]:
        self.rejects.clear()
        line = super()._step()
        if line is None:
            return None
        total = Counter()
        for counts in self.rejects:
            total.update(counts)
        return line + " rejects=" + ",".join(f"{r}:{total[r]}" for r in ONLINE_REJECT_REASONS)


@pytest.fixture(scope="module")
def rejecting(tmp_path_factory, shards) -> dict[str, Any]:
    """Two online sources whose conversations include online rejects of every reason."""
    base = tmp_path_factory.mktemp("chat_online_rejects")
    (base / "in").mkdir()
    template, tokenizer = shards["template"], shards["tokenizer"]
    records = make_records(7, 60)
    for k in range(0, 60, 9):  # no assistant turn: empty_loss_mask online
        records[k] = {"messages": [{"role": "user", "content": f"question {k} with no answer"}]}
    _write_jsonl(base / "in" / "a.jsonl", records)
    bound = ("--chat-max-tokens", str(REJECT_MAX_TOKENS))
    # one lane: a run with exhaustion="stop" delivers the whole epoch (global batch 1)
    a = shard.run(online_args([str(base / "in" / "a.jsonl")], base / "a", *bound, "--num-lanes", "1"))
    # NUM_LANES lanes, for the topology test (concat): a looser bound, fewer rejects, fewer epochs
    shard.run(online_args([str(base / "in" / "a.jsonl")], base / "a4", "--chat-max-tokens", "1000"))
    tag_all = base / "tag_all.jinja"
    tag_all.write_text(TAG_EVERYTHING)
    simple = [{"messages": [{"role": "user", "content": f"hi {k}"}, {"role": "assistant", "content": f"hello {k}"}]}
              if k % 2 else {"messages": [{"role": "assistant", "content": f"only the assistant speaks {k}"}]}
              for k in range(16)]  # odd: full_loss_mask (user text tagged), even: accepted
    _write_jsonl(base / "in" / "b.jsonl", simple)
    b = shard.run(online_args([str(base / "in" / "b.jsonl")], base / "b", "--chat-template", str(tag_all),
                               "--num-lanes", "1"))
    expected_a = Counter(o for o in (outcome(r, template, tokenizer, max_tokens=REJECT_MAX_TOKENS) for r in records)
                         if isinstance(o, str))
    b_template = load_chat_template(str(tag_all))
    outcomes_b = [outcome(r, b_template, tokenizer) for r in simple]
    return {"a": a, "b": b, "base": base, "expected": {"a": expected_a, "b": Counter(o for o in outcomes_b
                                                                                    if isinstance(o, str))},
            "accepted": {"a": [o for o in (outcome(r, template, tokenizer, max_tokens=REJECT_MAX_TOKENS)
                                          for r in records) if not isinstance(o, str)],
                         "b": [o for o in outcomes_b if not isinstance(o, str)]}}


def test_the_reject_fixture_exercises_every_online_reason(rejecting):
    assert set(rejecting["expected"]["a"]) == {"empty_loss_mask", "too_long"}
    assert rejecting["expected"]["b"] == Counter({"full_loss_mask": 8})
    # the job refused nothing of these: every reason needs the tokens
    assert sum(rejecting["a"].rejected.values()) == sum(rejecting["b"].rejected.values()) == 0


def _segments(row: dict) -> list[np.ndarray]:
    """The documents of a best-fit row: position ids restart at each one; the tail is padding."""
    starts = np.flatnonzero(row["position_ids"] == 0).tolist() + [len(row["input_ids"])]
    return [row["input_ids"][a:b] for a, b in zip(starts, starts[1:])]


def _one_epoch(config) -> tuple[list[dict], Counter]:
    rows, rejects = [], Counter()
    with ZephonLoader(config, output="numpy") as loader:
        for batch in loader:
            rejects.update(batch["chat_rejects"])
            for k in range(len(batch["global_indices"])):
                rows.append({key: batch[key][k] for key in ("input_ids", "labels", "loss_mask", "position_ids")})
    return rows, rejects


@pytest.mark.parametrize("source", ("a", "b"))
def test_online_rejects_are_counted_per_reason_and_never_trained_on(rejecting, shards, source, caplog, monkeypatch):
    # The first reject of each reason is logged once per process: forget those of earlier tests.
    monkeypatch.setattr(chat_block, "_logged_reasons", set())
    config = _config([{"path": str(rejecting["base"] / source), "exhaustion": "stop"}], "best_fit",
                     global_batch_size=1, micro_batch_size=1)
    with caplog.at_level("WARNING", logger="loader.chat.block"):
        rows, rejects = _one_epoch(config)
    assert rejects == {reason: rejecting["expected"][source].get(reason, 0) for reason in ONLINE_REJECT_REASONS}
    # every accepted conversation delivered whole, exactly once per epoch; nothing else
    eos = shards["eos"]
    delivered = Counter(tuple(doc.tolist()) for row in rows for doc in _segments(row) if set(doc.tolist()) != {eos})
    expected = Counter(tuple(np.append(e.input_ids, eos).tolist()) for e in rejecting["accepted"][source])
    assert delivered == expected
    logged = [r.getMessage() for r in caplog.records if "rejected online" in r.getMessage()]
    assert logged and len(logged) <= len(ONLINE_REJECT_REASONS)


def test_reject_counts_are_the_same_on_every_topology_and_across_a_resume(rejecting):
    config = _config([{"path": str(rejecting["base"] / "a4"), "name": "chat"}], "concat", micro_batch_size=2)

    def make(k: int) -> RejectLoaderRun:  # W 1 uninterrupted; cut: W 2 with 2 workers, W 4, W 1
        topology = dict(RESUME[k % len(RESUME)])
        world_size = topology.pop("world_size")
        return RejectLoaderRun(config.replace(**topology), world_size, workers_serve=True)

    report = check_resume(make, steps=STEPS, cut_points=[1, 3])
    counted = [sum(int(part.split(":")[1]) for part in line.split("rejects=")[1].split(",")) for line in report.baseline]
    assert all(counted[:1]) and sum(counted) > counted[0]  # every step's first row groups, then later ones


# -- best_fit keeps conversations whole ----------------------------------------------------

SHORT_SEQ_LEN = 256


@pytest.fixture(scope="module")
def unbounded(tmp_path_factory, shards) -> dict[str, Any]:
    """Conversations sharded without --chat-max-tokens (overflow truncate), online and offline."""
    base = tmp_path_factory.mktemp("chat_unbounded")
    (base / "in").mkdir()
    records = make_records(13, 40)
    _write_jsonl(base / "in" / "c.jsonl", records)
    shard.run(online_args([str(base / "in" / "c.jsonl")], base / "online", "--chat-overflow", "truncate",
                           "--num-lanes", "1"))  # one lane: exhaustion="stop" delivers the whole epoch
    shard.run(_job_args([str(base / "in" / "c.jsonl")], base / "offline", "--chat-overflow", "truncate"))
    return {"base": base, "records": records}


def test_best_fit_never_splits_a_conversation_and_positions_restart_per_conversation(unbounded, shards):
    config = _config([{"path": str(unbounded["base"] / "online"), "exhaustion": "stop"}], "best_fit",
                     seq_len=SHORT_SEQ_LEN, global_batch_size=1, micro_batch_size=1)
    fit = SHORT_SEQ_LEN - 1  # the loader's EOS
    outcomes = [outcome(r, shards["template"], shards["tokenizer"], max_tokens=fit, overflow="truncate")
                for r in unbounded["records"]]
    accepted = [o for o in outcomes if not isinstance(o, str)]
    assert sum(o.truncated for o in accepted) > 0  # long conversations were cut at the fit, not split
    eos = shards["eos"]
    expected = Counter(tuple(np.append(o.input_ids, eos).tolist()) for o in accepted)
    by_mask = {tuple(np.append(o.input_ids, eos).tolist()): np.append(o.loss_mask, o.loss_mask[-1]) for o in accepted}
    delivered: Counter = Counter()
    with ZephonLoader(config.replace(batch_fields=("input_ids", "labels", "position_ids", "cu_seqlens", "loss_mask")),
                      output="numpy") as loader:
        for batch in loader:
            cu = batch["cu_seqlens"].tolist()
            flat_ids = batch["input_ids"].reshape(-1)
            flat_positions = batch["position_ids"].reshape(-1)
            flat_mask = batch["loss_mask"].reshape(-1)
            for a, b in zip(cu, cu[1:]):
                assert a // SHORT_SEQ_LEN == (b - 1) // SHORT_SEQ_LEN, f"segment [{a}, {b}) crosses a row"
                np.testing.assert_array_equal(flat_positions[a:b], np.arange(b - a))  # restart per segment
                doc = tuple(flat_ids[a:b].tolist())
                if doc in by_mask:
                    delivered[doc] += 1
                    np.testing.assert_array_equal(flat_mask[a:b], by_mask[doc])
                else:  # the padding tail of a row: the rest of the row, nothing supervised
                    assert set(doc) == {eos} and b % SHORT_SEQ_LEN == 0 and not flat_mask[a:b].any(), \
                        f"segment [{a}, {b}) is neither a whole conversation nor padding"
    assert delivered == expected  # each conversation whole, once, in one sequence


def test_a_pretokenized_chat_source_that_does_not_fit_is_refused_under_best_fit(unbounded, shards):
    """Refused on its recorded longest conversation, not on the job's bound (issue 30)."""
    longest = read_manifest(str(unbounded["base"] / "offline")).chat.longest_tokens
    assert longest > SHORT_SEQ_LEN - 1
    with pytest.raises(ChatConfigError, match=f"its longest conversation has {longest} tokens.*--chat-max-tokens 255"):
        ZephonLoader(_config([{"path": str(unbounded["base"] / "offline")}], "best_fit", seq_len=SHORT_SEQ_LEN))
    bounded = shards["offline"].chat.longest_tokens
    assert SHORT_SEQ_LEN - 1 < bounded <= MAX_TOKENS
    with pytest.raises(ChatConfigError, match=f"its longest conversation has {bounded} tokens, more than seq_len=256"):
        ZephonLoader(_config(_dataset(shards, "offline"), "best_fit", seq_len=SHORT_SEQ_LEN))
    ZephonLoader(_config(_dataset(shards, "offline"), "best_fit", seq_len=bounded + 1)).close()  # it fits exactly
    ZephonLoader(_config([{"path": str(unbounded["base"] / "offline")}], "concat", seq_len=SHORT_SEQ_LEN)).close()


def test_a_resume_on_a_dataset_sharded_with_another_template_is_refused(shards, tmp_path):
    changed = tmp_path / "chatml_changed.jinja"
    changed.write_text("{# another revision #}\n" + (TEMPLATES_DIR / "chatml_generation.jinja").read_text())
    other = shard.run(online_args([str(shards["base"] / "in" / "chat.jsonl")], tmp_path / "online",
                                   "--chat-template", str(changed), "--chat-max-tokens", str(MAX_TOKENS),
                                   "--chat-overflow", "truncate"))
    assert other.chat.template_fingerprint != shards["online"].chat.template_fingerprint
    with ZephonLoader(_config(_dataset(shards, "online"), "concat")) as loader:
        next(loader)
        state = loader.state_dict()
    with ZephonLoader(_config([{"path": str(tmp_path / "online"), "name": "chat"}], "concat")) as loader:
        with pytest.raises(StateError, match="dataset_fingerprint"):
            loader.load_state_dict(state)


# -- a mix with pretraining text ------------------------------------------------------------

MIX_STEPS = 8


def test_online_chat_mixes_with_pretraining_text_under_a_schedule_and_exhaustion(shards, tmp_path):
    """Online chat + a text source (tokenized online too), a schedule that changes the weights
    at step 2 and a text source that runs out (exhaustion "stop") at step 3: the same step
    lines as with the offline chat dataset, the schedule's counts until the text stops, chat only after."""
    from tests.dataset_factory import synthetic_texts, write_dataset

    texts = synthetic_texts(100, seed=3, max_words=60)  # lasts about 3 steps at its shares
    write_dataset(str(tmp_path / "text"), texts, num_lanes=NUM_LANES, source_name="text",
                  keys=[f"text-{k}" for k in range(len(texts))])
    text = {"path": str(tmp_path / "text"), "name": "text", "weight": 0.5, "exhaustion": "stop"}
    schedule = [{"step": 2, "weights": {"chat": 0.25, "text": 0.75}}]

    def lines(kind: str, world_size: int = 1, num_workers: int = 0) -> list[str]:
        config = _config([{**_dataset(shards, kind)[0], "weight": 0.5}, text], "best_fit", schedule=schedule,
                         num_workers=num_workers)
        run = MaskedLoaderRun(config, world_size)
        try:
            return run.run(MIX_STEPS)
        finally:
            run.close()

    reference = lines("offline")
    assert len(reference) == MIX_STEPS
    assert lines("online") == reference  # (topologies: the tests above)
    counts = [dict(part.split("=") for part in line.split(" loss_mask=")[0].split()[2:]) for line in reference]
    assert counts[0] == counts[1] == {"chat": "4", "text": "4"}  # weights 1:1 of 8 sequences
    assert counts[2] == {"chat": "2", "text": "6"}  # the schedule: 1:3 from step 2
    text_rows = [int(c["text"]) for c in counts]
    assert text_rows[-1] == 0 and text_rows[2:] == sorted(text_rows[2:], reverse=True), counts  # text runs out
    assert all(int(c["chat"]) + int(c["text"]) == 8 for c in counts)  # its share went to chat


def test_a_bad_or_edited_chat_entry_of_the_manifest_is_refused_naming_it(shards):
    from loader.io.manifest import Manifest, ManifestError

    data = json.loads((shards["base"] / "online" / "manifest.json").read_text())
    assert Manifest.from_dict(data).chat == shards["online"].chat
    bad = dict(data, chat=dict(data["chat"], loss_on="first", max_tokens=0, colour="red"))
    with pytest.raises(ManifestError, match=r"chat: unknown fields \['colour'\].*'loss_on' must be one of "
                                            r"\('all', 'last'\).*'max_tokens' must be a positive int"):
        Manifest.from_dict(bad)
    no_template = dict(data, chat={k: v for k, v in data["chat"].items() if k != "template"})
    with pytest.raises(ManifestError, match="'template' is missing"):
        Manifest.from_dict(no_template)
    edited = dict(data, chat=dict(data["chat"], loss_on="last"))  # valid, but not what the job wrote
    with pytest.raises(ManifestError, match="dataset_fingerprint .* does not match its content"):
        Manifest.from_dict(edited)


def test_reject_counts_under_token_mixing_survive_a_resume(rejecting, tmp_path):
    """A token mix reads whole rows ahead of what it hands out: the counts follow the saved
    cursors, so a resume on another W counts each row group once, as the uninterrupted run."""
    from tests.dataset_factory import synthetic_texts, write_dataset

    texts = synthetic_texts(120, seed=3)
    write_dataset(str(tmp_path / "text"), texts, num_lanes=NUM_LANES, source_name="text",
                  keys=[f"t{k}" for k in range(len(texts))])
    config = _config([{"path": str(rejecting["base"] / "a4"), "name": "chat", "weight": 0.5},
                      {"path": str(tmp_path / "text"), "name": "text", "weight": 0.5}], "concat",
                     mixing_unit="token", micro_batch_size=2)
    topologies = (1, 2, 4, 1)

    def make(k: int) -> RejectLoaderRun:
        return RejectLoaderRun(config, topologies[k])

    report = check_resume(make, steps=STEPS, cut_points=[1, 3])
    assert any(not line.endswith("empty_loss_mask:0,full_loss_mask:0,too_long:0") for line in report.baseline)
