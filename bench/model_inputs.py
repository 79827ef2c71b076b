"""Model inputs (issue 29): what ``model_inputs`` costs the loader, and the attention choice.

    python bench/model_inputs.py [--repeats 3] [--only CASE ...]

Cases (each a fresh process, harness of bench/loader_throughput.py; medians of ``--repeats``):

* ``loader_{unset,causal_lm}_{2048,8192}``: tokens/s and peak RSS of ``ZephonLoader`` on
  pre-tokenized lanes (best-fit packing, 8 sequences per step, micro-batch 2, num_workers 0),
  ``model_inputs`` unset vs ``"causal_lm"`` (the step look-ahead, the loss-token count, the
  layout). Every tensor of each micro-batch is touched, as a training loop does. On a shared
  machine tokens per CPU second is the steadier number.
* ``attn_{positions,mask4d}_{2048,8192}``: one forward and backward of a small Llama (hidden 64,
  2 layers, sdpa, float32, CPU, one row) on one micro-batch of the loader: ``positions`` is the
  ``causal_lm`` batch (transformers builds the packed mask from ``position_ids``, in the
  model's dtype); ``mask4d`` replaces it by a block-diagonal 4-D float mask built from the
  segments (what a loader would have to ship), timed and sized separately.
* ``mask_{sdpa,eager}_{2048,8192}``: what transformers' ``create_causal_mask`` builds from
  packed ``position_ids`` (documents of 700, 1300, 500 tokens, one row): size, time, peak RSS.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loader_throughput import REPO_ROOT, _consume, _peak_rss_mb, add_run_options, child_main, measure  # noqa: E402

WORK = REPO_ROOT / "bench" / "_work" / "model_inputs"
DOCS = 6000
SEQ_LENS = (2048, 8192)
TOKENS_PER_CASE = 3_000_000


def build_dataset() -> str:
    from tokenizers import Tokenizer

    from loader.samples import default_tokenizer_path
    from tests.dataset_factory import synthetic_texts, write_dataset

    path = WORK / "pre"
    if not (path / "manifest.json").exists():
        write_dataset(str(path), synthetic_texts(DOCS, seed=1), num_lanes=8, seed=2,
                      tokenizer=Tokenizer.from_file(default_tokenizer_path()), row_group_rows=64)
    return str(path)


def _config(dataset: str, seq_len: int, model_inputs):
    from loader.samples import default_tokenizer_path
    from loader.config import LoaderConfig

    return LoaderConfig(datasets=[{"path": dataset}], seq_len=seq_len, global_batch_size=8, micro_batch_size=2,
                        seed=3, tokenizer=default_tokenizer_path(), packing="best_fit", model_inputs=model_inputs)


def child_loader(dataset: str, seq_len: int, model_inputs) -> dict:
    import resource

    from loader.pipeline import ZephonLoader

    batches = max(8, TOKENS_PER_CASE // (2 * seq_len))
    with ZephonLoader(_config(dataset, seq_len, model_inputs)) as loader:
        next(loader)
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            _consume(next(loader))
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    return {"tokens": batches * 2 * seq_len, "seconds": seconds, "cpu_s": cpu_s,
            "peak_rss_mb": _peak_rss_mb(resource.RUSAGE_SELF)}


def block_mask(cu_seqlens, rows: int, seq_len: int):
    """``[rows, 1, seq_len, seq_len]`` float32: 0 where a token may attend (same segment, not
    after it), the dtype's minimum elsewhere: what eager attention adds and sdpa takes."""
    import torch

    segment = torch.zeros(rows * seq_len, dtype=torch.int64)
    segment[cu_seqlens[1:-1].long()] = 1
    segment = segment.cumsum(0).view(rows, seq_len)
    allowed = (segment[:, :, None] == segment[:, None, :]) & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]


