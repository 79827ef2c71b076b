"""The rows of the elastic matrix: one per (kind, packing), each naming its data, its loader
config and what else its kind must show.

A row's data comes from the suite's own writers (the chat, transform, mixing and utf8-bytes
writers of their folders' ``conftest.py``, ``tests/vision/image_chat_data.py``,
``tests/golden/kinds_data.py``, ``tests/dataset_factory.py``) and is built once per module per
writer (``Case.data``). Its extra check (``Case.check``) gets the row's :class:`Outcome`: the
reference lines, the resume report and a way to run another config on the reference topology.

Topologies are dicts of ``world_size``, ``num_workers`` and ``micro_batch_size`` (as
:func:`tests.resume_harness.loader_runs` takes them); global batch 8 unless a row says
otherwise::

    reference   W1, 0 workers, micro 2
    spread      W4, 0 workers, micro 1                    (a whole run against the reference)
    resume      W2, 0 workers, micro 4                    (uninterrupted, saving at every cut)
                W1 micro 4 | W2, 2 workers, micro 4 | W4 micro 2   (cut at ``cuts``)

The workers of the chain's middle segment load the state saved on W1, serve every step of the
segment (``workers_serve``: not the trainer process's warm start) and save the state W4 loads.
Worker processes cost seconds per run (fresh interpreters): where two rows of a kind differ only
in packing or mix, one of them runs the workers and the other keeps its chain in process
(``IN_PROCESS``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

import tests.kinds.utf8_bytes_kind  # noqa: F401  registers the test-only kind, as a user's import would
from beam_jobs import shard
from loader.commands.fingerprints import collect_fingerprints
from loader.config import LoaderConfig
from loader.io.manifest import read_manifest
from loader.samples import default_tokenizer_path
from loader.stages.tokenizer import load_tokenizer
from tests.chat.chat_factory import make_records
from tests.chat.conftest import write_offline_and_online
from tests.chat.test_chat_shard import MAX_TOKENS, NUM_LANES as CHAT_LANES, _config as chat_config, _job_args, \
    _write_jsonl
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.golden.kinds_data import build_images, build_text, build_transformed, kinds_config
from tests.kinds.conftest import utf8_config, write_utf8_dataset
from tests.loader.io.test_features import _rows as delivered_rows
from tests.mixing.conftest import mix_configs, write_mix_data
from tests.resume_harness import LoaderRun, MaskedLoaderRun, ResumeReport
from tests.transforms.conftest import CHAT_TRANSFORMS, TEXT_TRANSFORMS, TOKEN_TRANSFORMS, chat_loader_config, \
    loader_config, write_online_chat, write_transform_corpus
from tests.vision.image_chat_data import chat_and_text_config as image_chat_and_text, write_image_chat


def topologies(*shapes: tuple[int, int, int]) -> tuple[dict, ...]:
    """``(world_size, num_workers, micro_batch_size)`` triples as topology dicts."""
    return tuple({"world_size": w, "num_workers": n, "micro_batch_size": m} for w, n, m in shapes)


def in_process(chain: tuple[dict, ...]) -> tuple[dict, ...]:
    """For rows whose worker path another row of the same kind runs (in the other packing or mix)."""
    return tuple({**topology, "num_workers": 0} for topology in chain)


(REFERENCE,) = topologies((1, 0, 2))
SPREAD = topologies((4, 0, 1))
RESUME = topologies((2, 0, 4), (1, 0, 4), (2, 2, 4), (4, 0, 2))
IN_PROCESS = in_process(RESUME)


@dataclass(frozen=True)
class Outcome:
    """What a row's extra check sees once its topologies agreed."""

    data: Any  # what the row's writer returned
    config: LoaderConfig
    reference: list[str]
    report: ResumeReport
    lines: Callable[[LoaderConfig], list[str]]  # another config's lines on the reference topology


@dataclass(frozen=True)
class Case:
    id: str
    data: Callable[[Path], Any]  # writer: a fresh directory -> what ``config`` needs
    config: Callable[[Any], LoaderConfig]
    steps: int = 4
    cuts: tuple[int, ...] = (1, 3)
    run: Callable[..., LoaderRun] = LoaderRun  # the step line's driver
    reference: dict = field(default_factory=lambda: dict(REFERENCE))
    spread: tuple[dict, ...] = SPREAD
    resume: tuple[dict, ...] = RESUME
    check: Optional[Callable[[Outcome], None]] = None
    marks: tuple = ()


