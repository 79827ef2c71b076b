"""Conversations longer than a best_fit sequence, decided at load time.

The job records each chat dataset's longest conversation (``chat.longest_tokens``); the loader
refuses best_fit only when it really does not fit, and otherwise takes the config's
``overlong``: "drop" (counted as the transform ``length_tokens``' drops) or "truncate" (after
the last assistant turn that fits; ``truncate_turns``), the same offline and online. The
README's SFT example (``--chat-max-tokens 4095 --chat-overflow truncate``) at seq_len 256 and
4096.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.chat.block import ChatConfigError
from loader.config import LoaderConfig
from loader.io.manifest import read_manifest
from loader.pipeline import ZephonLoader
from loader.transforms.builtins import truncate_turns
from loader.transforms.document import Document
from tests.chat.chat_factory import TEMPLATES_DIR
from tests.finite.epoch_stream import marker, run_stream
from tests.vision.image_datasets import write_jsonl

TEMPLATE = str(TEMPLATES_DIR / "chatml_generation.jinja")
README_FLAGS = ["--chat-loss-on", "all", "--chat-max-tokens", "4095", "--chat-overflow", "truncate"]
FIT = 63  # seq_len 64 minus the loader's EOS


def _records(count: int) -> list[dict]:
    """Conversations of one to four turns; every fourth has long replies (well over FIT tokens)."""
    records = []
    for k in range(count):
        turns = 1 + k % 4
        reply = ("long reply words " * 12) if k % 4 == 3 else "short reply"
        messages = []
        for t in range(turns):
            messages += [{"role": "user", "content": f"{marker(k)} question {t}" if t == 0 else f"more {t}"},
                         {"role": "assistant", "content": f"{reply} {t}"}]
        records.append({"id": f"c{k}", "messages": messages})
    return records


def _shard(base, name: str, records: list[dict], offline: bool) -> str:
    source = base / f"{name}.jsonl"
    if not source.exists():
        write_jsonl(source, records)
    args = ["--input", str(source), "--output", str(base / name), "--id-field", "id", "--messages-field", "messages",
            "--chat-template", TEMPLATE, *README_FLAGS, "--runner=FnApiRunner", "--direct_running_mode=in_memory"]
    shard.run(args + (["--tokenizer", default_tokenizer_path()] if offline else []))
    return str(base / name)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("overlong")
    records = _records(120)
    short = [r for k, r in enumerate(records) if k % 4 != 3]
    return {
        "records": records,
        "offline": _shard(base, "offline", records, True),
        "online": _shard(base, "online", records, False),
        "short": _shard(base, "short", short, True),
        "tokenizer": Tokenizer.from_file(default_tokenizer_path()),
    }


def _config(path: str, seq_len: int, **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path, "max_epochs": 1}], seq_len=seq_len, global_batch_size=8,
                  micro_batch_size=2, seed=5, tokenizer=default_tokenizer_path(), packing="best_fit")
    fields.update(overrides)
    return LoaderConfig(**fields)


def _lengths(path: str) -> dict[int, int]:
    """Each conversation's tokens in the lane files, by its marker number."""
    manifest = read_manifest(path)
    out = {}
    for entry in manifest.files:
        table = pq.read_table(f"{path}/{entry.path}", columns=["key", "num_tokens"])
        for key, tokens in zip(table["key"].to_pylist(), table["num_tokens"].to_pylist()):
            out[int(key[1:])] = tokens
    return out


def test_the_manifest_records_the_longest_conversation(data):
    for name in ("offline", "short"):
        manifest = read_manifest(data[name])
        assert manifest.chat.longest_tokens == max(_lengths(data[name]).values())
        assert manifest.chat.max_tokens == 4095  # the job's bound stays what it was
    assert read_manifest(data["online"]).chat.longest_tokens is None  # nothing tokenized: unknown


