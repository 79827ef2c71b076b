"""What checking a checkpoint on load costs (issue 14): 64 lanes, concat and best-fit.

    python bench/state_validation_cost.py [--repeats 15]

Data: ``tests.dataset_factory.synthetic_texts(4000, seed=3, max_words=200)`` pre-tokenized
into 64 lanes (cached under ``bench/_work/state_validation/``). Each packing runs 20 steps
(seq_len 1024, B = 64, best_fit_open_bins 8), saves the merged state, and then, ``--repeats``
times (medians printed):

* ``load_state_dict`` and ``load_state_dict`` + the first micro-batch (the restore);
* the checks alone, as ``load_state_dict`` runs them (``loader.checkpoint.schema``: shape,
  stream settings, ranges, and the bins handed over as arrays);
* for best fit, the conversion of the bins' token lists to arrays that ``set_state`` did
  before the checks existed (the checks do it now, once): the checks' net cost is the
  difference;
* ``json.loads`` of the state's text, for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from loader.samples import default_tokenizer_path  # noqa: E402
from loader.checkpoint import schema as checkpoint_schema, state as state_mod  # noqa: E402
from loader.config import LoaderConfig  # noqa: E402
from loader.pipeline import ZephonLoader  # noqa: E402
from tests.dataset_factory import synthetic_texts, write_dataset  # noqa: E402


def median_ms(run, repeats: int) -> str:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return f"{statistics.median(times) * 1e3:.2f} ms"


def dataset() -> str:
    from tokenizers import Tokenizer

    path = os.path.join(ROOT, "bench", "_work", "state_validation", "web64")
    if not os.path.exists(os.path.join(path, "manifest.json")):
        write_dataset(path, synthetic_texts(4000, seed=3, max_words=200), num_lanes=64, seed=1, source_name="web",
                      tokenizer=Tokenizer.from_file(default_tokenizer_path()), files_per_lane=2, row_group_rows=16)
    return path


def checks(loader: ZephonLoader, state: dict) -> None:
    """What ``ZephonLoader._checked_lane_states`` runs, without loading."""
    header = checkpoint_schema.parse_header(state)
    state_mod.compare_with(state, loader._expected_header())
    parsed = checkpoint_schema.parse_lanes(state["lanes"], header)
    problems = checkpoint_schema.Problems()
    checkpoint_schema.check_lanes(header, parsed, loader._state_limits(), header.next_global_index, problems)
    problems.raise_if_any()
    for lane_id, lane in parsed.items():
        checkpoint_schema.stage_state(state["lanes"][state_mod.lane_key(lane_id)], lane)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    path = dataset()
    for packing in ("concat", "best_fit"):
        config = LoaderConfig(datasets=[{"path": path}], seq_len=1024, global_batch_size=64, micro_batch_size=64,
                              seed=5, tokenizer=default_tokenizer_path(), packing=packing, best_fit_open_bins=8,
                              num_workers=0)
        with ZephonLoader(config) as loader:
            for _ in range(20):
                next(loader)
            text = state_mod.dumps(state_mod.merge_rank_states([loader.state_dict()]))
        state = json.loads(text)
        bins = [b for lane in state["lanes"].values() for b in lane["sources"]["web"]["packer"].get("bins", [])]
        with ZephonLoader(config) as loader:
            load = median_ms(lambda: loader.load_state_dict(state), args.repeats)
            restore = median_ms(lambda: (loader.load_state_dict(state), next(loader)), args.repeats)
            checked = median_ms(lambda: checks(loader, state), args.repeats)
        print(f"{packing}: state {len(text) / 1024:.0f} KiB, {len(bins)} open bins, "
              f"{sum(len(b['tokens']) for b in bins)} token ids in them")
        print(f"  load_state_dict {load}; + first micro-batch {restore}; the checks alone {checked}")
        if bins:
            before = median_ms(lambda: [np.asarray(b["tokens"], dtype=np.int32) for b in bins], args.repeats)
            print(f"  the bins' conversion set_state did before the checks: {before}")
        print(f"  json.loads of the state: {median_ms(lambda: json.loads(text), args.repeats)}")


if __name__ == "__main__":
    main()