# -- writers the copies built inline ---------------------------------------------------------------


def write_chat_and_text(base: Path) -> dict[str, list[dict]]:
    """Conversations sharded offline (ids and loss masks in the lanes) alone, and mixed 1:1 with
    pre-tokenized text: ``{"chat": datasets, "chat+text": datasets}``."""
    (base / "in").mkdir()
    _write_jsonl(base / "in" / "chat.jsonl", make_records(29, 60))
    shard.run(_job_args([str(base / "in" / "chat.jsonl")], base / "chat", "--chat-max-tokens", str(MAX_TOKENS),
                        "--chat-overflow", "truncate"))
    texts = synthetic_texts(60, seed=8)
    write_dataset(str(base / "text"), texts, num_lanes=CHAT_LANES, source_name="text",
                  tokenizer=load_tokenizer(default_tokenizer_path()), keys=[f"text-{k}" for k in range(len(texts))])
    chat = {"path": str(base / "chat"), "name": "chat", "weight": 0.5}
    return {"chat": [chat], "chat+text": [chat, {"path": str(base / "text"), "name": "text", "weight": 0.5}]}


def write_golden_images(base: Path) -> dict[str, str]:
    """The golden pins' image and image-chat datasets (with their tokenizer) and text source."""
    return {**build_images(base / "images"), **build_text(base / "text")}


def write_golden_tombstoned(base: Path) -> dict[str, str]:
    """The golden pins' corpus sharded by the job with ``--transform`` (dropped rows as tombstones)."""
    return build_transformed(base)


def write_utf8_lanes(base: Path) -> str:
    return write_utf8_dataset(base)[0]


def write_mixes(base: Path) -> Callable[..., LoaderConfig]:
    return mix_configs(write_mix_data(base, load_tokenizer(default_tokenizer_path())))


# -- extra checks ----------------------------------------------------------------------------------


def supervised_counts_follow_the_labels_and_masks(outcome: Outcome) -> None:
    """``zephon fingerprints`` counts supervised tokens per source, the same on W1 and on W4 with
    workers, and equal to the delivered rows' ``labels != -100 & loss_mask == 1``, per sequence
    source (sequence mixing) or per token source (token mixing)."""
    for unit in ("sequence", "token"):
        config = outcome.config.replace(mixing_unit=unit)
        steps = len(outcome.reference)
        rows = delivered_rows(config, steps=steps, output="numpy")
        results, _ = collect_fingerprints(config, world_size=1, end_step=steps)
        spread, _ = collect_fingerprints(config.replace(num_workers=2, micro_batch_size=1), world_size=4,
                                         end_step=steps)
        assert [r.line() for r in spread] == [r.line() for r in results], unit
        batch = config.global_batch_size
        for result in results:
            expected = {"chat": 0, "text": 0}
            for index in range(result.step * batch, (result.step + 1) * batch):
                row = rows[index]
                supervised = (row["labels"] != -100) & (row["loss_mask"] == 1)
                if unit == "token":
                    sources = row["token_source_ids"][supervised]
                    expected["chat"] += int((sources == 0).sum())
                    expected["text"] += int((sources == 1).sum())
                else:
                    expected[("chat", "text")[int(row["source_ids"])]] += int(supervised.sum())
            assert result.supervised_counts == expected, f"{unit}: step {result.step}"
            assert result.line().endswith(f" supervised: chat={expected['chat']} text={expected['text']}")
        assert all(r.supervised_counts["chat"] > 0 for r in results), unit
        assert sum(r.supervised_counts["text"] for r in results) > 0, unit


def equals_offline(offline: Callable[[Any], LoaderConfig]) -> Callable[[Outcome], None]:
    """Online chat gives the lines (masks included) of the same conversations sharded offline:
    the online run's rejects and encodings are the job's, on every topology."""

    def check(outcome: Outcome) -> None:
        assert outcome.reference == outcome.lines(offline(outcome.data))

    return check


def images_fingerprinted(outcome: Outcome) -> None:
    """The harness hashes what ``zephon fingerprints`` does (which adds supervised counts), and
    every step supervises image-source tokens."""
    results, _ = collect_fingerprints(outcome.config, world_size=1, end_step=len(outcome.reference))
    assert [r.line().split(" supervised:")[0] for r in results] == outcome.reference
    assert all(r.supervised_counts["images"] > 0 for r in results)


