"""Transforms on online chat sources (``loader.transforms.conversations``): records-stage ones on
the conversation before rendering, tokens-stage ones on its ids and loss mask after; the same
batches on W 1/2 and 0/2 workers, resumed on another topology; offline chat jobs refuse them.
Also the one guard against a lane that can never produce a token (chat rejects, transform drops).
"""

from __future__ import annotations

import pytest

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from loader.io.lane_reader import EmptyLaneError
from loader.pipeline import ZephonLoader
from loader.transforms import TransformError
from tests.chat.chat_factory import TEMPLATES_DIR, make_records
from tests.resume_harness import LoaderRun, check_resume
from tests.transforms.conftest import F

TEMPLATE = str(TEMPLATES_DIR / "chatml_generation.jinja")
IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]
SEQ_LEN = 128
STEPS = 6
KEY_PREFIX = "chat.jsonl#1"  # records 1 and 10-19 (keys are input path#index)
TRANSFORMS = (  # a records filter and map, then a tokens filter (on loss_mask) and a seeded random map
    {"function": F + "drop_long_conversations", "args": {"max_messages": 5}},
    {"function": F + "shout_replies"},
    {"function": F + "drop_unsupervised_halves"},
    {"function": F + "drop_random_tokens", "args": {"p": 0.1}},
)


def _write(path, records) -> None:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _job(inputs, output, *extra) -> list[str]:
    return ["--input", *map(str, inputs), "--output", str(output), "--messages-field", "messages",
            "--chat-template", TEMPLATE, "--num-lanes", "2", "--max-reject-fraction", "1.0", *extra, *IN_MEMORY]


@pytest.fixture(autouse=True)
def _reject_log_left_as_found():
    """The chat block logs each reject reason once per process: what these tests log must not
    hide it from tests that check the log (tests/chat/test_chat_online.py)."""
    from loader.chat import block

    saved = set(block._logged_reasons)
    yield
    block._logged_reasons.clear()
    block._logged_reasons.update(saved)


@pytest.fixture(scope="module")
def chat_shards(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("chat_transforms")
    _write(base / "chat.jsonl", make_records(29, 48))
    shard.run(_job([base / "chat.jsonl"], base / "online", "--chat-max-tokens", str(SEQ_LEN - 1),
                   "--chat-overflow", "truncate"))
    # every conversation is longer than 4 tokens: all rejected online (too_long)
    shard.run(_job([base / "chat.jsonl"], base / "rejected", "--chat-max-tokens", "4"))
    # a key filter offline (tombstones in the conversation lanes), small files: epochs permute them
    flags = ("--chat-max-tokens", str(SEQ_LEN - 1), "--chat-overflow", "truncate", "--target-file-mb", "0.004")
    shard.run(_job([base / "chat.jsonl"], base / "online_small", *flags))
    shard.run(_job([base / "chat.jsonl"], base / "filtered_offline", *flags, "--transform",
                   F + 'drop_key_prefix:{"prefix": "%s"}' % KEY_PREFIX))
    return {"base": base, **{name: str(base / name) for name in
                             ("online", "rejected", "online_small", "filtered_offline")}}


def _config(path: str, transforms=(), **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path, "name": "chat"}], seq_len=SEQ_LEN, global_batch_size=4,
                  micro_batch_size=2, seed=3, tokenizer=default_tokenizer_path(), num_workers=0, prefetch=2,
                  worker_timeout_s=60.0, add_bos=False, add_eos=True, transforms=list(transforms))
    fields.update(overrides)
    return LoaderConfig(**fields)


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_chat_transforms_are_deterministic_across_topologies_and_resumes(chat_shards, packing):
    config = _config(chat_shards["online"], TRANSFORMS, packing=packing)
    reference = LoaderRun(config, 1)
    try:
        lines = reference.run(STEPS)
        counts = reference.loaders[0].transform_counts()["chat"]
    finally:
        reference.close()
    assert len(lines) == STEPS
    # each transform did something: the filters dropped, the maps changed
    assert [counts[f"{k}:{spec['function']}"]["dropped" if k in (0, 2) else "changed"] > 0
            for k, spec in enumerate(TRANSFORMS)] == [True] * 4
    untransformed = LoaderRun(_config(chat_shards["online"], packing=packing), 1)
    try:
        assert untransformed.run(STEPS) != lines
    finally:
        untransformed.close()

    def make(k: int) -> LoaderRun:
        world_size, workers = ((2, 0), (1, 2), (2, 2), (1, 0))[k % 4]
        return LoaderRun(config.replace(num_workers=workers), world_size)

    check_resume(make, steps=STEPS, cut_points=[2, 4], expected=lines)


