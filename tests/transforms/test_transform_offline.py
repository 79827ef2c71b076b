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
from loader.samples import default_tokenizer_path
from tests.dataset_factory import synthetic_texts
from tests.resume_harness import LoaderRun, lane_epochs
from loader.transforms import TransformSpec
from tests.transforms.conftest import F, loader_config

IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]
MULTI_PROCESSING = ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=2"]
NUM_LANES = 4
STEPS = 5  # inside every lane's first epoch (checked); every epoch: test_offline_and_online_transforms_agree_in_every_epoch
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


# Short documents in small files (several per lane), so that a few steps reach the third epoch.
EPOCH_STEPS = 28
TOKEN_TRANSFORMS = (  # a text filter first (tombstones of both stages), then tokens-stage ones
    ({"function": "drop_metadata", "args": {"field": "lang", "values": ["fr"]}},
     'drop_metadata:{"field": "lang", "values": ["fr"]}'),
    ({"function": F + "drop_odd_length"}, F + "drop_odd_length"),
    ({"function": F + "reverse_ids"}, F + "reverse_ids"),
    ({"function": F + "drop_random_tokens", "args": {"p": 0.2}}, F + 'drop_random_tokens:{"p": 0.2}'),
)


@pytest.fixture(scope="module")
def epoch_jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("epochs")
    texts = synthetic_texts(120, seed=5, max_words=1)
    records = [{"id": f"e{k:04d}", "text": t, "lang": ("en", "de", "fr")[k % 3]} for k, t in enumerate(texts)]
    _write(base / "in.jsonl", records)
    small = ["--target-file-mb", "0.0004", *IN_MEMORY]  # ~3 files per lane: epochs permute files too
    tokenizer = ["--tokenizer", default_tokenizer_path()]
    text_flags = [flag for _, cli in TRANSFORMS for flag in ("--transform", cli)]
    token_flags = [flag for _, cli in TOKEN_TRANSFORMS for flag in ("--transform", cli)]
    runs = {"raw": [], "raw_tokens": tokenizer, "offline_text": text_flags + tokenizer,
            "offline_tokens": token_flags + tokenizer}
    jsons = {name: _shard([base / "in.jsonl"], base / name, *flags, *small)["json"] for name, flags in runs.items()}
    assert max(f["part"] for f in jsons["raw"]["files"]) >= 2
    return {"paths": {name: str(base / name) for name in runs}, "json": jsons}


def _epoch_run(path: str, packing: str, transforms=(), epochs: int = 3) -> tuple[list[str], dict]:
    config = loader_config(path, transforms, datasets=[{"path": path, "name": "web"}], packing=packing,
                           seq_len=16, seed=0)  # one source name: it seeds the epoch permutations
    lines, state = _lines(config, EPOCH_STEPS)
    assert min(min(e) for e in lane_epochs(state).values()) >= epochs - 1  # every lane in its third epoch
    return lines, state


def _dropped(state: dict, specs=(), offline=()) -> list[int]:
    from loader.transforms.resume import counts_report

    report = counts_report(["web"], [tuple(TransformSpec(**spec) for spec in specs)], list(state["lanes"].values()),
                           [offline])["web"]
    return [counts["dropped"] for counts in report.values()]


FILTERS = ("drop_metadata", F + "drop_multiple_of_three", F + "drop_odd_length")


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
@pytest.mark.parametrize("stage", ["text", "tokens"])
def test_offline_and_online_transforms_agree_in_every_epoch(epoch_jobs, packing, stage):
    """Later epochs replay a row group's rows in a permutation of all its rows: a dropped document
    stays in the offline lane files as a tombstone, so they hold the rows (and row groups) of the
    untransformed dataset, and the loader skips a tombstone as it skips an online drop. Tokens-stage
    transforms run in the job right after tokenization (online: on the pre-tokenized dataset)."""
    specs, raw, offline = ((TRANSFORMS, "raw", "offline_text") if stage == "text"
                           else (TOKEN_TRANSFORMS, "raw_tokens", "offline_tokens"))
    online_lines, online_state = _epoch_run(epoch_jobs["paths"][raw], packing, [spec for spec, _ in specs])
    offline_lines, offline_state = _epoch_run(epoch_jobs["paths"][offline], packing)
    assert online_lines == offline_lines
    untransformed, _ = _epoch_run(epoch_jobs["paths"][raw], packing, epochs=1)
    assert untransformed != online_lines
    # tombstones skipped are counted per transform as the online drops are, and the manifest has them all
    entries = epoch_jobs["json"][offline]["transforms"]
    names = [entry["function"] for entry in entries]
    offline_dropped = _dropped(offline_state, offline=names)
    assert offline_dropped == _dropped(online_state, [spec for spec, _ in specs]) and sum(offline_dropped) > 0
    assert epoch_jobs["json"][offline]["tombstones"] == sum(entry["dropped"] for entry in entries) > 0
    assert all((entry["dropped"] > 0) == (entry["function"] in FILTERS) for entry in entries)
    assert all((entry["changed"] > 0) == (entry["function"] not in FILTERS) for entry in entries)


