"""One rank of the gloo run of test_loss_tokens_distributed.py (``tests.rank_launcher``).

``argv`` = [config.json, out prefix, steps]. The rank trains step 0 with the raw-loop recipe of
docs/guides/model-inputs.md (DDP, ``no_sync`` until the step's last micro-batch, loss times the
world size), records ``num_items_in_batch`` of every micro-batch of ``steps`` steps and times
the per-step collective; writes ``{out}.rank{r}.pt``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time


def main(argv: list[str]) -> int:
    config_path, out, steps = argv[0], argv[1], int(argv[2])
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from loader.config import LoaderConfig
    from loader.model_inputs.loss_tokens import sum_over_ranks
    from loader.pipeline import ZephonLoader
    from tests.model_inputs.models import tiny_llama

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    loader = ZephonLoader(LoaderConfig.from_file(config_path))  # rank and world size from the environment
    model = DistributedDataParallel(tiny_llama("sdpa"))
    micro_steps = loader.topology.micro_steps_per_step
    counts = []
    for k in range(steps * micro_steps):
        batch = next(loader)
        counts.append(int(batch["num_items_in_batch"]))
        if k < micro_steps:  # step 0: the raw-loop recipe
            last = k == micro_steps - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(**batch).loss * world_size  # DDP averages gradients over the ranks
                loss.backward()
    grads = {name: p.grad.clone() for name, p in model.module.named_parameters()}
    group = dist.new_group(backend="gloo")
    times = []
    for _ in range(200):
        started = time.perf_counter()
        sum_over_ranks([0, 123], group)
        times.append(time.perf_counter() - started)
    torch.save({"counts": counts, "grads": grads, "collective_s": statistics.median(times)}, f"{out}.rank{rank}.pt")
    loader.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