@pytest.mark.parametrize("seq_len", (256, 4096))
def test_the_readme_sft_example_loads_where_its_conversations_fit(data, seq_len):
    longest = read_manifest(data["short"]).chat.longest_tokens
    assert longest < 255, "the short set fits seq_len 256"
    stream = run_stream(_config(data["short"], seq_len))
    found = stream.markers(data["tokenizer"], read_manifest(data["short"]).num_lanes)
    assert sorted(found) == [k for k in range(120) if k % 4 != 3] and set(found.values()) == {1}
    # the set with long conversations: longest <= 255? then 256 fits as well, else it is refused exactly
    offline = read_manifest(data["offline"]).chat.longest_tokens
    if offline <= seq_len - 1:
        run_stream(_config(data["offline"], seq_len))
    else:
        with pytest.raises(ChatConfigError, match=f"its longest conversation has {offline} tokens"):
            ZephonLoader(_config(data["offline"], seq_len))


def test_a_conversation_that_does_not_fit_is_refused_naming_the_choices(data, tmp_path):
    longest = read_manifest(data["offline"]).chat.longest_tokens
    assert longest > FIT
    with pytest.raises(ChatConfigError, match=rf"longest conversation has {longest} tokens.*overlong = \"drop\""):
        ZephonLoader(_config(data["offline"], 64))
    # a manifest written before the longest was recorded, without --chat-max-tokens: "may"
    old = tmp_path / "old"
    old.mkdir()
    manifest = read_manifest(data["offline"])
    chat = dataclasses.replace(manifest.chat, longest_tokens=None, max_tokens=None)
    for entry in manifest.files:
        (old / entry.path).parent.mkdir(exist_ok=True)
        (old / entry.path).write_bytes(open(f"{data['offline']}/{entry.path}", "rb").read())
    (old / "manifest.json").write_text(dataclasses.replace(manifest, chat=chat, dataset_fingerprint=None)
                                       .with_fingerprint().to_json())
    with pytest.raises(ChatConfigError, match="did not record its longest conversation"):
        ZephonLoader(_config(str(old), 256))


@pytest.mark.parametrize("overlong", ("drop", "truncate"))
def test_overlong_conversations_are_dropped_or_truncated_alike_offline_and_online(data, overlong):
    lengths = _lengths(data["offline"])
    num_lanes = read_manifest(data["offline"]).num_lanes
    streams = {}
    for name in ("offline", "online"):
        config = _config(data[name], 64, overlong=overlong)
        streams[name] = stream = run_stream(config)
        found = stream.markers(data["tokenizer"], num_lanes)
        assert set(found.values()) == {1}, "a conversation was split or repeated"
        if overlong == "drop":
            assert sorted(found) == sorted(k for k, n in lengths.items() if n <= FIT)
        else:  # every conversation whose first assistant turn fits is kept, cut at a turn's end
            assert set(found) >= {k for k, n in lengths.items() if n <= FIT}
            assert len(found) > len([n for n in lengths.values() if n <= FIT])
        with ZephonLoader(config) as loader:
            for _ in loader:
                pass
            counts = loader.transform_counts()[loader.source_names[0]]
        label = "length_tokens" if overlong == "drop" else "truncate_turns"
        (key,) = [k for k in counts if k.endswith(label)]
        assert counts[key]["dropped"] == 120 - len(found)
    assert streams["offline"].digest() == streams["online"].digest(), "offline and online differ"


def test_truncate_turns_cuts_after_the_last_assistant_turn_that_fits():
    ids = np.arange(12, dtype=np.int32)
    mask = np.array([0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1], dtype=np.uint8)
    doc = Document("k", input_ids=ids, features={"loss_mask": mask})
    assert truncate_turns(doc, max_tokens=12) is doc
    assert truncate_turns(doc, max_tokens=9).input_ids.tolist() == list(range(9))  # turn 6..8 ends at 9
    assert truncate_turns(doc, max_tokens=8).input_ids.tolist() == list(range(4))
    assert truncate_turns(doc, max_tokens=3) is None  # no turn ends within 3 tokens
    with pytest.raises(ValueError, match="no loss_mask"):
        truncate_turns(Document("k", input_ids=ids, features={}), max_tokens=3)