def images_and_text_fingerprinted(outcome: Outcome) -> None:
    images_fingerprinted(outcome)
    sources_in_every_step("images", "text")(outcome)


def sources_in_every_step(*sources: str) -> Callable[[Outcome], None]:
    """A mix's every step holds sequences of each of ``sources`` (its ``name=count`` parts)."""

    def check(outcome: Outcome) -> None:
        for line in outcome.reference:
            assert all(f" {name}=" in line for name in sources), line

    return check


def _transform_counters(state: Any):
    """Each source stream's ``transforms`` counters (``[dropped, changed]`` per transform), wherever
    the lane keeps its streams (a packer's stream per source, a token mix's mixed stream)."""
    if isinstance(state, dict):
        if isinstance(state.get("transforms"), list):
            yield state["transforms"]
        for value in state.values():
            yield from _transform_counters(value)
    elif isinstance(state, list):
        for value in state:
            yield from _transform_counters(value)


def transforms_counted(untransformed: Callable[[Any], LoaderConfig],
                       acts: tuple[str, ...] = ("dropped", "changed")) -> Callable[[Outcome], None]:
    """The transforms act (the lines differ from ``untransformed``'s), and the state at the last
    cut holds their counters (the k-th online transform did ``acts[k]``: the filter dropped, the
    map changed) and names each source's functions."""

    def check(outcome: Outcome) -> None:
        assert outcome.reference != outcome.lines(untransformed(outcome.data))
        state = json.loads(outcome.report.states[max(outcome.report.states)])
        named = state["transforms"]["sources"]
        specs = {d.name or next(iter(named)): d.transforms or outcome.config.transforms
                 for d in outcome.config.datasets}
        (online,) = {len(t) for t in specs.values()}  # the rows give each source as many transforms
        counts = list(_transform_counters(state["lanes"]))
        # a tombstoned dataset's counters start with the job's transforms; the online ones follow
        offline = len(read_manifest(outcome.config.datasets[0].path).transforms or ())
        assert counts and all(len(c) == offline + online for c in counts), counts
        # the filter (the first online transform) dropped documents, the map (the second) changed some
        for k, act in enumerate(acts):
            assert sum(c[offline + k][("dropped", "changed").index(act)] for c in counts) > 0, (k, act, counts)
        assert {name: named[name][0]["function"] for name in named} == \
            {name: transforms[0].function for name, transforms in specs.items()}

    return check


# -- the rows --------------------------------------------------------------------------------------

TRANSFORM_STEPS = dict(steps=12, cuts=(4, 9))  # an epoch of a lane ends within ~10 steps
# Chat transforms: global batch 4 and 2 lanes (tests/transforms/conftest.py), micro-batches 1/2.
CHAT_TRANSFORM_SPREAD = topologies((2, 0, 1))
CHAT_TRANSFORM_RESUME = topologies((2, 0, 2), (1, 2, 2), (2, 2, 2), (1, 0, 2))
CHAT_TRANSFORM_ACTS = ("dropped", "changed", "dropped", "changed")  # filter, map, filter, seeded map
# The image chat of tests/vision: W1 micro 4 | W2, 2 workers, micro 2 | W1, 2 workers, micro 2.
IMAGE_CHAT_RESUME = topologies((1, 0, 4), (2, 2, 2), (1, 2, 2))
MIX_TOPOLOGIES = dict(  # global batch 28 (tests/mixing/conftest.py): W2 micro 4 does not divide it
    reference={"world_size": 1, "num_workers": 0, "micro_batch_size": 28}, spread=(), steps=12, cuts=(4, 9))


def _mix_resume(workers: int) -> tuple[dict, ...]:
    return ({"world_size": 2, "micro_batch_size": 7}, {"world_size": 4, "micro_batch_size": 1},
            {"world_size": 1, "micro_batch_size": 14, "num_workers": workers},
            {"world_size": 2, "micro_batch_size": 14})


def _text_mix(corpus, transformed: bool) -> list[dict]:
    return [{"path": corpus.text_path, "name": "text", "weight": 0.5,
             "transforms": list(TEXT_TRANSFORMS) if transformed else []},
            {"path": corpus.pretokenized_path, "name": "pre", "weight": 0.5,
             "transforms": list(TOKEN_TRANSFORMS) if transformed else []}]


