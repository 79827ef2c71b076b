"""One rank of a real ``balance = "attention"`` run (launched by ``tests.rank_launcher.launch_ranks``).

``python -m tests.loader.balance_worker CONFIG OUT STEPS`` with the torchrun environment: the
rank builds its ``ZephonLoader`` on a gloo group, consumes ``STEPS`` steps and records, per
micro-batch, :func:`batch_digest` (every field of the batch: ids, labels, positions, features,
``pixel_values`` and the image fields, online rejects, indices), and per sequence its
fingerprint bytes (``zephon fingerprints``' layout, images included). Rank 0 writes everything,
with each step's exchange seconds, to ``OUT`` as JSON.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np


def batch_digest(batch: dict) -> str:
    """SHA-256 over every field of a micro-batch: name, dtype, shape and bytes of each array;
    dicts (online rejects) as sorted JSON; ints as text."""
    digest = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        digest.update(name.encode() + b"\0")
        if hasattr(value, "numpy"):
            value = value.numpy()
        if isinstance(value, np.ndarray):
            digest.update(f"{value.dtype.str}{value.shape}".encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, dict):
            digest.update(json.dumps(value, sort_keys=True).encode())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def row_bytes(batch: dict) -> dict[str, str]:
    """Each sequence's fingerprint bytes (hex), by global index."""
    from loader.commands.fingerprints import image_bytes_by_row, sequence_bytes

    images = image_bytes_by_row(batch)
    return {str(index): (sequence_bytes(ids, labels) + images.get(row, b"")).hex()
            for row, (index, ids, labels) in enumerate(zip(batch["global_indices"].tolist(), batch["input_ids"].numpy(),
                                                           batch["labels"].numpy()))}


def main(argv: list[str]) -> int:
    config_path, out_path, steps = argv[0], argv[1], int(argv[2])
    import torch.distributed as dist

    from loader.config import LoaderConfig
    from loader.pipeline import ZephonLoader
    from tests.rank_launcher import write_gathered

    dist.init_process_group("gloo")
    loader = ZephonLoader(LoaderConfig.from_file(config_path))
    digests, rows, exchange = [], {}, []
    for _ in range(steps * loader.topology.micro_steps_per_step):
        batch = next(loader)
        digests.append(batch_digest(batch))
        rows.update(row_bytes(batch))
        if batch["micro_step"] == 0:
            exchange.append(loader.metrics().balance.get("exchange_s"))
    write_gathered(dist, out_path, {"digests": digests, "rows": rows, "exchange_s": exchange})
    loader.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
