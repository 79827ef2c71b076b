"""torchdata ``StatefulDataLoader`` and the torchtitan-style loader: what the trainer receives.

Every micro-batch a trainer would pass to its model is hashed the way ``zephon fingerprints``
hashes a step, and the reassembled global batches are compared with one uninterrupted W=1
``collect_fingerprints`` run:

- StatefulDataLoader, 2 ranks simulated in one process: uninterrupted; stopped mid-step and
  resumed on the same ranks from their own states; stopped at a step boundary and resumed on
  1 rank (another micro-batch size) from the merged state (:func:`merge_dataloader_states`).
  A tiny model trained on those micro-batches has bit-identical step losses where the
  topology is unchanged and equal ones up to float summation order on 1 rank.
- ``ZephonTitanDataLoader`` under real gloo ranks (``tests/integrations/titan_worker.py``):
  4 processes as a (dp=2, tp=2) DeviceMesh, ``dcp.save`` at step 3 with one micro-batch
  fetched ahead; ``dcp.load`` on 2 processes (pure data parallel) and on 1 (this process).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import torch

from loader.config import LoaderConfig
from loader.commands.fingerprints import collect_fingerprints, sequence_bytes
from loader.integrations.titan import ZephonTitanDataLoader
from loader.integrations.stateful_dataloader import (
    DATASET_ITER_STATE, DATASET_STATE, FETCHER_STATE, merge_dataloader_states, zephon_state_of,
    zephon_stateful_dataloader,
)
from loader.pipeline import ZephonLoader
from loader.checkpoint.state import StateError, dumps
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.loader.settings import DATA_SEED, GLOBAL_BATCH, LOADER_SEED, NUM_DOCS, NUM_LANES, OPEN_BINS, SEQ_LEN
from tests.rank_launcher import global_fingerprints, launch_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 6
CUT = 3
LAUNCH_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> LoaderConfig:
    from loader.samples import default_tokenizer_path
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("torchdata")
    tokenizer_path = default_tokenizer_path()
    write_dataset(str(root / "data"), synthetic_texts(NUM_DOCS, seed=7, max_words=40), num_lanes=NUM_LANES,
                  seed=DATA_SEED, files_per_lane=2, row_group_rows=4, tokenizer=Tokenizer.from_file(tokenizer_path))
    return LoaderConfig(datasets=[{"path": str(root / "data")}], seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH,
                        micro_batch_size=2, seed=LOADER_SEED, tokenizer=tokenizer_path, packing="best_fit",
                        best_fit_open_bins=OPEN_BINS, num_workers=0)


@pytest.fixture(scope="module")
def baseline(config) -> list[str]:
    results, _ = collect_fingerprints(config, world_size=1, end_step=STEPS)
    return [r.line() for r in results]


def rank_result(per_rank_batches: list[list[dict]], first_step: int) -> dict:
    """Micro-batches each rank received, in the shape ``tests.rank_launcher.global_fingerprints`` reads."""
    ranks = []
    for rank, batches in enumerate(per_rank_batches):
        rows = {}
        for batch in batches:
            for index, hex_bytes in batch_rows(batch).items():
                rows[index] = [rank, batch["step"], hex_bytes]
        ranks.append({"first_step": first_step, "rows": rows})
    return {"world_size": len(per_rank_batches), "ranks": ranks}


def batch_rows(batch: dict) -> dict[str, str]:
    return {str(index): sequence_bytes(ids, labels).hex() for index, ids, labels in
            zip(batch["global_indices"].tolist(), batch["input_ids"].numpy(), batch["labels"].numpy())}


def take(dataloader, micro_batches: int) -> list[dict]:
    iterator = iter(dataloader)
    return [next(iterator) for _ in range(micro_batches)]


def dataloaders(config: LoaderConfig, world_size: int):
    return [zephon_stateful_dataloader(ZephonLoader(config, dp_rank=r, dp_world_size=world_size))
            for r in range(world_size)]


def close(dls) -> None:
    for dl in dls:
        dl.dataset.loader.close()


class TinyLM(torch.nn.Module):
    """A tiny randomly initialised language model; returns the token-summed loss (labels shifted)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 16)
        self.head = torch.nn.Linear(16, vocab)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100, reduction="sum")


@dataclass
class Trained:
    model: dict
    optimizer: dict
    losses: list[float]