def _images(paths, with_text: bool = False, **fields) -> LoaderConfig:
    weight = 0.5 if with_text else 1.0
    datasets = [{"path": paths["image"], "name": "images", "weight": weight}]
    datasets += [{"path": paths["text"], "name": "text", "weight": weight}] if with_text else []
    return kinds_config(paths, "image", datasets=datasets, **fields)


def _tombstoned(paths, transforms=()) -> LoaderConfig:
    return kinds_config(paths, "tombstoned", datasets=[{"path": paths["tombstoned"], "name": "web",
                                                        "transforms": list(transforms)}])


def _text(packing: str) -> Callable[[Any], LoaderConfig]:
    return lambda corpus: loader_config(corpus.text_path, packing=packing)


def _tokens(packing: str) -> Callable[[Any], LoaderConfig]:
    return lambda corpus: loader_config(corpus.pretokenized_path, packing=packing)


def _chat_mix(mix: str, packing: str) -> Callable[[Any], LoaderConfig]:
    return lambda datasets: chat_config(datasets[mix], packing)


def _chat_shard(kind: str, packing: str) -> Callable[[Any], LoaderConfig]:
    return lambda shards: chat_config([{"path": str(shards["base"] / kind), "name": "chat"}], packing)


def _chat_transforms(packing: str, transformed: bool = True) -> Callable[[Any], LoaderConfig]:
    return lambda shards: chat_loader_config(shards["online"], CHAT_TRANSFORMS if transformed else (),
                                             packing=packing)


def _mix(unit: str, packing: str) -> Callable[[Any], LoaderConfig]:
    return lambda make: make(mixing_unit=unit, packing=packing)


def _utf8(packing: str) -> Callable[[Any], LoaderConfig]:
    return lambda path: utf8_config(path, packing=packing)


SLOW = (pytest.mark.slow, pytest.mark.timeout(300))
IMAGES = (pytest.mark.timeout(240),)
MIXES = (pytest.mark.timeout(180),)

