"""One rank of the torchtitan-style / DCP tests (launched by test_stateful_dataloader.py via tests.rank_launcher).

``main([CONFIG, OUT, STEPS, CHECKPOINT, MODE])`` under the torchrun environment, gloo:

- ``mesh``: 4 ranks as a ``(dp=2, tp=2)`` DeviceMesh. A ``ZephonTitanDataLoader`` from the
  mesh consumes STEPS steps, fetches one micro-batch more (as a prefetching framework
  would) and ``dcp.save``s itself. Also, after the same steps: ``global_state_dict()`` of
  that loader (the mesh's DP group), of a loader built with ``dp_rank``/``dp_world_size``
  and no mesh (the default group, TP duplicates merged once), and two misuses whose
  merge must refuse: loaders built from the global RANK/WORLD_SIZE, merged over the DP
  group; and TP peers whose states differ (only TP rank 0 iterated one step more).
- ``load``: W ranks of pure data parallelism ``dcp.load`` the checkpoint into a
  ``ZephonTitanDataLoader(config, dp_rank=RANK, dp_world_size=WORLD_SIZE)`` and consume STEPS.

Rank 0 writes ``OUT``: per process its mesh coordinates and every micro-batch received
(``[step, micro_step, {global_index: hex bytes in the fingerprint layout}]``), plus the
merged states and error messages.
"""

from __future__ import annotations

import json


def _micro_batch_rows(batch) -> dict[str, str]:
    from loader.commands.fingerprints import sequence_bytes

    return {str(index): sequence_bytes(ids, labels).hex() for index, ids, labels in
            zip(batch["global_indices"].tolist(), batch["input_ids"].numpy(), batch["labels"].numpy())}


def _consume(iterator, micro_batches: int) -> list:
    return [[b["step"], b["micro_step"], _micro_batch_rows(b)] for b in (next(iterator) for _ in range(micro_batches))]


def _refusal(merge) -> str:
    """The StateError message of a merge that must refuse, or a marker that it did not."""
    from loader.checkpoint.state import StateError

    try:
        merge()
    except StateError as exc:
        return str(exc)
    return "NOT REFUSED"


def _mesh_run(config, steps: int, checkpoint: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from loader.integrations.titan import ZephonTitanDataLoader
    from loader.pipeline import ZephonLoader
    from loader.checkpoint.state import dumps

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    dataloader = ZephonTitanDataLoader(config, device_mesh=mesh, dp_mesh_dim="dp")
    assert (dataloader.dp_rank, dataloader.dp_world_size) == (dp, 2)
    micro_steps = dataloader.micro_steps_per_step
    iterator = iter(dataloader)
    batches = _consume(iterator, steps * micro_steps)
    ahead = _consume(iterator, 1)  # a prefetching framework holds the next micro-batch
    dcp.save({"dataloader": dataloader}, checkpoint_id=checkpoint)
    with_mesh = dumps(dataloader.global_state_dict())

    # Without a mesh: the default group holds both TP peers of each DP rank.
    with ZephonLoader(config, dp_rank=dp, dp_world_size=2) as plain:
        for _ in range(steps * micro_steps):
            next(plain)
        without_mesh = dumps(plain.global_state_dict())
        # Only TP rank 0 iterates one step more: two different states claim one DP rank.
        if tp == 0:
            for _ in range(micro_steps):
                next(plain)
        peers_differ = _refusal(plain.global_state_dict)
    # TP peers built from the global RANK/WORLD_SIZE hold different lanes (W=4 ranks).
    with ZephonLoader(config) as from_rank:
        for _ in range(steps * from_rank.topology.micro_steps_per_step):
            next(from_rank)
        global_rank_over_dp_group = _refusal(lambda: from_rank.global_state_dict(group=mesh.get_group("dp")))
    dataloader.close()
    return {"rank": dist.get_rank(), "dp": dp, "tp": tp, "batches": batches, "ahead": ahead,
            "global_with_mesh": with_mesh, "global_without_mesh": without_mesh,
            "refusal_peers_differ": peers_differ, "refusal_global_rank": global_rank_over_dp_group}


def _load_run(config, steps: int, checkpoint: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from loader.integrations.titan import ZephonTitanDataLoader

    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataloader = ZephonTitanDataLoader(config, dp_rank=rank, dp_world_size=world_size)
    dcp.load({"dataloader": dataloader}, checkpoint_id=checkpoint)
    first_step = dataloader.loader.step
    batches = _consume(iter(dataloader), steps * dataloader.micro_steps_per_step)
    dataloader.close()
    return {"rank": rank, "dp": rank, "tp": 0, "first_step": first_step, "batches": batches}


def main(argv: list[str]) -> int:
    config_path, out_path, steps, checkpoint, mode = argv[0], argv[1], int(argv[2]), argv[3], argv[4]
    import torch.distributed as dist

    from loader.config import LoaderConfig

    dist.init_process_group("gloo")
    config = LoaderConfig.from_file(config_path)
    report = (_mesh_run if mode == "mesh" else _load_run)(config, steps, checkpoint)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(gathered, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0
