"""``num_items_in_batch``: the loss tokens of the whole step, on every micro-batch of it.

Checked against an independent count: loaders without ``model_inputs`` at the same topology,
every rank's micro-batches of a step gathered and ``labels[:, 1:] != -100`` counted, for
W = 1, 2, 4 and micro-batch sizes 1, 2, 4 (ranks simulated in one process; the gloo run is in
test_loss_tokens_distributed.py). Then with a tiny Llama: the losses of a step's micro-batches
summed over all ranks equal the global batch's mean token loss.
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tokenizers import Tokenizer  # noqa: E402

from loader.samples import default_tokenizer_path  # noqa: E402
from loader.checkpoint.state import StateError, merge_rank_states  # noqa: E402
from loader.config import LoaderConfig  # noqa: E402
from loader.model_inputs.loss_tokens import data_parallel_share  # noqa: E402
from loader.pipeline import ZephonLoader  # noqa: E402
from tests.dataset_factory import synthetic_texts, write_dataset  # noqa: E402
from tests.model_inputs.models import tiny_llama  # noqa: E402

GLOBAL_BATCH = 8
STEPS = 3
TOPOLOGIES = [(w, m) for w in (1, 2, 4) for m in (1, 2, 4) if (GLOBAL_BATCH // w) % m == 0]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("loss_tokens") / "pre"
    # loss masks on some documents: the count must follow the label rules too
    texts = synthetic_texts(120, seed=9, max_words=6)
    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    ids = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    masks = [[(k + j) % 3 != 0 for j in range(len(i))] if k % 2 else [1] * len(i) for k, i in enumerate(ids)]
    write_dataset(str(path), texts, num_lanes=8, seed=4, tokenizer=tokenizer, loss_masks=masks)
    return str(path)


def config(path: str, micro_batch_size: int, **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path}], seq_len=64, global_batch_size=GLOBAL_BATCH,
                  micro_batch_size=micro_batch_size, seed=3, tokenizer=default_tokenizer_path(),
                  model_inputs="causal_lm", packing="best_fit")
    fields.update(overrides)
    return LoaderConfig(**fields)


def rank_batches(cfg: LoaderConfig, world_size: int, steps: int) -> list[list[dict]]:
    """Per rank, its micro-batches of ``steps`` steps (ranks simulated in one process)."""
    out = []
    for rank in range(world_size):
        with ZephonLoader(cfg, rank=rank, world_size=world_size) as loader:
            out.append([next(loader) for _ in range(steps * loader.topology.micro_steps_per_step)])
    return out


def independent_counts(path: str, world_size: int, micro: int, **overrides) -> list[int]:
    """Per step, ``labels[:, 1:] != -100`` over every rank's micro-batches of the loader's own batches."""
    counts: collections.Counter = collections.Counter()
    for batches in rank_batches(config(path, micro, model_inputs=None, **overrides), world_size, STEPS):
        for batch in batches:
            counts[batch["step"]] += int((batch["labels"][:, 1:] != -100).sum())
    return [counts[s] for s in range(STEPS)]


@pytest.mark.parametrize("world_size,micro,packing", [(w, m, "best_fit") for w, m in TOPOLOGIES] +
                         [(2, 2, "concat"), (1, 4, "concat")])
def test_every_micro_batch_carries_the_steps_count_over_all_ranks(dataset, world_size, micro, packing):
    expected = independent_counts(dataset, world_size, micro, packing=packing)
    assert len(set(expected)) > 1  # steps differ: a per-step count, not a constant
    micro_steps = GLOBAL_BATCH // world_size // micro
    for batches in rank_batches(config(dataset, micro, packing=packing), world_size, STEPS):
        got = [int(b["num_items_in_batch"]) for b in batches]
        assert got == [expected[k // micro_steps] for k in range(len(got))]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("world_size,micro", [(1, 2), (2, 1), (4, 2)])
def test_summed_losses_are_the_global_mean_token_loss(dataset, world_size, micro):
    model = tiny_llama("sdpa")
    per_rank = rank_batches(config(dataset, micro), world_size, 1)
    with torch.no_grad():
        summed = sum(model(**b).loss for batches in per_rank for b in batches)
        # the global batch in one forward pass, one mean over its shifted labels
        rows = [b for batches in per_rank for b in batches]
        packed = {k: torch.cat([b[k] for b in rows]) for k in ("input_ids", "labels", "position_ids")}
        logits = model(**packed, use_cache=False).logits
        mean = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                 packed["labels"][:, 1:].reshape(-1), ignore_index=-100)
    assert abs(summed.item() - mean.item()) <= 1e-5 * max(1.0, abs(mean.item()))


def test_resume_at_a_step_boundary_counts_the_same(dataset):
    cfg = config(dataset, 2)
    batches = rank_batches(cfg, 2, 3)
    states = []
    for rank in range(2):
        with ZephonLoader(cfg, rank=rank, world_size=2) as loader:
            for _ in range(loader.topology.micro_steps_per_step):
                next(loader)
            states.append(loader.state_dict())
    merged = merge_rank_states(states)
    for rank in range(2):
        with ZephonLoader(cfg, rank=rank, world_size=2) as loader:
            loader.load_state_dict(merged)
            again = [int(next(loader)["num_items_in_batch"]) for _ in range(4)]
        assert again == [int(b["num_items_in_batch"]) for b in batches[rank][2:6]]
    with ZephonLoader(cfg, rank=0, world_size=2) as loader:  # a rank's own state: not for simulated ranks
        loader.load_state_dict(states[0])
        with pytest.raises(StateError, match="merged state"):
            next(loader)


def test_mid_step_states_are_refused(dataset):
    cfg = config(dataset, 2)
    with ZephonLoader(cfg, rank=0, world_size=1) as loader:
        next(loader)
        with pytest.raises(StateError, match="mid-step .*step boundaries"):
            loader.state_dict()
        assert loader.state_dict(step=0)["next_global_index"] == 0  # the boundary state is there
    with ZephonLoader(cfg.replace(model_inputs=None), rank=0, world_size=1) as plain:
        next(plain)
        state = plain.state_dict()  # mid-step, from a loader without model_inputs
    with ZephonLoader(cfg, rank=0, world_size=1) as loader:
        with pytest.raises(StateError, match="mid-step .*step boundary"):
            loader.load_state_dict(state)


def test_workers_and_finite_data_hand_out_the_same_counts(dataset):
    """num_workers 2 (items from worker processes) and data that ends (max_epochs = 1, the
    finite look-ahead): the same micro-batches and counts as in-process, to the last step."""
    cfg = config(dataset, 2, datasets=[{"path": dataset, "max_epochs": 1}])
    runs = []
    for workers in (0, 2):
        with ZephonLoader(cfg.replace(num_workers=workers), rank=0, world_size=1) as loader:
            runs.append(list(loader))
    assert len(runs[0]) == len(runs[1]) > 4
    for a, b in zip(*runs):
        assert torch.equal(a["input_ids"], b["input_ids"]) and int(a["num_items_in_batch"]) == int(b["num_items_in_batch"])
    with ZephonLoader(cfg.replace(model_inputs=None), rank=0, world_size=1) as plain:
        expected = collections.Counter()
        for batch in plain:
            expected[batch["step"]] += int((batch["labels"][:, 1:] != -100).sum())
    micro_steps = GLOBAL_BATCH // 2
    assert [int(b["num_items_in_batch"]) for b in runs[0]] == [expected[k // micro_steps] for k in range(len(runs[0]))]


def test_a_step_without_loss_tokens_gets_a_zero_loss_not_nan(tmp_path, caplog):
    texts = synthetic_texts(80, seed=2, max_words=3)
    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    ids = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    write_dataset(str(tmp_path / "unsupervised"), texts, num_lanes=8, seed=4, tokenizer=tokenizer,
                  loss_masks=[[0] * len(i) for i in ids])
    with ZephonLoader(config(str(tmp_path / "unsupervised"), 2), rank=0, world_size=1) as loader:
        batch = next(loader)
    assert bool((batch["labels"] == -100).all()) and int(batch["num_items_in_batch"]) == 1
    assert "no loss tokens" in caplog.text
    with torch.no_grad():
        assert tiny_llama("sdpa")(**batch).loss.item() == 0.0


def test_tensor_parallel_peers_are_counted_once():
    assert data_parallel_share(3 * 2 * 100, 6, 3) == 300  # 3 DP ranks x 2 TP peers, each DP count twice
    assert data_parallel_share(300, 3, 3) == 300
    with pytest.raises(StateError, match="same dp_rank"):
        data_parallel_share(301, 6, 3)  # peers that did not get the same batches