def test_a_manifest_whose_tombstones_do_not_add_up_is_refused(epoch_jobs):
    from loader.io.manifest import Manifest, ManifestError

    data = dict(epoch_jobs["json"]["offline_tokens"])
    manifest = Manifest.from_dict(data)
    assert manifest.documents + manifest.tombstones == sum(f.rows for f in manifest.files)
    assert manifest.tombstone_transforms == tuple(spec["function"] for spec, _ in TOKEN_TRANSFORMS)
    with pytest.raises(ManifestError, match=r"'tombstones' is \d+ but the transforms dropped"):
        Manifest.from_dict(dict(data, tombstones=data["tombstones"] + 1))
    with pytest.raises(ManifestError, match=r"field 'documents' is \d+ and 'tombstones' \d+ but the files hold"):
        Manifest.from_dict(dict(data, documents=data["documents"] + 1))


@pytest.mark.parametrize("dataset", ["offline_text", "offline_tokens"])
def test_the_audit_streams_skip_tombstones_as_the_training_stream_does(epoch_jobs, dataset):
    from loader.io.blocks import TokenFormat
    from loader.io.lane_reader import LaneTokenStream
    from loader.io.manifest import read_manifest
    from loader.io.provenance import ProvenanceStream
    from loader.stages.tokenizer import load_tokenizer

    path = epoch_jobs["paths"][dataset]
    manifest = read_manifest(path)
    options = dict(dataset_path=path, manifest=manifest, source_name="web", lane_id=1, seed=0,
                   token_format=TokenFormat(None, 0), tokenizer=load_tokenizer(default_tokenizer_path()))
    training, audit = LaneTokenStream(**options), ProvenanceStream(**options)
    try:
        for epoch in range(3):
            for where in training.blocks_of_epoch(epoch):
                expected = training._read_block(epoch, *where).doc_starts
                assert audit._read_block(epoch, *where).doc_starts.tolist() == expected.tolist()
                assert audit.block_tokens(*where) == int(expected[-1])
        assert any((audit.lengths(*where) < 0).any() for where in training.blocks_of_epoch(0))  # tombstones met
    finally:
        training.close()
        audit.close()


def test_a_lane_left_with_tombstones_only_fails_the_job(tmp_path):
    _write(tmp_path / "in.jsonl", [{"id": f"k{k}", "text": f"document {k}"} for k in range(40)])
    with pytest.raises(shard.ShardError, match="lanes received a document"):
        _shard([tmp_path / "in.jsonl"], tmp_path / "out", "--transform",
               F + 'drop_lane:{"lane": 1, "lanes": %d}' % NUM_LANES, *IN_MEMORY)


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

    keys, tombstones = set(), set()
    for entry in memory["manifest"].files:
        table = pq.read_table(f"{jobs['paths']['dedup_memory']}/{entry.path}", columns=["key", "dropped_by"])
        for key, dropped_by in zip(*(column.to_pylist() for column in table.columns)):
            (keys if dropped_by == -1 else tombstones).add(key)
    assert keys == kept
    filtered = {r["id"] for r in jobs["records"] if r["lang"] == "de" or len(r["text"]) % 3 == 0}
    assert tombstones == filtered  # every dropped document holds its place, none is deduplicated


def test_every_record_is_accounted_for(jobs):
    data = jobs["dedup_memory"]["json"]
    dropped = sum(t["dropped"] for t in data["transforms"])
    removed = data["dedup"]["removed"]
    rejected = sum(data["rejected"].values())
    assert data["dedup"]["normalization"] == "nfkc-casefold-whitespace-v1"
    assert data["documents"] + removed + dropped + rejected == len(jobs["records"]) + 1  # + the malformed line
    assert removed == len(list(read_removed(jobs["paths"]["dedup_memory"])))


def test_unusable_token_transforms_and_bad_specs_are_refused_before_the_job(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a b c"}\n')
    tokenizer = ["--tokenizer", default_tokenizer_path()]
    for flag, message in ((["--transform", "truncate_tokens:{\"max_tokens\": 3}"], "without --tokenizer the job makes none"),
                          (["--transform", "truncate_tokens:{\"max_tokens\": 3}", "--transform", "drop_regex:{\"pattern\": "
                            "\"x\"}", *tokenizer], "put the text transforms first"),
                          (["--transform", "drop_regex:{bad json"], "not a JSON object"),
                          (["--transform", "no_such_module_zz:f"], "cannot be imported"),
                          (["--dedup", "fuzzy"], "invalid choice")):
        with pytest.raises((shard.ShardConfigError, SystemExit)) as info:
            shard.run(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--num-lanes", "1",
                       *flag])
        if info.type is shard.ShardConfigError:
            assert message in str(info.value)
