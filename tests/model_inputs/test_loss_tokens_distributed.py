"""Two real gloo ranks: ``num_items_in_batch`` from the per-step all_reduce equals the count of
ranks simulated in one process, and the raw DDP loop of docs/guides/model-inputs.md (loss times
the world size, ``no_sync`` while accumulating) gives the gradient of the global mean token loss."""

from __future__ import annotations

import json
import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tokenizers import Tokenizer  # noqa: E402

from loader.samples import default_tokenizer_path  # noqa: E402
from loader.config import LoaderConfig  # noqa: E402
from loader.pipeline import ZephonLoader  # noqa: E402
from tests.dataset_factory import synthetic_texts, write_dataset  # noqa: E402
from tests.model_inputs.models import tiny_llama  # noqa: E402
from tests.rank_launcher import launch_ranks  # noqa: E402

STEPS = 3
WORLD = 2


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_gloo_ranks_count_and_train_like_the_global_batch(tmp_path):
    path = tmp_path / "pre"
    texts = synthetic_texts(120, seed=9, max_words=2)  # documents shorter than seq_len: packed
    write_dataset(str(path), texts, num_lanes=8, seed=4, tokenizer=Tokenizer.from_file(default_tokenizer_path()))
    config = LoaderConfig(datasets=[{"path": str(path)}], seq_len=64, global_batch_size=8, micro_batch_size=2,
                          seed=3, tokenizer=default_tokenizer_path(), model_inputs="causal_lm", packing="best_fit")
    config_path = tmp_path / "loader.json"
    config_path.write_text(json.dumps(config.to_dict()))
    out = tmp_path / "out"
    launch_ranks(WORLD, "tests.model_inputs.loss_tokens_rank", [str(config_path), str(out), str(STEPS)],
                 timeout_s=200, preload=["torch.distributed", "transformers", "loader.pipeline"])
    results = [torch.load(f"{out}.rank{r}.pt") for r in range(WORLD)]
    simulated = []
    for rank in range(WORLD):
        with ZephonLoader(config, rank=rank, world_size=WORLD) as loader:
            simulated.append([next(loader) for _ in range(STEPS * loader.topology.micro_steps_per_step)])
    for rank in range(WORLD):
        assert results[rank]["counts"] == [int(b["num_items_in_batch"]) for b in simulated[rank]]
    assert len(set(results[0]["counts"])) > 1
    logging.getLogger(__name__).info("per-step all_reduce of 2 int64 (gloo, 2 ranks): median %.1f us",
                                     1e6 * max(r["collective_s"] for r in results))
    # the reference: one process, the global batch of step 0, one mean over its loss tokens
    model = tiny_llama("sdpa")
    micro_steps = len(simulated[0]) // STEPS
    rows = [b for r in range(WORLD) for b in simulated[r][:micro_steps]]
    packed = {k: torch.cat([b[k] for b in rows]) for k in ("input_ids", "labels", "position_ids")}
    logits = model(**packed, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             packed["labels"][:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    for name, p in model.named_parameters():
        for rank in range(WORLD):
            torch.testing.assert_close(results[rank]["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
