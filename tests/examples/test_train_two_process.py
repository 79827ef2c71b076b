"""The training example end to end: W=2 with a checkpoint, resumed on W=1 with another micro-batch.

A smaller version of ``examples/elastic_demo.py`` (which see for the tolerance argument).
Two ``torchrun`` launches of ``examples/train_gpt.py`` on gloo over loopback:

1. W=2, micro-batch 2 (accumulation 2), no workers: steps 0..N-1 uninterrupted, writing a
   DCP checkpoint (model, optimizer, loader) at step K on the way;
2. W=1, micro-batch 4 (accumulation 2): resumes from that checkpoint
   and trains steps K..N-1.

Every resumed step must see the reference's global batch bit for bit (fingerprint), and
its loss must agree within the demo's relative tolerance.

The same two launches with ``--loader baseline_online`` (documents sharded by
``DistributedSampler``, packed per rank, resume by skipping), shortened to the first resumed
step: there the W=1 run already trains another global batch than the W=2 run did.
(``tests/examples/test_baseline_data.py`` checks in process that a resume on the *same*
world size does see the same batches.)
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

torch_dist = pytest.importorskip("torch.distributed")
if not torch_dist.is_available() or not torch_dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from loader.samples import default_tokenizer_path  # noqa: E402
from examples.elastic_demo import LOSS_RTOL, read_log, torchrun  # noqa: E402
from tests.dataset_factory import synthetic_texts, write_dataset  # noqa: E402

STEPS = 6
STOP = 3
RUN_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train_two_process")
    write_dataset(str(root / "prose"), synthetic_texts(120, seed=1), num_lanes=4, seed=0, source_name="prose")
    write_dataset(str(root / "code"), synthetic_texts(60, seed=2), num_lanes=4, seed=0, source_name="code")
    config = root / "loader.toml"
    config.write_text(
        'datasets = [{path = "prose", weight = 0.7}, {path = "code", weight = 0.3}]\n'
        "seq_len = 32\nglobal_batch_size = 8\nmicro_batch_size = 2\nseed = 7\n"
        f'tokenizer = "{default_tokenizer_path()}"\n'
    )
    return config


@pytest.mark.distributed
def test_resume_w2_checkpoint_on_w1_sees_the_same_batches(demo_config: Path, tmp_path: Path) -> None:
    common = ["--config", str(demo_config), "--steps", str(STEPS), "--warmup", "2"]
    torchrun(2, [*common, "--micro-batch", "2", "--num-workers", "0", "--log-file", str(tmp_path / "ref.jsonl"),
                 "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", str(STOP)],
             tmp_path / "ref.txt", timeout=RUN_TIMEOUT_S)
    torchrun(1, [*common, "--micro-batch", "4", "--num-workers", "0", "--log-file", str(tmp_path / "resumed.jsonl"),
                 "--resume", str(tmp_path / "ckpt" / f"step_{STOP:06d}")],
             tmp_path / "resumed.txt", timeout=RUN_TIMEOUT_S)

    ref, resumed = read_log(tmp_path / "ref.jsonl"), read_log(tmp_path / "resumed.jsonl")
    assert sorted(ref) == list(range(STEPS))
    assert sorted(resumed) == list(range(STOP, STEPS))
    assert {r["world_size"] for r in resumed.values()} == {1}
    assert all(r["sequences"] == 8 for r in resumed.values())
    for step in range(STOP, STEPS):
        assert resumed[step]["fingerprint"] == ref[step]["fingerprint"], f"step {step}: different global batch"
        assert resumed[step]["tokens"] == ref[step]["tokens"]
        assert resumed[step]["loss"] == pytest.approx(ref[step]["loss"], rel=LOSS_RTOL), f"step {step}"


@pytest.mark.distributed
def test_baseline_online_resumed_on_w1_differs_at_the_first_resumed_step(demo_config: Path, tmp_path: Path) -> None:
    common = ["--config", str(demo_config), "--steps", str(STOP + 1), "--warmup", "2", "--loader", "baseline_online",
              "--num-workers", "0"]
    torchrun(2, [*common, "--micro-batch", "2", "--log-file", str(tmp_path / "ref.jsonl"),
                 "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", str(STOP)],
             tmp_path / "ref.txt", timeout=RUN_TIMEOUT_S)
    torchrun(1, [*common, "--micro-batch", "4", "--log-file", str(tmp_path / "resumed.jsonl"),
                 "--resume", str(tmp_path / "ckpt" / f"step_{STOP:06d}")],
             tmp_path / "resumed.txt", timeout=RUN_TIMEOUT_S)

    ref, resumed = read_log(tmp_path / "ref.jsonl"), read_log(tmp_path / "resumed.jsonl")
    assert sorted(ref) == list(range(STOP + 1)) and sorted(resumed) == [STOP]
    assert ref[STOP]["sequences"] == resumed[STOP]["sequences"] == 8
    assert resumed[STOP]["fingerprint"] != ref[STOP]["fingerprint"]
    assert collections.Counter(resumed[STOP]["sequence_keys"]) != collections.Counter(ref[STOP]["sequence_keys"])