def child_attention(dataset: str, seq_len: int, variant: str) -> dict:
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from loader.pipeline import ZephonLoader

    torch.set_num_threads(1)
    with ZephonLoader(_config(dataset, seq_len, "causal_lm").replace(micro_batch_size=1)) as loader:
        batch = next(loader)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                                         attn_implementation="sdpa"))
    mask_s = 0.0
    if variant == "mask4d":
        started = time.perf_counter()
        mask = block_mask(batch["cu_seq_lens_q"], 1, seq_len)
        mask_s = time.perf_counter() - started
        inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"], "position_ids": batch["position_ids"],
                  "attention_mask": mask, "num_items_in_batch": batch["num_items_in_batch"]}
    else:
        inputs, mask = batch, None
    base_rss = _peak_rss_mb(resource.RUSAGE_SELF)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        model(**inputs).loss.backward()
        times.append(time.perf_counter() - started)
    return {"tokens": seq_len, "seconds": statistics.median(times), "mask_build_s": mask_s,
            "mask_mb": 0.0 if mask is None else mask.numel() * mask.element_size() / 2**20,
            "peak_rss_mb": _peak_rss_mb(resource.RUSAGE_SELF), "rss_before_forward_mb": base_rss}


def child_mask(seq_len: int, attn: str) -> dict:
    import resource

    import torch
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, attn_implementation=attn)
    positions = torch.cat([torch.arange(n) for n in (700, 1300, 500) * (seq_len // 2500 + 1)])[:seq_len][None]
    embeds = torch.zeros(1, seq_len, 64)
    before = _peak_rss_mb(resource.RUSAGE_SELF)
    started = time.perf_counter()
    mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                              position_ids=positions)
    seconds = time.perf_counter() - started
    return {"tokens": seq_len, "seconds": seconds, "mask_mb": mask.numel() * mask.element_size() / 2**20,
            "dtype": str(mask.dtype), "peak_rss_mb": _peak_rss_mb(resource.RUSAGE_SELF),
            "rss_added_mb": _peak_rss_mb(resource.RUSAGE_SELF) - before}


CHILDREN = {"loader": child_loader, "attention": child_attention, "mask": child_mask}


def plan(dataset: str) -> dict[str, dict]:
    cases = {}
    for seq_len in SEQ_LENS:
        for name, value in (("unset", None), ("causal_lm", "causal_lm")):
            cases[f"loader_{name}_{seq_len}"] = {"kind": "loader", "dataset": dataset, "seq_len": seq_len,
                                                 "model_inputs": value}
        for variant in ("positions", "mask4d"):
            cases[f"attn_{variant}_{seq_len}"] = {"kind": "attention", "dataset": dataset, "seq_len": seq_len,
                                                  "variant": variant}
        for attn in ("sdpa", "eager"):
            cases[f"mask_{attn}_{seq_len}"] = {"kind": "mask", "seq_len": seq_len, "attn": attn}
    return cases


def report(results: dict[str, list[dict]]) -> list[str]:
    lines = ["| case | tokens/s (median) | tokens / CPU s | peak RSS MiB | extra |", "|---|---:|---:|---:|---|"]
    for name, runs in results.items():
        if not runs:
            continue
        rate = statistics.median(r["tokens"] / r["seconds"] for r in runs)
        rss = statistics.median(r["peak_rss_mb"] for r in runs)
        extra = ""
        if "rss_added_mb" in runs[0]:
            extra = (f"{runs[0]['dtype']} mask {runs[0]['mask_mb']:.0f} MiB in "
                     f"{statistics.median(r['seconds'] for r in runs):.3f} s; peak RSS added "
                     f"{statistics.median(r['rss_added_mb'] for r in runs):.0f} MiB")
        elif "mask_mb" in runs[0]:
            extra = (f"fwd+bwd {statistics.median(r['seconds'] for r in runs):.3f} s; mask "
                     f"{runs[0]['mask_mb']:.0f} MiB built in {statistics.median(r['mask_build_s'] for r in runs):.3f} s; "
                     f"RSS before forward {statistics.median(r['rss_before_forward_mb'] for r in runs):.0f} MiB")
        per_cpu = (f"{statistics.median(r['tokens'] / r['cpu_s'] for r in runs):,.0f}" if "cpu_s" in runs[0] else "")
        lines.append(f"| {name} | {rate:,.0f} | {per_cpu} | {rss:.0f} | {extra} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(CHILDREN, args.child)
    cases = plan(build_dataset())
    if args.only:
        cases = {n: c for n, c in cases.items() if any(n.startswith(p) for p in args.only)}
    results = measure(cases, args.repeats or 3, script=str(Path(__file__).resolve()))
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
