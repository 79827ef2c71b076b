"""The same transforms offline (``zephon shard --transform``) and online give the same batches;
exact deduplication (``--dedup exact``) is the same on every runner mode and input split, and
every input record is accounted for.
"""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from beam_jobs import shard
from beam_jobs.dedup import normalize_text, read_removed
from beam_jobs.sample_data import default_tokenizer_path
from tests.dataset_factory import synthetic_texts
from tests.resume_harness import LoaderRun, lane_epochs
from tests.transforms.conftest import F, loader_config

IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]
MULTI_PROCESSING = ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=2"]
NUM_LANES = 4
STEPS = 5  # inside every lane's first epoch (checked): later epochs shuffle the rows each lane file holds
# A metadata filter, a text filter, a map and a seeded random map; each spec as the loader config
# names it and as --transform spells it.
TRANSFORMS = (
    ({"function": "drop_metadata", "args": {"field": "lang", "values": ["de"]}},
     'drop_metadata:{"field": "lang", "values": ["de"]}'),
    ({"function": F + "drop_multiple_of_three"}, F + "drop_multiple_of_three"),
    ({"function": F + "shout_every_other_word"}, F + "shout_every_other_word"),
    ({"function": F + "drop_random_words", "args": {"p": 0.3}}, F + 'drop_random_words:{"p": 0.3}'),
)


def _records() -> list[dict]:
    texts = synthetic_texts(150, seed=23, max_words=30)
    records = [{"id": f"r{k:04d}", "text": t, "lang": ("en", "de", "fr")[k % 3]} for k, t in enumerate(texts)]
    # Duplicates: exact copies, copies differing in case / whitespace / Unicode form (the same
    # normalised text), and a near-copy that differs by one character (not a duplicate).
    for k in range(0, 40, 2):
        base = records[k]["text"]
        records.append({"id": f"dup{k:04d}a", "text": base, "lang": "en"})
        records.append({"id": f"dup{k:04d}b", "text": "  " + base.upper().replace(" ", " \t "), "lang": "fr"})
    records.append({"id": "nfkc", "text": "ﬁle ＡＢＣ", "lang": "en"})
    records.append({"id": "nfkc2", "text": "FILE abc", "lang": "en"})
    records.append({"id": "near", "text": records[0]["text"] + "!", "lang": "en"})
    return records


def _write(path, records) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records) + "{not json\n",
                    encoding="utf-8")


def _shard(inputs, output, *extra) -> dict:
    manifest = shard.run(["--input", *map(str, inputs), "--output", str(output), "--id-field", "id",
                          "--keep-fields", "lang", "--num-lanes", str(NUM_LANES), "--max-reject-fraction", "0.5",
                          *extra])
    with open(f"{output}/manifest.json") as fh:
        return {"manifest": manifest, "json": json.load(fh)}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("offline")
    records = _records()
    (base / "one").mkdir()
    _write(base / "one" / "all.jsonl", records)
    # The same records split into three files, in another order.
    (base / "three").mkdir()
    shuffled = list(records)
    random.Random(4).shuffle(shuffled)
    for k in range(3):
        _write(base / "three" / f"part{k}.jsonl", shuffled[k::3])
    one, three = [base / "one" / "all.jsonl"], sorted((base / "three").glob("*.jsonl"))
    transform_flags = [flag for _, cli in TRANSFORMS for flag in ("--transform", cli)]
    return {
        "records": records,
        "raw": _shard(one, base / "raw", *IN_MEMORY),
        "offline": _shard(one, base / "offline", *transform_flags, "--tokenizer", default_tokenizer_path(),
                          *IN_MEMORY),
        "dedup_memory": _shard(one, base / "dedup_memory", "--dedup", "exact", *transform_flags[:4], *IN_MEMORY),
        "dedup_processes": _shard(three, base / "dedup_processes", "--dedup", "exact", *transform_flags[:4],
                                  *MULTI_PROCESSING),
        "paths": {name: str(base / name) for name in ("raw", "offline", "dedup_memory", "dedup_processes")},
    }


