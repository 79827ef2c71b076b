"""The landed-code checkpoint fixture: how ``landed_checkpoint.json`` was made, and remade.

``landed_checkpoint.json`` holds checkpoints written by the code that was released before
the per-token-features refactor (commit 576b270, ``loader/`` still flat), together with that
code's batch fingerprints of the steps after each checkpoint. ``test_landed_checkpoint.py``
builds the same datasets with today's code, loads each old checkpoint on another world size
and checks that the stream continues with exactly the old fingerprints: a checkpoint saved
by a user before the refactor resumes their run unchanged.

It was made with (the old tree on ``PYTHONPATH``, the same interpreter and libraries)::

    git worktree add /tmp/landed 576b270
    PYTHONPATH=/tmp/landed python tests/golden/landed_checkpoint.py /tmp/out.json

This module runs against either layout of the package (flat ``loader.*`` modules then,
sub-packages now), so the same builder makes the datasets in both trees.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import loader
from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig

# Not try/except ImportError: an editable install can resolve a sub-package missing from the
# tree on PYTHONPATH to the installed checkout's, mixing two versions of the code.
if os.path.isdir(os.path.join(os.path.dirname(loader.__file__), "commands")):  # today's layout
    from loader.commands.fingerprints import collect_fingerprints
    from loader.stages.tokenizer import load_tokenizer
else:  # the landed code: flat modules
    from loader.fingerprints import collect_fingerprints
    from loader.tokenizer import load_tokenizer
from tests.dataset_factory import synthetic_texts, write_dataset

NUM_LANES = 4
SAVE_STEP = 5
END_STEP = 12  # past every lane's first epoch edge for both configs
SAVE_WORLD_SIZE = 2

# name -> (sources as (dataset, weight), config fields)
CONFIGS = {
    "concat": ((("web", 1.0),), {"packing": "concat"}),
    "best_fit_mix": ((("web", 3.0), ("code", 1.0)), {"packing": "best_fit", "best_fit_open_bins": 4}),
}


def build_datasets(root: str) -> dict[str, str]:
    """Two small pre-tokenized datasets, the same bytes in every tree (the suite's factory)."""
    tokenizer = load_tokenizer(default_tokenizer_path())
    paths = {}
    for name, seed in (("web", 7), ("code", 8)):
        paths[name] = os.path.join(root, name)
        write_dataset(paths[name], synthetic_texts(90, seed=seed), num_lanes=NUM_LANES, seed=seed,
                      source_name=name, tokenizer=tokenizer, row_group_rows=8)
    return paths


def config_of(name: str, paths: dict[str, str]) -> LoaderConfig:
    sources, fields = CONFIGS[name]
    return LoaderConfig(
        datasets=tuple({"path": paths[d], "name": d, "weight": w} for d, w in sources),
        seq_len=48, global_batch_size=8, micro_batch_size=2, seed=11,
        tokenizer=default_tokenizer_path(), num_workers=0, **fields)


def make_fixture(root: str) -> dict:
    paths = build_datasets(root)
    fixture = {}
    for name in CONFIGS:
        config = config_of(name, paths)
        lines, _ = collect_fingerprints(config, world_size=1, end_step=END_STEP)
        _, state = collect_fingerprints(config, world_size=SAVE_WORLD_SIZE, end_step=SAVE_STEP + 1,
                                        save_state_step=SAVE_STEP)
        fixture[name] = {"state": state, "fingerprints": [[f.step, f.sha256, f.source_counts] for f in lines]}
    return fixture


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as root:
        fixture = make_fixture(root)
    # Dataset paths inside the states are the temp dir's: the test points them at its own copy.
    with open(sys.argv[1], "w") as out:
        json.dump({"commit": os.environ.get("LANDED_COMMIT", "576b270"), "save_step": SAVE_STEP,
                   "configs": fixture}, out, indent=1, sort_keys=True)
