"""A lane with one block holding tokens is never reported empty (issue 28, reported bug).

The empty-lane guard used to count empty blocks in a row and fail at an epoch's worth: with
the block holding tokens at position p of one epoch and q > p of the next (each epoch
shuffles the blocks), the run p+1 .. B-1, 0 .. q-1 is B - 1 - p + q >= B blocks long, and the
lane was refused although it holds a document (seen with online chat at seq_len 256 and
--chat-max-tokens 255, 3-8 small files a lane). Here every document but one is dropped by a
transform, over several seeds, for several epochs: no error, and the seeds include runs the
old count refused. A lane with no token at all is still one EmptyLaneError.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from loader.io.lane_reader import EmptyLaneError, LaneTokenStream
from loader.pipeline import ZephonLoader
from tests.dataset_factory import synthetic_texts, write_dataset

HOSTILE = "tests.adversarial.hostile_transforms:"
SEEDS = range(8)
EPOCHS = 6


@pytest.fixture(scope="module")
def one_lane(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("one_block") / "data")
    write_dataset(path, synthetic_texts(40, seed=9, max_words=12), num_lanes=1, files_per_lane=4, row_group_rows=4)
    return path


def _config(path: str, seed: int, transform: dict) -> LoaderConfig:
    return LoaderConfig(datasets=[{"path": path, "transforms": [transform]}], seq_len=8, global_batch_size=1,
                        micro_batch_size=1, seed=seed, tokenizer=default_tokenizer_path(), num_workers=0)


def _old_count_refuses(left: list[bool], blocks: int) -> bool:
    """The old guard on the blocks left, in order (True: empty): a run of ``blocks`` empties."""
    run = 0
    for empty in left:
        run = run + 1 if empty else 0
        if run >= blocks:
            return True
    return False


def test_a_lane_with_one_non_empty_block_runs_for_many_epochs(one_lane, monkeypatch):
    first_key = pq.read_table(f"{one_lane}/lane=00000/part-00000.parquet", columns=["key"]).column(0)[0].as_py()
    transform = {"function": HOSTILE + "keep_only", "args": {"key": first_key}}
    left: list = []  # (epoch, empty) of every block the stream leaves
    real = LaneTokenStream._note_block_left

    def spy(self):
        left.append((self.epoch, self._block is not None and self._block_key == (self.epoch, self.block_index)
                     and len(self._block.tokens) == 0, len(self.blocks_of_epoch(self.epoch))))
        return real(self)

    monkeypatch.setattr(LaneTokenStream, "_note_block_left", spy)
    refused_before = 0
    for seed in SEEDS:
        left.clear()
        with ZephonLoader(_config(one_lane, seed, transform)) as loader:
            while not left or left[-1][0] < EPOCHS:
                next(loader)
        assert sum(not empty for _, empty, _ in left) >= EPOCHS - 1  # the block with tokens, once an epoch
        refused_before += _old_count_refuses([empty for _, empty, _ in left], left[0][2])
    assert refused_before > 0  # the seeds include runs the old guard refused


def test_a_lane_without_any_token_is_still_one_error(one_lane):
    transform = {"function": HOSTILE + "keep_only", "args": {"key": "no such key"}}
    with ZephonLoader(_config(one_lane, 0, transform)) as loader:
        with pytest.raises(EmptyLaneError, match="in every block of the lane"):
            next(loader)