# The per-document seed of a transform comes from the loader's seed online and --seed offline
# (0 here): the same seed gives the same random maps.
def _lines(config, steps: int) -> tuple[list[str], dict]:
    run = LoaderRun(config, 1)
    try:
        lines = run.run(steps)
        return lines, run.save()
    finally:
        run.close()


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_offline_and_online_transforms_give_the_same_batches(jobs, packing):
    online, state = _lines(loader_config(jobs["paths"]["raw"], [spec for spec, _ in TRANSFORMS], packing=packing,
                                         seq_len=64, seed=0), STEPS)
    assert all(epochs == (0,) for epochs in lane_epochs(state).values())  # still the first epoch everywhere
    offline, _ = _lines(loader_config(jobs["paths"]["offline"], packing=packing, seq_len=64, seed=0), STEPS)
    assert online == offline
    untransformed, _ = _lines(loader_config(jobs["paths"]["raw"], packing=packing, seq_len=64, seed=0), STEPS)
    assert untransformed != online


def test_offline_transform_counts_are_in_the_manifest_apart_from_rejects(jobs):
    data = jobs["offline"]["json"]
    assert [t["function"] for t in data["transforms"]] == [spec["function"] for spec, _ in TRANSFORMS]
    records = jobs["records"]
    german = sum(1 for r in records if r["lang"] == "de")
    assert data["transforms"][0]["dropped"] == german and data["transforms"][0]["changed"] == 0
    assert data["transforms"][2]["changed"] > 0 and data["transforms"][3]["changed"] > 0
    assert data["rejected"]["malformed_json"] == 1  # the bad line: a reject, not a drop
    dropped = sum(t["dropped"] for t in data["transforms"])
    assert data["documents"] + dropped + sum(data["rejected"].values()) == len(records) + 1


def _expected_dedup(records: list[dict]) -> tuple[set, dict]:
    """Kept ids and {removed id: kept id} of the records a filter keeps (reference computation)."""
    groups: dict[str, list[str]] = {}
    for record in records:
        if record["lang"] == "de" or len(record["text"]) % 3 == 0:  # the two filters of the dedup jobs
            continue
        digest = hashlib.sha256(normalize_text(record["text"]).encode()).hexdigest()
        groups.setdefault(digest, []).append(record["id"])
    kept = {min(ids) for ids in groups.values()}
    removed = {i: min(ids) for ids in groups.values() for i in ids if i != min(ids)}
    return kept, removed


def test_dedup_is_the_same_on_every_runner_mode_and_input_split(jobs):
    memory, processes = jobs["dedup_memory"], jobs["dedup_processes"]
    assert memory["manifest"].dataset_fingerprint == processes["manifest"].dataset_fingerprint
    assert memory["json"]["dedup"] == processes["json"]["dedup"]
    listed = {name: list(read_removed(jobs["paths"][name])) for name in ("dedup_memory", "dedup_processes")}
    assert listed["dedup_memory"] == listed["dedup_processes"]
    kept, removed = _expected_dedup(jobs["records"])
    assert {r["removed"]: r["kept"] for r in listed["dedup_memory"]} == removed
    assert "nfkc2" in removed and "near" not in removed and len(removed) >= 10
    import pyarrow.parquet as pq

    keys = set()
    for entry in memory["manifest"].files:
        keys.update(pq.read_table(f"{jobs['paths']['dedup_memory']}/{entry.path}", columns=["key"]).column(0).to_pylist())
    assert keys == kept


def test_every_record_is_accounted_for(jobs):
    data = jobs["dedup_memory"]["json"]
    dropped = sum(t["dropped"] for t in data["transforms"])
    removed = data["dedup"]["removed"]
    rejected = sum(data["rejected"].values())
    assert data["dedup"]["normalization"] == "nfkc-casefold-whitespace-v1"
    assert data["documents"] + removed + dropped + rejected == len(jobs["records"]) + 1  # + the malformed line
    assert removed == len(list(read_removed(jobs["paths"]["dedup_memory"])))


def test_token_transforms_and_bad_specs_are_refused_before_the_job(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a b c"}\n')
    for flag, message in ((["--transform", "truncate_tokens:{\"max_tokens\": 3}"], "works on tokens"),
                          (["--transform", "drop_regex:{bad json"], "not a JSON object"),
                          (["--transform", "no_such_module_zz:f"], "cannot be imported"),
                          (["--dedup", "fuzzy"], "invalid choice")):
        with pytest.raises((shard.ShardConfigError, SystemExit)) as info:
            shard.run(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--num-lanes", "1",
                       *flag])
        if info.type is shard.ShardConfigError:
            assert message in str(info.value)
