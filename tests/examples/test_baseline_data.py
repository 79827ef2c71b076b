"""The demo's two baselines, in process (no torchrun): what a resume on another world size sees.

``examples/baseline_data.py`` needs no process group, so the ranks of a world size are
simulated by building one data object per rank. A global batch is the multiset of the
ranks' sequences of a step (as the trainer fingerprints ``baseline_online``).

* ``baseline_online`` (shard documents, pack per rank): a resume on the *same* world size
  sees exactly the uninterrupted run's batches (so skipping is done right), a resume on
  another world size differs from the first resumed step on.
* ``baseline`` (pre-packed list + ``DistributedSampler``): the global batches of W=2 and
  W=1 agree in the steps before the epoch's last one.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

pytest.importorskip("torch")

from loader.samples import default_tokenizer_path  # noqa: E402
from examples.baseline_data import BaselineData, OnlineBaselineData, document_list, prepack  # noqa: E402
from loader.config import LoaderConfig  # noqa: E402
from loader.commands.fingerprints import sequence_bytes  # noqa: E402
from tests.dataset_factory import synthetic_texts, write_dataset  # noqa: E402

GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> LoaderConfig:
    root = tmp_path_factory.mktemp("baselines")
    write_dataset(str(root / "prose"), synthetic_texts(120, seed=1), num_lanes=4, seed=0, source_name="prose")
    write_dataset(str(root / "code"), synthetic_texts(60, seed=2), num_lanes=4, seed=0, source_name="code")
    path = root / "loader.toml"
    path.write_text(
        'datasets = [{path = "prose", weight = 0.7}, {path = "code", weight = 0.3}]\n'
        f"seq_len = 32\nglobal_batch_size = {GLOBAL_BATCH}\nmicro_batch_size = 2\nseed = 7\n"
        f'tokenizer = "{default_tokenizer_path()}"\n'
    )
    return LoaderConfig.from_file(str(path))


def global_batches(ranks: list, steps: range, start: int = 0) -> dict[int, collections.Counter]:
    """Step -> multiset of the ranks' sequences; ``start > 0`` resumes every rank by skipping."""
    if start:
        for data in ranks:
            data.start_at(start)
    out = {}
    for step in steps:
        batch = collections.Counter()
        for data in ranks:
            for b in data.next_step():
                batch.update(sequence_bytes(i, l) for i, l in zip(b["input_ids"].numpy(), b["labels"].numpy()))
        out[step] = batch
    for data in ranks:
        data.close()
    return out


def online(config: LoaderConfig, world_size: int, micro_batch: int, num_workers: int = 0) -> list:
    return [OnlineBaselineData(config, rank=r, world_size=world_size, micro_batch=micro_batch,
                               num_workers=num_workers) for r in range(world_size)]


def test_online_documents_hold_the_pre_packed_tokens(config: LoaderConfig) -> None:
    from loader.stages.tokenizer import EOS_CANDIDATES, load_tokenizer, resolve_special_token

    docs, names = document_list(config)
    packed = prepack(config)
    assert names == packed.source_names
    tokenizer = load_tokenizer(config.tokenizer)
    eos = resolve_special_token(tokenizer, config.eos_token, EOS_CANDIDATES, "eos_token")
    stream = online(config, 1, 2)[0].stream
    for source in range(len(names)):
        flat = [t for d in docs if d.source_id == source for t in stream._token_ids(d, tokenizer, None, eos)]
        assert flat == packed.input_ids[packed.source_ids == source].reshape(-1).tolist()


def test_online_resume_same_world_size_is_exact_other_world_size_differs(config: LoaderConfig) -> None:
    stop, end = 3, 6
    reference = global_batches(online(config, 2, 2), range(end))
    assert all(sum(b.values()) == GLOBAL_BATCH for b in reference.values())
    same_w = global_batches(online(config, 2, 4), range(stop, end), start=stop)  # other micro-batch size
    assert all(same_w[s] == reference[s] for s in range(stop, end))
    one_worker = global_batches(online(config, 2, 2, num_workers=1), range(stop, end), start=stop)
    assert all(one_worker[s] == reference[s] for s in range(stop, end))
    other_w = global_batches(online(config, 1, 4), range(stop, end), start=stop)
    assert all(other_w[s] != reference[s] for s in range(stop, end)), "W=1 should see other batches"


def test_pre_packed_batches_do_not_depend_on_world_size_before_the_epoch_end(config: LoaderConfig) -> None:
    packed = prepack(config)
    w2 = [BaselineData(packed, config, rank=r, world_size=2, micro_batch=2, num_workers=0) for r in range(2)]
    w1 = [BaselineData(packed, config, rank=0, world_size=1, micro_batch=4, num_workers=0)]
    last = w2[0].steps_per_epoch - 1
    assert last >= 4
    stop = 2
    a = global_batches(w2, range(last))
    b = global_batches(w1, range(stop, last), start=stop)
    assert all(a[s] == b[s] for s in range(stop, last))
