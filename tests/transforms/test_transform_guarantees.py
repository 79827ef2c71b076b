"""What a transform may not do, and what a change of transforms on resume does.

* a function that is not deterministic (an unseeded generator, state kept between calls) is
  refused by name on the first documents, in-process and in a worker process;
* a resume with other transforms is refused naming the difference, and accepted when the
  config declares ``transforms_from_step``: recorded in the checkpoint, the same batches on
  every topology afterwards, a cursor whose document the new transforms drop moved on;
* counters: what the loader reports equals a count of the documents, whatever the topology;
  a filter that empties whole row groups keeps packers and cursors right at every cut.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from loader.checkpoint.state import StateError
from loader.config import ConfigError
from loader.pipeline import ZephonLoader
from loader.transforms import TransformError
from loader.transforms.spec import TransformSpec
from loader.transforms.chain import TransformChain, TransformCounts
from loader.transforms.document import Document
from loader.workers.pool import WorkerError
from tests.loader.checkpoint.test_checkpoints import state_after
from tests.resume_harness import LoaderRun, check_resume
from tests.transforms.conftest import F, TEXT_TRANSFORMS, loader_config


@pytest.mark.parametrize("function", ["unseeded_random_filter", "hidden_state_map"])
def test_a_non_deterministic_function_is_refused_by_name(transform_corpus, function):
    config = loader_config(transform_corpus.text_path, [{"function": F + function}])
    with ZephonLoader(config) as loader:
        with pytest.raises(TransformError, match=f"functions:{function} .*is not deterministic.*doc.seed"):
            for _ in range(4):
                next(loader)


def test_a_non_deterministic_function_is_refused_in_a_worker_process(transform_corpus):
    config = loader_config(transform_corpus.text_path, [{"function": F + "hidden_state_map"}], num_workers=2)
    with ZephonLoader(config) as loader:
        loader.wait_for_workers(timeout_s=60)
        with pytest.raises((TransformError, WorkerError), match="hidden_state_map.*is not deterministic"):
            for _ in range(8):
                next(loader)


def test_the_determinism_check_compares_whole_results():
    def seeded(doc):
        import random
        return doc.replace(text=str(random.Random(doc.seed).random()))

    chain = TransformChain([TransformSpec("tests.transforms.functions:drop_random_words")], seed=1, source="s",
                           pretokenized=False)
    counts = TransformCounts.zeros(1)
    first = chain.apply(Document("k", text="a b c d e f g h", seed_base=1), counts)
    again = chain.apply(Document("k", text="a b c d e f g h", seed_base=1), counts)
    assert first.text == again.text and first.text != "a b c d e f g h"  # seeded: random, and repeatable
    other_key = chain.apply(Document("other", text="a b c d e f g h", seed_base=1), counts)
    other_seed = chain.apply(Document("k", text="a b c d e f g h", seed_base=2), counts)
    assert other_key.text != first.text or other_seed.text != first.text


def test_unusable_transforms_are_named_before_any_batch(transform_corpus):
    for entry, message in (
        ({"function": "no_such_module_zz:f"}, "module 'no_such_module_zz' cannot be imported"),
        ({"function": F + "missing"}, "has no function 'missing'"),
        ({"function": F + "reverse_ids"}, "works on tokens, but source 'synthetic' is text"),
    ):
        with pytest.raises(TransformError, match=message):
            ZephonLoader(loader_config(transform_corpus.text_path, [entry]))
    with pytest.raises(ConfigError, match=r"transforms\[0\]: .*function 'nope' is neither"):
        loader_config(transform_corpus.text_path, [{"function": "nope"}])


def test_a_bad_result_is_named_with_the_document(transform_corpus):
    chain = TransformChain([TransformSpec(F + "shout_every_other_word")], seed=0, source="web", pretokenized=True)
    with pytest.raises(TransformError, match="changed the text of document 'd1' of pre-tokenized source 'web'"):
        chain.apply(Document("d1", text="a b c", seed_base=0), TransformCounts.zeros(1))


def test_a_changed_transform_is_refused_and_accepted_from_a_declared_step(transform_corpus):
    path = transform_corpus.text_path
    old = loader_config(path, TEXT_TRANSFORMS[:2])
    state = state_after(old, 3)
    assert state["transforms"]["changes"] == []
    new_transforms = [TEXT_TRANSFORMS[0], {"function": "drop_regex", "args": {"pattern": "^doc\\d*7 "}}]
    new = loader_config(path, new_transforms)
    with pytest.raises(StateError, match=r"(?s)transforms of source 'synthetic': checkpoint \[.*shout_every_other_word"
                                         r".*\], now \[.*drop_regex\(pattern='\^doc.*transforms_from_step"):
        ZephonLoader(new).load_state_dict(state)
    with pytest.raises(StateError, match="transforms_from_step = 5 is after the checkpoint's step 3"):
        ZephonLoader(new.replace(transforms_from_step=5)).load_state_dict(state)

    declared = new.replace(transforms_from_step=3)

    def make(k: int) -> LoaderRun:
        world_size, workers, micro = ((1, 0, 2), (2, 2, 4), (4, 0, 1))[k % 3]
        return ResumedRun(declared.replace(num_workers=workers, micro_batch_size=micro), world_size, state)

    report = check_resume(make, steps=4, cut_points=[2])  # from step 3: other W and workers, same batches
    after = json.loads(report.states[2])
    assert after["transforms"]["changes"] == [{"step": 3, "sources": ["synthetic"]}]
    assert after["transforms"]["sources"]["synthetic"][1]["function"] == "drop_regex"
    # A checkpoint made after the change resumes with the new config alone (no difference left).
    with ZephonLoader(new) as loader:
        loader.load_state_dict(after)
        next(loader)
    # ... and the transforms' counters restarted at the change (two transforms, none from before).
    counts = ZephonLoader(declared)
    counts.load_state_dict(after)
    assert set(counts.transform_counts()["synthetic"]) == {"0:" + F + "drop_multiple_of_three", "1:drop_regex"}
    counts.close()


class ResumedRun(LoaderRun):
    """A LoaderRun that first loads ``initial`` (the checkpoint made with the old transforms)."""

    def __init__(self, config, world_size, initial):
        super().__init__(config, world_size)
        self.load(initial)


def test_counters_match_the_documents_and_the_topology(transform_corpus):
    config = loader_config(transform_corpus.pretokenized_path, [
        {"function": "length_tokens", "args": {"min": 12}}, {"function": "truncate_tokens", "args": {"max_tokens": 30}}])
    reports = []
    for world_size, workers in ((1, 0), (2, 2)):
        from loader.commands.fingerprints import collect_fingerprints

        counts: dict = {}
        collect_fingerprints(config.replace(num_workers=workers), world_size=world_size, end_step=40,
                             transform_counts=counts)
        reports.append(counts)
    assert reports[0] == reports[1]
    # 40 steps of 8 x 48 tokens pass every lane's first epoch: each lane's documents are counted once.
    from loader.stages.tokenizer import load_tokenizer
    from loader.samples import default_tokenizer_path

    tokenizer = load_tokenizer(default_tokenizer_path())
    lengths = [len(e.ids) for e in tokenizer.encode_batch(transform_corpus.texts, add_special_tokens=False)]
    counted = reports[0]["synthetic"]
    assert counted["0:length_tokens"]["dropped"] >= sum(1 for n in lengths if n < 12) > 0
    assert counted["1:truncate_tokens"]["changed"] >= sum(1 for n in lengths if n > 30) > 0


def _row_group_keys(path: str) -> list[list[str]]:
    import glob

    import pyarrow.parquet as pq

    groups = []
    for file in sorted(glob.glob(f"{path}/lane=*/part-*.parquet")):
        parquet = pq.ParquetFile(file)
        groups += [parquet.read_row_group(g, columns=["key"]).column(0).to_pylist()
                   for g in range(parquet.metadata.num_row_groups)]
    return groups


def test_a_filter_that_empties_whole_row_groups_keeps_cursors_right(transform_corpus):
    # Drops doc-0000000 .. doc-0000099 (100 of 160): many 4-row groups lose every document.
    prefix = "doc-00000"
    groups = _row_group_keys(transform_corpus.pretokenized_path)
    assert sum(all(k.startswith(prefix) for k in keys) for keys in groups) >= 3
    config = loader_config(transform_corpus.pretokenized_path,
                           [{"function": F + "drop_key_prefix", "args": {"prefix": prefix}}], packing="best_fit")
    reference = LoaderRun(config, 1)
    lines = reference.run(8)
    reference.close()
    assert len(lines) == 8

    def make(k: int) -> LoaderRun:
        world_size, workers = ((1, 0), (2, 0), (4, 0), (1, 2))[k % 4]
        return LoaderRun(config.replace(num_workers=workers), world_size)

    check_resume(make, steps=8, cut_points=[1, 2, 5], expected=lines)


def test_a_lane_whose_every_document_is_dropped_is_an_error(transform_corpus):
    from loader.io.lane_reader import EmptyLaneError

    config = loader_config(transform_corpus.text_path, [{"function": F + "drop_all"}])
    with ZephonLoader(config) as loader:
        with pytest.raises(EmptyLaneError, match=r"lane 0 of source 'synthetic' .*every document is dropped by its "
                                                 r"transforms \(tests.transforms.functions:drop_all\)"):
            next(loader)


def test_a_declared_change_moves_a_cursor_whose_document_is_dropped_to_the_next_document(transform_corpus):
    import pyarrow.parquet as pq

    from loader.io.blocks import TokenFormat
    from loader.io.lane_reader import TRANSFORMS_CHANGED, LaneTokenStream
    from loader.io.manifest import read_manifest

    path = transform_corpus.pretokenized_path
    manifest = read_manifest(path)

    def stream(transforms=()):
        return LaneTokenStream(dataset_path=path, manifest=manifest, source_name="synthetic", lane_id=0, seed=5,
                               token_format=TokenFormat(None, 0), transforms=transforms)

    before = stream()
    before.take(7)  # inside the first or second document of block 0
    block = before._load_block(0, 0)
    offset = before.offset
    doc = int(np.searchsorted(block.doc_starts, offset, side="right")) - 1
    assert block.doc_starts[doc] < offset  # mid-document
    keys = pq.ParquetFile(f"{path}/{manifest.lane_files(0)[0].path}").read_row_group(0, columns=["key"]).column(0)
    dropped_key = keys.to_pylist()[doc]
    after = stream((TransformSpec(F + "drop_key_prefix", {"prefix": dropped_key}, stage="tokens"),))
    after.set_state(dict(before.get_state(), **{TRANSFORMS_CHANGED: True}))
    new_block = after._load_block(0, 0)
    assert len(new_block.doc_starts) == len(block.doc_starts) - 1  # the cursor's document is gone
    # The saved offset counted tokens of the old block: moved forward to a document start of the new one.
    assert after.offset == min(int(s) for s in new_block.doc_starts if s >= offset)
    assert after.get_state()["transforms"] == [[1, 0]]  # inside the block: counted, under the new transforms
    expected = new_block.tokens[after.offset: after.offset + 5]
    assert after.take(5).tokens.tolist() == expected.tolist()
    before.close()
    after.close()