def train(model_state: dict, optimizer_state, dls, steps: int) -> tuple[Trained, list[list[dict]]]:
    """Data-parallel training simulated in one process: every rank's micro-batches of a step
    feed one gradient (token-weighted mean over the global batch), then one optimizer step.
    Returns the trained state, the step losses and the micro-batches each rank received."""
    model = TinyLM(model_state["embed.weight"].shape[0])
    model.load_state_dict(model_state)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)  # Adam would amplify float noise
    if optimizer_state is not None:
        optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # it would share (and step) the buffers
    micro_steps = dls[0].dataset.loader.topology.micro_steps_per_step
    received: list[list[dict]] = [[] for _ in dls]
    losses = []
    for _ in range(steps):
        per_rank = [take(dl, micro_steps) for dl in dls]
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for batches in per_rank for b in batches)
        optimizer.zero_grad()
        total = 0.0
        for rank, batches in enumerate(per_rank):
            received[rank] += batches
            for batch in batches:
                loss = model(batch["input_ids"], batch["labels"])
                (loss / tokens).backward()
                total += loss.item()
        optimizer.step()
        losses.append(total / tokens)
    return Trained(copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), losses), received


# -- torchdata StatefulDataLoader ------------------------------------------------------------

def test_stateful_dataloader_uninterrupted_and_mid_step_resume_on_two_ranks(config, baseline):
    micro_steps = GLOBAL_BATCH // 2 // config.micro_batch_size
    dls = dataloaders(config, 2)
    try:
        whole = [take(dl, STEPS * micro_steps) for dl in dls]
    finally:
        close(dls)
    assert global_fingerprints(rank_result(whole, 0), GLOBAL_BATCH) == baseline

    cut = CUT * micro_steps + 1  # one micro-batch into step CUT
    dls = dataloaders(config, 2)
    try:
        before = [take(dl, cut) for dl in dls]
        states = [json.loads(json.dumps(dl.state_dict())) for dl in dls]  # what a checkpoint file holds
    finally:
        close(dls)
    assert zephon_state_of(states[0])["rank_position"] == cut * config.micro_batch_size
    with pytest.raises(StateError, match="mid-step"):
        merge_dataloader_states(states)  # another world size needs a step boundary
    resumed = dataloaders(config, 2)
    try:
        for dl, state in zip(resumed, states):
            dl.load_state_dict(state)
        after = [take(dl, STEPS * micro_steps - cut) for dl in resumed]
    finally:
        close(resumed)
    joined = [b + a for b, a in zip(before, after)]
    assert [[batch_rows(x) for x in rank] for rank in joined] == [[batch_rows(x) for x in rank] for rank in whole]
    assert global_fingerprints(rank_result(joined, 0), GLOBAL_BATCH) == baseline


def test_stateful_dataloader_elastic_resume_two_ranks_to_one_through_merge(config, baseline):
    from tokenizers import Tokenizer

    torch.manual_seed(0)
    initial = TinyLM(Tokenizer.from_file(config.tokenizer).get_vocab_size()).state_dict()
    dls = dataloaders(config, 2)
    try:
        first, _ = train(initial, None, dls, CUT)
        states = [json.loads(json.dumps(dl.state_dict())) for dl in dls]  # after optimizer step CUT - 1
        checkpoint = (first.model, first.optimizer)
        rest, _ = train(*checkpoint, dls, STEPS - CUT)  # the uninterrupted run goes on
    finally:
        close(dls)
    reference = first.losses + rest.losses
    merged = merge_dataloader_states(states + states[:1])  # a duplicate (TP peer) counts once
    assert merged[DATASET_STATE] == merged[FETCHER_STATE][DATASET_ITER_STATE]
    assert merged[DATASET_STATE]["next_global_index"] == CUT * GLOBAL_BATCH and "rank" not in merged[DATASET_STATE]

    same = dataloaders(config, 2)  # the same topology from the ranks' own states: bit-identical losses
    try:
        for dl, state in zip(same, states):
            dl.load_state_dict(state)
        again, _ = train(*checkpoint, same, STEPS - CUT)
    finally:
        close(same)
    assert again.losses == reference[CUT:]

    one_rank = config.replace(micro_batch_size=4)  # micro-batch size may change with the world size
    (dl,) = dataloaders(one_rank, 1)
    try:
        dl.load_state_dict(json.loads(json.dumps(merged)))
        elastic, (after,) = train(*checkpoint, [dl], STEPS - CUT)
    finally:
        close([dl])
    assert global_fingerprints(rank_result([after], CUT), GLOBAL_BATCH) == baseline[CUT:]
    # Another grouping of the same tokens into micro-batches: equal up to float summation order.
    assert elastic.losses == pytest.approx(reference[CUT:], rel=1e-6)

    edited = dict(states[1], **{DATASET_STATE: states[0][DATASET_STATE]})
    with pytest.raises(StateError, match="differ"):
        zephon_state_of(edited)
    with pytest.raises(StateError, match="num_workers > 0"):
        zephon_state_of({"_snapshot": {}, "_steps_since_snapshot": 0})
    with pytest.raises(StateError, match="every rank"):
        merge_dataloader_states([])


# -- torchtitan-style loader ------------------------------------------------------------------