CASES: tuple[Case, ...] = (
    # Text tokenized online and pre-tokenized: tests/loader/runtime/test_fingerprints.py drives
    # them through worker processes, prefetch depths, epoch edges and many cuts, so their chain
    # stays in the trainer process.
    Case("text-concat", write_transform_corpus, _text("concat"), resume=IN_PROCESS),
    Case("text-best_fit", write_transform_corpus, _text("best_fit"), resume=IN_PROCESS),
    Case("tokens-concat", write_transform_corpus, _tokens("concat"), resume=IN_PROCESS),
    Case("tokens-best_fit", write_transform_corpus, _tokens("best_fit"), resume=IN_PROCESS),
    # Chat sharded offline, alone and mixed 1:1 with text: loss masks are part of the line; the
    # workers run chat-concat and chat+text-best_fit.
    Case("chat-concat", write_chat_and_text, _chat_mix("chat", "concat"), run=MaskedLoaderRun),
    Case("chat-best_fit", write_chat_and_text, _chat_mix("chat", "best_fit"), run=MaskedLoaderRun,
         resume=IN_PROCESS),
    Case("chat+text-concat", write_chat_and_text, _chat_mix("chat+text", "concat"), run=MaskedLoaderRun,
         resume=IN_PROCESS),
    Case("chat+text-best_fit", write_chat_and_text, _chat_mix("chat+text", "best_fit"), run=MaskedLoaderRun,
         check=supervised_counts_follow_the_labels_and_masks, marks=SLOW),  # 6 more runs, two with 8 workers
    # Chat rendered and tokenized by the loader (in the workers of the chain's middle segment).
    Case("chat-online-concat", write_offline_and_online, _chat_shard("online", "concat"), run=MaskedLoaderRun,
         check=equals_offline(_chat_shard("offline", "concat"))),
    Case("chat-online-best_fit", write_offline_and_online, _chat_shard("online", "best_fit"), run=MaskedLoaderRun,
         check=equals_offline(_chat_shard("offline", "best_fit"))),
    # Pixels travel in worker messages (images+text, image-chat) and are part of the line;
    # best-fit bins hold image refs.
    Case("images-best_fit", write_golden_images, lambda d: _images(d, images={"max_images_per_sequence": 3}),
         resume=IN_PROCESS, check=images_fingerprinted, marks=IMAGES),
    Case("images+text-best_fit", write_golden_images, lambda d: _images(d, with_text=True),
         check=images_and_text_fingerprinted, marks=IMAGES),
    Case("image-chat+text-best_fit", write_golden_images, lambda d: kinds_config(d, "image_chat"),
         check=sources_in_every_step("image_chat", "text"), marks=IMAGES),
    # tests/vision's image chat: conversations the loader rejects online (a literal pad, one too
    # long once its image is expanded) among them, sequences of 256, a whole run on W2 with workers
    # (other data than the row above, not its pair in packing or mix: both run the workers).
    Case("image-chat-rejects+text-best_fit", write_image_chat, image_chat_and_text, steps=3, cuts=(1, 2),
         spread=topologies((2, 2, 2)), resume=IMAGE_CHAT_RESUME,
         check=sources_in_every_step("chat", "text"), marks=SLOW),  # 3 runs with workers
    # A filter, a map and a seeded random map of each stage; the workers import the functions.
    Case("transforms-text-concat", write_transform_corpus,
         lambda c: loader_config(c.text_path, TEXT_TRANSFORMS, packing="concat"),
         check=transforms_counted(_text("concat")), **TRANSFORM_STEPS),
    Case("transforms-tokens-best_fit", write_transform_corpus,
         lambda c: loader_config(c.pretokenized_path, TOKEN_TRANSFORMS, packing="best_fit"),
         check=transforms_counted(_tokens("best_fit")), **TRANSFORM_STEPS),
    # Records- and tokens-stage transforms on chat rendered online (the workers run the concat row).
    Case("transforms-chat-concat", write_online_chat, _chat_transforms("concat"), steps=6, cuts=(2, 4),
         spread=CHAT_TRANSFORM_SPREAD, resume=CHAT_TRANSFORM_RESUME,
         check=transforms_counted(_chat_transforms("concat", False), CHAT_TRANSFORM_ACTS)),
    Case("transforms-chat-best_fit", write_online_chat, _chat_transforms("best_fit"), steps=6, cuts=(2, 4),
         spread=CHAT_TRANSFORM_SPREAD, resume=in_process(CHAT_TRANSFORM_RESUME),
         check=transforms_counted(_chat_transforms("best_fit", False), CHAT_TRANSFORM_ACTS)),
    # Token mixing takes documents of two sources in bulk (states inside the next row group).
    Case("transforms-mix-token-concat", write_transform_corpus,
         lambda c: loader_config(c.text_path, datasets=_text_mix(c, True), mixing_unit="token"),
         check=transforms_counted(lambda c: loader_config(c.text_path, datasets=_text_mix(c, False),
                                                          mixing_unit="token")), **TRANSFORM_STEPS),
    # Online token transforms over a dataset the job transformed (its dropped rows are tombstones).
    Case("transforms-tombstoned-concat", write_golden_tombstoned, lambda d: _tombstoned(d, TOKEN_TRANSFORMS),
         check=transforms_counted(_tombstoned), **TRANSFORM_STEPS),
    # Three sources at 0.55/0.3/0.15 (tests/mixing/conftest.py), micro-batches 1/7/14/28.
    Case("mix-sequence-concat", write_mixes, _mix("sequence", "concat"), resume=_mix_resume(0), marks=MIXES,
         **MIX_TOPOLOGIES),
    Case("mix-sequence-best_fit", write_mixes, _mix("sequence", "best_fit"), resume=_mix_resume(2), marks=MIXES,
         **MIX_TOPOLOGIES),
    Case("mix-token-concat", write_mixes, _mix("token", "concat"), resume=_mix_resume(2), marks=MIXES,
         **MIX_TOPOLOGIES),
    Case("mix-token-best_fit", write_mixes, _mix("token", "best_fit"), resume=_mix_resume(0), marks=MIXES,
         **MIX_TOPOLOGIES),
    # The test-only kind registered from tests/: worker processes import its module by name
    # (utf8-bytes-concat).
    Case("utf8-bytes-concat", write_utf8_lanes, _utf8("concat"), steps=10, cuts=(3, 7), marks=SLOW),
    Case("utf8-bytes-best_fit", write_utf8_lanes, _utf8("best_fit"), steps=10, cuts=(3, 7), resume=IN_PROCESS,
         marks=SLOW),
)
