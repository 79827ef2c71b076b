"""``output="numpy"`` (JAX and other non-torch trainers) runs in a process that never imports torch.

The loader is built and iterated in a fresh interpreter (this one has torch loaded already);
the child reports whether ``torch`` reached ``sys.modules`` and a digest of its batches, which
must be this process's batches of the same config: the torch-free path is the same stream.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from loader.config import LoaderConfig
from loader.pipeline import ZephonLoader

STEPS = 4  # micro-batches: two whole steps (model_inputs takes states at step boundaries)

CHILD = """
import hashlib, json, sys
import numpy as np
from loader.config import LoaderConfig
from loader.pipeline import ZephonLoader

fields = json.loads(sys.argv[1])
digest = hashlib.sha256()
with ZephonLoader(LoaderConfig(**fields), rank=0, world_size=1, output="numpy") as loader:
    loader.wait_for_workers(timeout_s=60)
    for _, batch in zip(range(int(sys.argv[2])), loader):
        for name in sorted(batch):
            digest.update(name.encode() + np.asarray(batch[name]).tobytes())
    state = json.dumps(loader.state_dict(), sort_keys=True)
print(json.dumps({"torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
                  "batches": digest.hexdigest(), "state": hashlib.sha256(state.encode()).hexdigest()}))
"""


def _digests(config: LoaderConfig, steps: int) -> tuple[str, str]:
    digest = hashlib.sha256()
    with ZephonLoader(config, rank=0, world_size=1, output="numpy") as loader:
        for _, batch in zip(range(steps), loader):
            assert isinstance(batch["input_ids"], np.ndarray) and isinstance(batch["labels"], np.ndarray)
            for name in sorted(batch):
                digest.update(name.encode() + np.asarray(batch[name]).tobytes())
        state = json.dumps(loader.state_dict(), sort_keys=True)
    return digest.hexdigest(), hashlib.sha256(state.encode()).hexdigest()


@pytest.mark.parametrize("case", ["endless_concat", "finite_best_fit_model_inputs", "two_workers"])
def test_a_numpy_loader_never_imports_torch(corpus, tokenizer_path, case) -> None:
    fields = dict(datasets=[{"path": corpus.text_path}], seq_len=64, global_batch_size=16, micro_batch_size=8,
                  seed=5, tokenizer=tokenizer_path, packing="concat", num_workers=0, worker_timeout_s=60.0)
    if case == "finite_best_fit_model_inputs":  # steps produced ahead, the loss tokens counted per step
        fields.update(datasets=[{"path": corpus.text_path, "exhaustion": "stop"}], packing="best_fit",
                      model_inputs="causal_lm")
    elif case == "two_workers":
        fields.update(num_workers=2)
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(fields), str(STEPS)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["torch"] == [], f"output=\"numpy\" imported {report['torch'][:5]}"
    batches, state = _digests(LoaderConfig(**{**fields, "num_workers": 0}), STEPS)
    assert (report["batches"], report["state"]) == (batches, state)