def test_titan_loader_saves_the_finished_steps_boundary_and_refuses_misuse(config):
    with pytest.raises(StateError, match="dp_rank= and dp_world_size="):
        ZephonTitanDataLoader(config)
    ahead = ZephonTitanDataLoader(config, dp_rank=1, dp_world_size=2)
    exact = ZephonTitanDataLoader(config, dp_rank=1, dp_world_size=2)
    try:
        assert (ahead.dp_rank, ahead.dp_world_size, ahead.batch_size, ahead.micro_steps_per_step) == (1, 2, 2, 4)
        take(exact, CUT * ahead.micro_steps_per_step)
        take(ahead, CUT * ahead.micro_steps_per_step + 1)  # fetched one micro-batch of step CUT
        saved = ahead.state_dict()
        assert saved == exact.state_dict()
        assert json.loads(saved["zephon_meta"])["next_global_index"] == CUT * GLOBAL_BATCH
        assert sorted(k for k in saved if k.startswith("lane_")) == ["lane_00001", "lane_00003", "lane_00005",
                                                                    "lane_00007"]
        ahead.checkpoint_step = CUT - 1  # a trainer one whole step ahead says how far it trained
        assert json.loads(ahead.state_dict()["zephon_meta"])["next_global_index"] == (CUT - 1) * GLOBAL_BATCH
        with pytest.raises(StateError, match="empty state"):
            ahead.load_state_dict({})
    finally:
        ahead.close()
        exact.close()


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_titan_loader_under_dcp_on_a_2x2_mesh_resumes_on_2_and_1_processes(tmp_path, config, baseline):
    import torch.distributed.checkpoint as dcp

    config_path = tmp_path / "loader.json"
    fields = config.to_dict()
    fields["datasets"] = [{"path": d["path"]} for d in fields["datasets"]]
    config_path.write_text(json.dumps(fields))
    checkpoint, mesh_out, load_out = str(tmp_path / "dcp"), tmp_path / "mesh.json", tmp_path / "load.json"
    worker = "tests.integrations.titan_worker"
    launch_ranks(4, worker, [str(config_path), str(mesh_out), str(CUT), checkpoint, "mesh"],
                 timeout_s=LAUNCH_TIMEOUT_S)
    launch_ranks(2, worker, [str(config_path), str(load_out), str(STEPS - CUT), checkpoint, "load"],
                 timeout_s=LAUNCH_TIMEOUT_S)

    mesh = {(p["dp"], p["tp"]): p for p in json.loads(mesh_out.read_text())}
    assert sorted(mesh) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for dp in (0, 1):  # tensor-parallel peers receive the same micro-batches, in the same order
        assert mesh[dp, 0]["batches"] == mesh[dp, 1]["batches"] and mesh[dp, 0]["ahead"] == mesh[dp, 1]["ahead"]
        assert len(mesh[dp, 0]["batches"]) == CUT * GLOBAL_BATCH // 2 // config.micro_batch_size
    assert fingerprints_of([mesh[0, 0], mesh[1, 0]], 0) == baseline[:CUT]

    _, expected_state = collect_fingerprints(config, world_size=1, end_step=CUT, save_state_step=CUT)
    for process in mesh.values():  # the mesh's DP group, and the default group with TP duplicates
        assert process["global_with_mesh"] == process["global_without_mesh"] == dumps(expected_state)
        assert "two different states claim rank" in process["refusal_peers_differ"]
        assert "need one state per rank 0..3 (got ranks" in process["refusal_global_rank"]
        assert "dp_rank/dp_world_size" in process["refusal_global_rank"]

    loaded = json.loads(load_out.read_text())
    assert [p["first_step"] for p in loaded] == [CUT, CUT]
    assert fingerprints_of(loaded, CUT) == baseline[CUT:]

    # One process, no process group (dcp.load reads without one), another micro-batch size.
    single = ZephonTitanDataLoader(config.replace(micro_batch_size=4), dp_rank=0, dp_world_size=1)
    try:
        dcp.load({"dataloader": single}, checkpoint_id=checkpoint)
        assert single.loader.step == CUT
        batches = take(single, (STEPS - CUT) * single.micro_steps_per_step)
    finally:
        single.close()
    assert global_fingerprints(rank_result([batches], CUT), GLOBAL_BATCH) == baseline[CUT:]


def fingerprints_of(processes: list[dict], first_step: int) -> list[str]:
    """Global fingerprints from worker reports (one process per data-parallel rank, in dp order)."""
    ranks = [{"first_step": first_step,
              "rows": {index: [p["dp"], step, hex_bytes] for step, _, rows in p["batches"]
                       for index, hex_bytes in rows.items()}} for p in sorted(processes, key=lambda p: p["dp"])]
    return global_fingerprints({"world_size": len(ranks), "ranks": ranks}, GLOBAL_BATCH)
