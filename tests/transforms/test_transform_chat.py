"""Transforms on online chat sources (``loader.transforms.conversations``): records-stage ones on
the conversation before rendering, tokens-stage ones on its ids and loss mask after; the same
batches on every topology and across resumes (the "transforms-chat-*" rows of the elastic matrix,
tests/elastic/cases.py, over :func:`tests.transforms.conftest.write_online_chat`); offline chat
jobs refuse them.
Also the one guard against a lane that can never produce a token (chat rejects, transform drops).
"""

from __future__ import annotations

import pytest

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.io.lane_reader import EmptyLaneError
from loader.pipeline import ZephonLoader
from loader.transforms import TransformError
from tests.resume_harness import LoaderRun
from tests.transforms.conftest import F, KEY_PREFIX, chat_job as _job, chat_loader_config as _config, write_chat_shards


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
    return write_chat_shards(tmp_path_factory.mktemp("chat_transforms"))


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