def test_a_chat_filter_offline_and_online_gives_the_same_batches_in_every_epoch(chat_shards):
    """The filter reads only the key, so it runs as a text transform in the job (dropped
    conversations stay as tombstones) and as a records one online."""
    from tests.resume_harness import lane_epochs

    online_filter = [{"function": F + "drop_key_prefix", "args": {"prefix": KEY_PREFIX}, "stage": "records"}]
    runs = {}
    for name, path, transforms in (("online", "online_small", online_filter), ("offline", "filtered_offline", ()),
                                   ("unfiltered", "online_small", ())):
        run = LoaderRun(_config(chat_shards[path], transforms, global_batch_size=8, micro_batch_size=4), 1)
        try:
            runs[name] = (run.run(16), run.save(), run.loaders[0].transform_counts())
        finally:
            run.close()
    assert min(min(epochs) for epochs in lane_epochs(runs["online"][1]).values()) >= 2  # a third epoch everywhere
    assert runs["online"][0] == runs["offline"][0] != runs["unfiltered"][0]
    online_counts, offline_counts = runs["online"][2]["chat"], runs["offline"][2]["chat"]
    assert list(online_counts.values()) == list(offline_counts.values()) and \
        list(online_counts.values())[0]["dropped"] > 0
    assert list(offline_counts) == [f"shard:0:{F}drop_key_prefix"]
    from loader.io.manifest import read_manifest

    manifest = read_manifest(chat_shards["filtered_offline"])
    assert manifest.tombstones == 11 and max(f.part for f in manifest.files) >= 1  # several files per lane


def test_chat_transform_stages_are_checked_when_the_loader_is_built(chat_shards):
    for transforms, message in (
            ([{"function": "drop_regex", "args": {"pattern": "x"}}], "works on text, but source 'chat' holds "
                                                                      "conversations rendered online"),
            ([{"function": F + "reverse_ids"}, {"function": F + "shout_replies"}], "put them first")):
        with pytest.raises(TransformError, match=message):
            ZephonLoader(_config(chat_shards["online"], transforms))


def test_records_transforms_are_refused_on_other_sources_and_in_chat_jobs(chat_shards, transform_corpus):
    from loader.transforms.chain import TransformChain
    from loader.transforms.spec import TransformSpec

    spec = TransformSpec(F + "shout_replies").resolved(False)
    with pytest.raises(TransformError, match="works on records .* not a chat source rendered online"):
        TransformChain([spec], seed=0, source="web", pretokenized=False)
    base = chat_shards["base"]
    for flag, message in ((F + "shout_replies", "records transforms run online only"),
                          (F + "reverse_ids", "works on tokens, and a chat job")):
        with pytest.raises(shard.ShardConfigError, match=message):
            shard.run(_job([base / "chat.jsonl"], base / "refused", "--transform", flag, "--tokenizer",
                           default_tokenizer_path()))


@pytest.mark.parametrize("case", ["chat_rejects", "chat_transform_drops", "text_transform_drops"])
def test_a_lane_that_can_never_produce_a_token_is_one_error(chat_shards, transform_corpus, case):
    """One counter and one error for every cause: every block of the lane without a token."""
    if case == "text_transform_drops":
        from tests.transforms.conftest import loader_config

        config, reason = loader_config(transform_corpus.text_path, [{"function": F + "drop_all"}]), (
            r"every document is dropped by its transforms \(tests.transforms.functions:drop_all\)")
    elif case == "chat_rejects":
        config, reason = _config(chat_shards["rejected"]), "every conversation is rejected online"
    else:
        config, reason = _config(chat_shards["online"], [{"function": F + "drop_all", "stage": "records"}]), (
            r"every document is dropped by its transforms \(tests.transforms.functions:drop_all\) or rejected online")
    with ZephonLoader(config) as loader:
        with pytest.raises(EmptyLaneError, match=rf"lane 0 of source '\w+' .*: {reason}.* in every block of the lane"):
            next(loader)
