"""One rank of the multi-process torch.distributed test (launched by test_distributed.py).

``python -m tests.loader.dist_worker CONFIG OUT STEPS CHECKPOINT {save,load}`` with the
torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or through
``tests.rank_launcher.launch_ranks`` (ranks forked from a forkserver that has imported torch
once, instead of importing it in every rank). The rank builds its
``ZephonLoader`` from that environment, optionally ``dcp.load``s the loader state, consumes
``STEPS`` optimizer steps (mode ``drain``: until the data ends), optionally ``dcp.save``s, and all ranks ``all_gather`` their
sequences (hex bytes in the fingerprint layout, by global index) to rank 0, which writes
them to ``OUT`` as JSON.
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> int:
    config_path, out_path, steps, checkpoint, mode = argv[0], argv[1], int(argv[2]), argv[3], argv[4]
    started = time.monotonic()

    def log(what: str) -> None:
        print(f"{time.monotonic() - started:7.2f} s  {what}", flush=True)

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from loader.config import LoaderConfig
    from loader.commands.fingerprints import sequence_bytes
    from loader.pipeline import ZephonLoader
    from loader.integrations.torch_data import LoaderStateful
    from tests.rank_launcher import write_gathered

    log("imported torch.distributed.checkpoint and the loader")
    dist.init_process_group("gloo")
    log("process group up")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    loader = ZephonLoader(LoaderConfig.from_file(config_path))  # rank and world size from the environment
    assert (loader.topology.rank, loader.topology.world_size) == (rank, world_size)
    if mode == "load":
        dcp.load({"data": LoaderStateful(loader)}, checkpoint_id=checkpoint)
    first_step = loader.step
    log(f"loader ready at step {first_step}")
    rows: dict[str, list] = {}
    # "drain" (finite data): iterate until the loader stops; every rank must stop at the same step.
    micro_batches = iter(loader) if mode == "drain" else (next(loader) for _ in range(steps * loader.topology.micro_steps_per_step))
    for batch in micro_batches:
        for index, ids, labels in zip(batch["global_indices"].tolist(), batch["input_ids"].numpy(),
                                      batch["labels"].numpy()):
            rows[str(index)] = [rank, batch["step"], sequence_bytes(ids, labels).hex()]
    if mode == "save":
        dcp.save({"data": LoaderStateful(loader)}, checkpoint_id=checkpoint)
    log(f"{steps} steps consumed" + (", checkpoint saved" if mode == "save" else ""))
    write_gathered(dist, out_path, {"first_step": first_step, "rows": rows})
    loader.close()
    dist.barrier()
    dist.destroy_process_group()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
