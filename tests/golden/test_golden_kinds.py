"""Golden pins of every lane kind: literal values of what users of chat, image and transformed
data persist or compare between runs.

``test_golden_pins.py`` pins text and pre-tokenized lanes; this file widens the pins to the
other kinds before the refactor that turns them into plug-ins (issue 33), so that moving their
code cannot change a lane file, a batch or a checkpoint unnoticed. The inputs are in
:mod:`tests.golden.kinds_data` (built by the suite's factories and the Beam job, in memory).
The values below were computed once from the code of commit ba86f0e, by calling this file's
value functions (``fingerprint_run``, ``pinned_lines``, ``checkpoint_values``,
``field_digests``, ``dataset_content``, ``dataset_bytes``) in a clean worktree, and pasted here
as literals; each test recomputes its value from the code under test and compares:

* batch fingerprints (the ``zephon fingerprints`` lines) of steps 0..3 and of step
  ``LATER_STEP``, past every lane's epoch edge (checked), and the JSON bytes of the merged
  checkpoint saved before ``LATER_STEP``, for: chat sharded with ``--tokenizer`` (offline) and
  without (online, rendered and tokenized by the loader), each packed by ``concat`` and
  ``best_fit``; image captions; image chat mixed with text; text transforms and token
  transforms run by the loader; a dataset sharded with ``--transform`` (tombstone rows); token
  mixing of online chat and text;
* a digest of every batch field (loss_mask, token_source_ids, image_grid_thw,
  image_token_offsets, pixel_values, chat_rejects, ...) of the chat, image and mix configs;
* the same fields and fingerprints from a run with ``num_workers=2`` (online chat, image
  chat): they must be the in-process values, so both are pinned by the same literal;
* the lane files of the Beam job's chat shards (offline and online), image shard, image-chat
  shard and tombstoned shard: schema, layout, every cell read back, file SHA-256s, the
  manifest bytes and the dataset fingerprint.

**A pin never changes silently**: an intended change is a format change (bump
``loader.io.manifest.FORMAT_VERSION`` or ``loader.checkpoint.state.STATE_VERSION``, add a
migration, re-pin in the same commit and say so). A pin that moves in any other commit is a bug
of that commit.

Values that depend on library versions, not only on Zephon's code, first check the versions
they were made with (:data:`PINNED_LIBRARIES`) and fail with a message if they differ: Parquet
bytes carry the pyarrow version, tokenizer fingerprints hash ``tokenizers``' serialisation, and
the test images are drawn and encoded by Pillow (so image bytes, their SHA-256s, the image
datasets' fingerprints and every ``pixel_values``, hence the fingerprints of image configs,
follow the Pillow version). Beside each of them sits a pin that no library version can move
(lane content without image bytes, checkpoint bytes with fingerprints masked, every batch field
but ``pixel_values``), so an upgrade that trips the first kind shows at once whether anything
else moved.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
import PIL
import pyarrow
import pyarrow.parquet as pq
import pytest
import tokenizers

from loader.checkpoint.state import dumps
from loader.commands.fingerprints import collect_fingerprints
from loader.config import LoaderConfig
from loader.io.manifest import MANIFEST_NAME, read_manifest
from loader.pipeline import ZephonLoader
from tests.golden.kinds_data import CONFIGS, IMAGE_CONFIGS, build_all, kinds_config
from tests.golden.test_golden_pins import dataset_bytes, lane_epochs, manifest_without_longest, masked_state_bytes

FIRST_STEPS = 4  # steps 0..3 are pinned one by one
LATER_STEP = 24  # and this one, past every lane's first epoch edge in every config (checked)
PINNED_LIBRARIES = {"pyarrow": "25.0.1", "tokenizers": "0.23.3", "Pillow": "12.3.0"}
# Every pin reads datasets the Beam job wrote (in memory, ~10 s for all of them).
pytestmark = pytest.mark.beam
# Which libraries go into the bytes of each config's / dataset's library-bound pins.
IMAGE_LIBRARIES = ("pyarrow", "tokenizers", "Pillow")
TEXT_LIBRARIES = ("pyarrow", "tokenizers")
# Fields whose values follow the Pillow version (the test images are drawn by Pillow).
PILLOW_FIELDS = ("pixel_values",)
# Lane-file columns whose cells follow the Pillow version (the encoded test images).
PILLOW_COLUMNS = ("image_bytes", "image_sha256")


def require_pinned_libraries(*names: str) -> None:
    """Fail (never skip) when a library that goes into the bytes of a pin has another version."""
    versions = {"pyarrow": pyarrow.__version__, "tokenizers": tokenizers.__version__, "Pillow": PIL.__version__}
    differing = {n: versions[n] for n in names if versions[n] != PINNED_LIBRARIES[n]}
    assert not differing, (
        f"these pins were made with {PINNED_LIBRARIES}, this run has {differing}: Parquet bytes (created_by), "
        "the tokenizer fingerprint and the Pillow-drawn test images depend on them. If the upgrade is intended, "
        "re-pin these values and PINNED_LIBRARIES in the commit that upgrades, and check that every "
        "library-independent pin of this file still passes."
    )


def libraries_of(name: str) -> tuple[str, ...]:
    """The libraries in the bytes of config or dataset ``name`` (the image ones start with "image")."""
    return IMAGE_LIBRARIES if name.startswith("image") else TEXT_LIBRARIES


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return build_all(tmp_path_factory.mktemp("golden_kinds"))


# ---------------------------------------------------------------------------------------
# Batch fingerprints and checkpoints.


def fingerprint_run(config: LoaderConfig) -> tuple[list[str], dict]:
    """The fingerprint lines of steps 0..LATER_STEP and the merged state before step LATER_STEP."""
    results, state = collect_fingerprints(config, world_size=1, end_step=LATER_STEP + 1,
                                          save_state_step=LATER_STEP)
    return [r.line() for r in results], state


def pinned_lines(lines: list[str]) -> dict[str, Any]:
    return {"first": lines[:FIRST_STEPS], "later": lines[LATER_STEP]}


def transform_counts(state: dict) -> list[list[int]]:
    """Per transform position, ``[dropped, changed]`` summed over every lane's read cursors."""
    totals: list[list[int]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if {"epoch", "block"} <= set(node) and "transforms" in node:
                for k, (dropped, changed) in enumerate(node["transforms"]):
                    if k == len(totals):
                        totals.append([0, 0])
                    totals[k][0] += dropped
                    totals[k][1] += changed
            for key in sorted(node):
                walk(node[key])
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(state["lanes"])
    return totals


def checkpoint_values(state: dict) -> dict[str, Any]:
    return {
        "bytes_sha256": hashlib.sha256(dumps(state).encode()).hexdigest(),
        "masked_sha256": hashlib.sha256(masked_state_bytes(state)).hexdigest(),
        "next_global_index": state["next_global_index"],
        "config_fingerprint": state["config_fingerprint"],
        "lane_epochs": lane_epochs(state),
        "transform_counts": transform_counts(state),
    }


class Runs(dict):
    """config name -> :func:`fingerprint_run`, computed on first use."""

    def __init__(self, paths: dict[str, str]) -> None:
        super().__init__()
        self.paths = paths

    def __missing__(self, name: str) -> tuple[list[str], dict]:
        self[name] = fingerprint_run(kinds_config(self.paths, name))
        return self[name]


@pytest.fixture(scope="module")
def runs(paths) -> Runs:
    return Runs(paths)


# Guards the global batches (the `zephon fingerprints` lines: "STEP SHA256 [name=count ...]
# [supervised: name=count ...]") of steps 0..3 and LATER_STEP, which every lane of every source
# reaches in a later epoch: chat rendering, masks and labels, image placeholders, grids and
# pixels, transforms and tombstones, mixing. Image configs' lines hash pixel_values (Pillow).
PINNED_FINGERPRINTS = {
    "chat_offline_best_fit": {
        "first": [
            "0 98fcd0fe15ffbb5f4f5bc602cd6343cded4f737362a361b09001ee8d938d90f1 supervised: chat=788",
            "1 8098831905008091aeab319944f539919df20e79648171677bfca7ae37845d7d supervised: chat=437",
            "2 77c87303ed64c4fcbd73f3456e6f3fa423b2467fbe2ed101f0f4f5d98fa8417e supervised: chat=1225",
            "3 0dd77d783454504fb1a4594b2c1471e23c2603347f19cca7dd6a5fe3509bc9a7 supervised: chat=848",
        ],
        "later": "24 d82ae1310a3c70a673a0afa451d64339cf5e99b48502eda8b39d67858fb784c7 supervised: chat=779",
    },
    "chat_offline_concat": {
        "first": [
            "0 3a1a84f5f4a8ab2452f8313f308a513d08af71e8a61e9cbd05c764d37579f9c7 supervised: chat=935",
            "1 6980cd08d267fb08487e29203111d2dfff8dd66d6fb8bdf0064a15ec1959c136 supervised: chat=533",
            "2 38029e8e690945ebc3be80755cd560d09b1c0ea5078f305e1e4580735b2902f9 supervised: chat=1270",
            "3 07b2e71dd047fcea03d0996d1a6bf00656375854f9c9e327b18ec1311ce768c4 supervised: chat=696",
        ],
        "later": "24 6797f541843c09dacbea792321ec8ab3838389f728775822c4c2f7c7e5dfe744 supervised: chat=1145",
    },
    "chat_online_best_fit": {
        "first": [
            "0 98fcd0fe15ffbb5f4f5bc602cd6343cded4f737362a361b09001ee8d938d90f1 supervised: chat=788",
            "1 8098831905008091aeab319944f539919df20e79648171677bfca7ae37845d7d supervised: chat=437",
            "2 77c87303ed64c4fcbd73f3456e6f3fa423b2467fbe2ed101f0f4f5d98fa8417e supervised: chat=1225",
            "3 2bc4e00ef5d4027bde1a875bcac76f555c602d800cd37d90fbfb5003558f66fd supervised: chat=767",
        ],
        "later": "24 f119e0af4e8514577783764019f4d050620b0dd0aee1bf190e6484a04b48dffd supervised: chat=621",
    },
    "chat_online_concat": {
        "first": [
            "0 3a1a84f5f4a8ab2452f8313f308a513d08af71e8a61e9cbd05c764d37579f9c7 supervised: chat=935",
            "1 6980cd08d267fb08487e29203111d2dfff8dd66d6fb8bdf0064a15ec1959c136 supervised: chat=533",
            "2 38029e8e690945ebc3be80755cd560d09b1c0ea5078f305e1e4580735b2902f9 supervised: chat=1270",
            "3 07b2e71dd047fcea03d0996d1a6bf00656375854f9c9e327b18ec1311ce768c4 supervised: chat=696",
        ],
        "later": "24 935aa7dcf313fbfd81ac4885fc001283b07fcd67fa20bae6b08b823d6ab78c4d supervised: chat=1629",
    },
    "image": {
        "first": [
            "0 017592a42b9983cbbebc00bdf8d884d7b0f27425c1fc33da21339b8960dd88db supervised: image=678",
            "1 e1b2f7e6193977b05758f5f10faa2a7ce9b565563a8cd3215d4977afdfd8b20f supervised: image=673",
            "2 6e327ce55d2f568edf07c5f8dfdcf0448e5b876116cc8ef8b3fad30c2492ac13 supervised: image=700",
            "3 a296e686c8dbe34a0711b826841f5152a32c278cee5a9057e01b83623b631072 supervised: image=680",
        ],
        "later": "24 ec37309fa56a0b677e1c8b8341f71c59aad3341b7f0bc0650218a341b1ac6705 supervised: image=670",
    },
    "image_chat": {
        "first": [
            "0 900b9a11171ffd35d606428a14fb37442e2f5c01c50f0ff57b4c2cc9c46ac23a image_chat=5 text=3 supervised: image_chat=65 text=367",
            "1 d08ec1792d8523e4b7560cf53b0f1004c70eebc154d8e6f6e0637e50cec60197 image_chat=5 text=3 supervised: image_chat=65 text=372",
            "2 0d8a988bc3e6649c19eec65404f4973fcd1fa40989b8a2e151034164822a4de6 image_chat=4 text=4 supervised: image_chat=52 text=485",
            "3 db89b3bed112f4a541b3e1657c6f75b4505dc047b83454cc10d30ab648fea5b6 image_chat=5 text=3 supervised: image_chat=65 text=362",
        ],
        "later": "24 03f5f213609f5c6c25361c97eed1bb4a4dfb8ebb2d1e9cbbb18a2f019a4ce4ed image_chat=5 text=3 supervised: image_chat=65 text=355",
    },
    "mix_token_chat": {
        "first": [
            "0 e5f65f4e20d77cf29ed29cd7879d360407ece0bea9f8383de2623bf42a012230 chat=4 text=4 supervised: chat=641 text=1927",
            "1 3d3106e9cc69c8cf7a9775c611bf872d41e69efa185f39d9ba67837c8b0e3d3d chat=6 text=2 supervised: chat=349 text=1800",
            "2 af01ef2474fe16c2ce63de6b114cdb82a6aded061c29b9b3040ece90f1994dc9 chat=4 text=4 supervised: chat=206 text=1889",
            "3 2174b48cf1dac3484f361170358e9e99c07d0e40d9735202411b1e6caea0790e chat=2 text=6 supervised: chat=279 text=2362",
        ],
        "later": "24 c56d6c8c2f3d9aa0b4ae5823af1264ad4b92af192fb4abf260f7b2779cca7506 chat=4 text=4 supervised: chat=815 text=2073",
    },
    "tombstoned": {
        "first": [
            "0 2908eb5a29d66508c67606e40d83b2ebae3dbbb55f62b94a921f056c7eb49ae8",
            "1 42568dd19aea9b9630a05ef090807fb65578b0e833aa4ace47d0a9d7030fc865",
            "2 51c6f0bcf0d29f05c359e6433f4c7958d8e5c07bc3da59d43225995401d5d6c2",
            "3 e6062ad141d6fb88036198d5f623ad2f26cce74040c1b17c77ab268deef644ab",
        ],
        "later": "24 8d61e5399bf0dee075e610bc6a6b47aad5044c5eff0ba9e3a7d1c173ba690d51",
    },
    "transforms_text": {
        "first": [
            "0 3313b9520362b436e3f9321575fd9b211e44db54184bd75b5ff00eee692b62b3",
            "1 560c9b873385991e5e5869d9e03610bf03c61711f61815e3f5e5870aa75d39c5",
            "2 88b3e8c412403e08b0e9eee476c3bf3b53d5a1e7517b058225697a615e62b8ee",
            "3 c68a88146b7752a8cc380acfd0f650414ebc1b514d0468102adb1418bd70b782",
        ],
        "later": "24 005bf587acc872a5d11ad30f90062177ccd207520f4e60feeec1ee347d946274",
    },
    "transforms_tokens": {
        "first": [
            "0 c581ed4888609c9f2f2e946933418ee8ea8fd6faa6fd8700db1459a8aba82ffb",
            "1 dac29aa49d37eb0572f577b8fd60ed6dd843d84b9f498da381c6562da27abb85",
            "2 0fcf3a60d808c6d4a98ac8d5a63e2c0e1bd0cfee4ce8a722c0b2142703110073",
            "3 461d16ea121086ccf65f10d31aa9d1452c74721a36d0b7b14185f19f69123dbc",
        ],
        "later": "24 18860a6426871ef5eefd736c67287d43feff1366420fa902ade58de4141f2c47",
    },
}

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batch_fingerprints_keep_their_values(runs, name) -> None:
    lines, state = runs[name]
    if name in IMAGE_CONFIGS:
        require_pinned_libraries("Pillow")
    assert pinned_lines(lines) == PINNED_FINGERPRINTS[name]
    assert len(set(line.split()[1] for line in lines)) == len(lines)  # the steps really differ
    epochs = lane_epochs(state)
    assert all(min(e) >= 1 for e in epochs.values()), f"LATER_STEP is not past every lane's epoch edge: {epochs}"


# Guards the checkpoint a user saves before LATER_STEP (merge_rank_states, then
# loader.checkpoint.state.dumps): masked_sha256 covers every byte but the library-bound
# fingerprints (tokenizer_fingerprint, each source's dataset_fingerprint), bytes_sha256 every
# byte (library versions checked).
PINNED_CHECKPOINTS = {
    "chat_offline_best_fit": {
        "bytes_sha256": "5f4b67658507d2767b6f7800a5371ce200c5abe40b2e0180c900e2772606667d",
        "masked_sha256": "91101c517714a9b4a80c4e2445583e1232b6a760cf5134903b58b76f11389300",
        "next_global_index": 192,
        "config_fingerprint": "83ad5e88000a89c1bc7c44f2dc2fd6bcbfdc89fab52a10ab480cdd1dcfb98bf1",
        "lane_epochs": {"00000": [15], "00001": [6], "00002": [3], "00003": [4]},
        "transform_counts": [],
    },
    "chat_offline_concat": {
        "bytes_sha256": "e8e0323ca7c4a78cc1a7737af566288cbf7c2117eb1350c63b7f0ae1b5e7248f",
        "masked_sha256": "107b38d32b1ebc18cf9a8f13ab2fdce3d1e49c30fd2d5a300f5a52ced8e99069",
        "next_global_index": 192,
        "config_fingerprint": "752a45875c637d93ca2a4e0f1432fee290f197e2110c09bfba2ae57b9e485192",
        "lane_epochs": {"00000": [14], "00001": [6], "00002": [2], "00003": [4]},
        "transform_counts": [],
    },
    "chat_online_best_fit": {
        "bytes_sha256": "505dd84ee923fadb16d4e1c8fa150e62006f5b97bbd27488602b4c03b5151fe7",
        "masked_sha256": "74e35212218a37816ead5cc72c0a16800335423c2e842dadc37c859819d22401",
        "next_global_index": 192,
        "config_fingerprint": "83ad5e88000a89c1bc7c44f2dc2fd6bcbfdc89fab52a10ab480cdd1dcfb98bf1",
        "lane_epochs": {"00000": [15], "00001": [6], "00002": [3], "00003": [4]},
        "transform_counts": [],
    },
    "chat_online_concat": {
        "bytes_sha256": "9e209c11c1fd1deb70db3acdfa2399fe14f834d88a5dd0914cfabec2c0dc65ca",
        "masked_sha256": "ba60d754655b8f620d5f144e440167ae5c70ee0f8902ef1fb4c388f88315f02f",
        "next_global_index": 192,
        "config_fingerprint": "752a45875c637d93ca2a4e0f1432fee290f197e2110c09bfba2ae57b9e485192",
        "lane_epochs": {"00000": [14], "00001": [6], "00002": [2], "00003": [4]},
        "transform_counts": [],
    },
    "image": {
        "bytes_sha256": "fc91bee948d968fda96f08fccf48b713db00552d400dc2c08d8b69be8918d61d",
        "masked_sha256": "62a2ba562ace7498edd1855974a4627644fa8dafbbeac669874eee97b6fbc6e1",
        "next_global_index": 192,
        "config_fingerprint": "6ed15c27aba04677e4979aeecdf7aad055bb8d8821e2b5924f9bb237154eac8a",
        "lane_epochs": {"00000": [76], "00001": [27], "00002": [28], "00003": [29]},
        "transform_counts": [],
    },
    "image_chat": {
        "bytes_sha256": "d1579da88e90e452c777927e06d2e057d8c5520738847a0db18c28ec6fde0e6c",
        "masked_sha256": "e0d29d9935b3b5aeebe29d16a840c9417c4ad5c59919b6f8768f832fec98b886",
        "next_global_index": 192,
        "config_fingerprint": "ab025ffbe160069a03fe73f2f56573214122f041fb4fd67d5271c1b7b6699e9c",
        "lane_epochs": {"00000": [8, 3], "00001": [11, 2], "00002": [3, 6], "00003": [6, 3]},
        "transform_counts": [],
    },
    "mix_token_chat": {
        "bytes_sha256": "293c9e1c6102c7a3e47741e1e4bbb1d8f52be13190724103137723d7610a45da",
        "masked_sha256": "f0c7f73369395a999aef08a81ba8401e217d704b42fe152533ef00fd5cf0c740",
        "next_global_index": 192,
        "config_fingerprint": "8ff0c9b50cf3abb62c3f562273fea607d01157e4b9d2838d0ae28491ff5a242d",
        "lane_epochs": {"00000": [7, 16], "00001": [3, 13], "00002": [1, 25], "00003": [2, 17]},
        "transform_counts": [],
    },
    "tombstoned": {
        "bytes_sha256": "ef08c0bcbbd9b942cac1484141931d2608d235900cda55b5e493aeef30adcfc1",
        "masked_sha256": "fef89c23b1f7dea51fea4c241274ce00a668dc5297bed64423ec75eea1e08732",
        "next_global_index": 192,
        "config_fingerprint": "31d9352a6463f5f43e94ebe651c0ecdfce5989d55cf5730739c89345646566ae",
        "lane_epochs": {"00000": [10], "00001": [6], "00002": [4], "00003": [6]},
        "transform_counts": [[157, 0], [0, 0], [46, 0], [0, 0], [0, 0]],
    },
    "transforms_text": {
        "bytes_sha256": "ac4e7b1acf789b9b07cb808f238fe09d986e2e31423fd1919d82355db730f558",
        "masked_sha256": "8e75b2bcb63420746cec95cd69ac2e2c748edf70631f00666837824239a20e91",
        "next_global_index": 192,
        "config_fingerprint": "84dbbb41fb238f2b6828a22e1f71d42f65ed1d26f8c924da278655993cdc13f6",
        "lane_epochs": {"00000": [2], "00001": [1], "00002": [1], "00003": [1]},
        "transform_counts": [[11, 0], [5, 0], [0, 93]],
    },
    "transforms_tokens": {
        "bytes_sha256": "3bab98c4bd395093e603c1deb97eac5d678cd6f553b8c13fdad13ae8fae35fe8",
        "masked_sha256": "43ab70c26547e6657bdd92601ac7bd24843ed966e4d7851e61e81e3151c354e2",
        "next_global_index": 192,
        "config_fingerprint": "0eac82ca7fc0d18b80006f03813f40a3ac91fdb11b6984ddae6f38788c13877f",
        "lane_epochs": {"00000": [9], "00001": [11], "00002": [7], "00003": [10]},
        "transform_counts": [[301, 0], [0, 290], [0, 89]],
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_json_keeps_its_bytes(runs, name) -> None:
    _, state = runs[name]
    got = checkpoint_values(state)
    pinned = dict(PINNED_CHECKPOINTS[name])
    full_sha256 = pinned.pop("bytes_sha256")
    assert {k: v for k, v in got.items() if k != "bytes_sha256"} == pinned
    if "transforms" in name or name == "tombstoned":  # the transforms really dropped and changed
        assert sum(d for d, _ in got["transform_counts"]) > 0
        assert sum(c for _, c in got["transform_counts"]) > 0 or name == "tombstoned"
    require_pinned_libraries(*libraries_of(name))
    assert got["bytes_sha256"] == full_sha256


# ---------------------------------------------------------------------------------------
# Every batch field, in-process and from two worker processes.


def _as_array(value: Any) -> np.ndarray:
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def documented_line(step: int, batches: list[dict], names: list[str]) -> str:
    """The fingerprint line of one step, from its micro-batches, by the byte layout README
    "Batch fingerprints" documents (each sequence in global-index order: input_ids, labels as
    little-endian int32; then each of its images: token offset and (t, h, w) as int64, its
    pixel_values rows as float32), with the per-source sequence and supervised counts."""
    rows: dict[int, tuple[bytes, int]] = {}
    supervised = np.zeros(len(names), np.int64)
    for batch in batches:
        images: dict[int, bytes] = {}
        if "pixel_values" in batch:
            pixels, grids = _as_array(batch["pixel_values"]), _as_array(batch["image_grid_thw"])
            ends = np.cumsum(grids.prod(axis=1))
            for k, (row, offset) in enumerate(zip(_as_array(batch["image_sequence_index"]).tolist(),
                                                  _as_array(batch["image_token_offsets"]).tolist())):
                head = np.array([offset, *grids[k]], dtype="<i8").tobytes()
                values = pixels[int(ends[k] - grids[k].prod()) : int(ends[k])].astype("<f4").tobytes()
                images[row] = images.get(row, b"") + head + values
        ids, labels = _as_array(batch["input_ids"]), _as_array(batch["labels"])
        sources = _as_array(batch["source_ids"]).tolist()
        for row, index in enumerate(_as_array(batch["global_indices"]).tolist()):
            rows[index] = (ids[row].astype("<i4").tobytes() + labels[row].astype("<i4").tobytes()
                           + images.get(row, b""), sources[row])
            if "loss_mask" in batch:
                trained = (labels[row] != -100) & (_as_array(batch["loss_mask"])[row] == 1)
                if "token_source_ids" in batch:
                    supervised += np.bincount(_as_array(batch["token_source_ids"])[row][trained],
                                              minlength=len(names))[: len(names)]
                else:
                    supervised[sources[row]] += int(trained.sum())
    digest = hashlib.sha256(b"".join(rows[index][0] for index in sorted(rows)))
    line = f"{step} {digest.hexdigest()}"
    if len(names) > 1:
        counts = np.bincount([source for _, source in rows.values()], minlength=len(names))
        line += " " + " ".join(f"{name}={count}" for name, count in zip(names, counts.tolist()))
    if any("loss_mask" in batch for batch in batches):
        line += " supervised: " + " ".join(f"{name}={count}" for name, count in zip(names, supervised.tolist()))
    return line


def field_digests(config: LoaderConfig, *, steps: int = LATER_STEP + 1) -> tuple[dict, list[str]]:
    """A SHA-256 of every field of every micro-batch of ``steps`` steps (W = 1), its dtype, and
    the documented fingerprint line of every step.

    Per micro-batch an array field adds ``dtype shape;`` then its values as little-endian
    bytes; an int field (step, micro_step) adds its decimal value, a dict field (reject
    counts) its JSON with sorted keys. With workers, they are started before the first batch
    (else the trainer's process serves the first steps: the warm start).
    """
    digests: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    lines = []
    with ZephonLoader(config) as loader:
        loader.wait_for_workers(timeout_s=90)
        for step in range(steps):
            batches = [next(loader) for _ in range(loader.topology.micro_steps_per_step)]
            lines.append(documented_line(step, batches, list(loader.source_names)))
            for batch in batches:
                for name, value in batch.items():
                    digest = digests.setdefault(name, hashlib.sha256())
                    if isinstance(value, int):
                        kinds[name] = "int"
                        digest.update(f"{value};".encode())
                    elif isinstance(value, dict):
                        kinds[name] = "dict"
                        digest.update(json.dumps(value, sort_keys=True).encode() + b";")
                    else:
                        array = _as_array(value)
                        kinds[name] = array.dtype.name
                        digest.update(f"{array.dtype.name} {array.shape};".encode())
                        digest.update(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
    return {name: (kinds[name], digest.hexdigest()[:32]) for name, digest in sorted(digests.items())}, lines


FIELD_CONFIGS = ("chat_offline_best_fit", "chat_online_concat", "image", "image_chat", "mix_token_chat")
WORKER_CONFIGS = ("chat_online_best_fit", "image_chat")  # also run with num_workers=2


class FieldRuns(dict):
    """(config name, num_workers) -> :func:`field_digests`, computed on first use."""

    def __init__(self, paths: dict[str, str]) -> None:
        super().__init__()
        self.paths = paths

    def __missing__(self, key: tuple[str, int]) -> tuple[dict, list[str]]:
        name, workers = key
        self[key] = field_digests(kinds_config(self.paths, name, num_workers=workers))
        return self[key]


@pytest.fixture(scope="module")
def field_runs(paths) -> FieldRuns:
    return FieldRuns(paths)


# Guards every field a trainer receives over steps 0..LATER_STEP (W = 1): the dtype and a
# digest (first 32 hex digits of SHA-256) of each, pixel_values apart (PINNED_PIXELS, Pillow).
PINNED_FIELDS = {
    "chat_offline_best_fit": {
        "cu_seqlens": ("int32", "d7dc7ae1e7ea4db77395fa2ab775a63c"),
        "global_indices": ("int64", "e34c76200d73911486f029214b551321"),
        "input_ids": ("int64", "251909ff00ad2ca0f15569bfbfc2bfb0"),
        "labels": ("int64", "07adc6e80e0100996040886a8dc2529b"),
        "loss_mask": ("uint8", "a8a0ef5f9e5caf6efd4fa7c91cdc9954"),
        "micro_step": ("int", "f88d78b3f8b351dfe42417761ef3ed7c"),
        "position_ids": ("int64", "4f5e7504b7e92c5c7243c6db4df7a429"),
        "source_ids": ("int64", "db99282455635908e6f5297671ce2118"),
        "step": ("int", "07a44740e36b6621fa9dbc8f56a66795"),
    },
    "chat_online_best_fit": {
        "chat_rejects": ("dict", "ef3aad788486a9624b47a8dba422f074"),
        "cu_seqlens": ("int32", "72eb28044b766e55b31e177fb45cc893"),
        "global_indices": ("int64", "e34c76200d73911486f029214b551321"),
        "input_ids": ("int64", "32935dbdb253cb134f5a0df6846de8f4"),
        "labels": ("int64", "17c86aebd1554a48cea10895dfd0e467"),
        "loss_mask": ("uint8", "f7e1bac90322971ae571a05c365ed51b"),
        "micro_step": ("int", "f88d78b3f8b351dfe42417761ef3ed7c"),
        "position_ids": ("int64", "484e60afba67c0968f9595d00f440e8b"),
        "source_ids": ("int64", "db99282455635908e6f5297671ce2118"),
        "step": ("int", "07a44740e36b6621fa9dbc8f56a66795"),
    },
    "chat_online_concat": {
        "chat_rejects": ("dict", "03eb05187db8879f9bf0ca38191d7380"),
        "cu_seqlens": ("int32", "b66508b8588784b5d7f28e38ed60f57d"),
        "global_indices": ("int64", "e34c76200d73911486f029214b551321"),
        "input_ids": ("int64", "110b5752e1f682ab489f2806857ab5d1"),
        "labels": ("int64", "607939b3f1841319fb0f5840457bb372"),
        "loss_mask": ("uint8", "7a0245b0806fa1a94ada3ec228a75016"),
        "micro_step": ("int", "f88d78b3f8b351dfe42417761ef3ed7c"),
        "position_ids": ("int64", "6482875507923d054e2c3057d2dcb678"),
        "source_ids": ("int64", "db99282455635908e6f5297671ce2118"),
        "step": ("int", "07a44740e36b6621fa9dbc8f56a66795"),
    },
    "image": {
        "cu_seqlens": ("int32", "ecc49ba1f5d98d58161937f0289c5298"),
        "global_indices": ("int64", "e34c76200d73911486f029214b551321"),
        "image_grid_thw": ("int64", "2eae024737a60c7622103d0e93402292"),
        "image_rejects": ("dict", "b0755b77af8f1a4137f785394e54c1fc"),
        "image_sequence_index": ("int64", "f7b5f8b8f1788c3827f2dd8a99011efe"),
        "image_token_offsets": ("int64", "cd01bb3fc6f6f8375fe4a03c038794c9"),
        "input_ids": ("int64", "a9438780125c9d63988f4236f0573702"),
        "labels": ("int64", "624f685a96443812899ed93e34b02a3a"),
        "loss_mask": ("uint8", "ef71ffa1ea3ee87a18f8cec39df7fe58"),
        "micro_step": ("int", "f88d78b3f8b351dfe42417761ef3ed7c"),
        "position_ids": ("int64", "c3f68b7ff60f95ff887a626bb40f3ffa"),
        "source_ids": ("int64", "db99282455635908e6f5297671ce2118"),
        "step": ("int", "07a44740e36b6621fa9dbc8f56a66795"),
    },
    "image_chat": {
        "chat_rejects": ("dict", "15177be333c7cbe6c6f50a49727b7815"),
        "cu_seqlens": ("int32", "09ebee3c4c7cd8d0d6c7eb6d72452ae7"),
        "global_indices": ("int64", "e34c76200d73911486f029214b551321"),
        "image_grid_thw": ("int64", "7a1692f4d2add697699429376db35955"),
        "image_rejects": ("dict", "b0755b77af8f1a4137f785394e54c1fc"),
        "image_sequence_index": ("int64", "d64bc3a6d86eba7307f6b05c340b7c9e"),
        "image_token_offsets": ("int64", "a9a33736eafca3e889c1b2d2716697c7"),
        "input_ids": ("int64", "e188883d4e24242d70085afc2d3fba60"),
        "labels": ("int64", "3feb5aaa75fa0d1c1149ed131480555c"),
        "loss_mask": ("uint8", "0182b4bfedb3f46f87c0c5f8a49ef9da"),
        "micro_step": ("int", "f88d78b3f8b351dfe42417761ef3ed7c"),
        "position_ids": ("int64", "9eaa841aa009990ff3aa0308716fad5a"),
        "source_ids": ("int64", "8951907d0e7a7addd39e5b1ca491257e"),
        "step": ("int", "07a44740e36b6621fa9dbc8f56a66795"),
    },
    "mix_token_chat": {
        "chat_rejects": ("dict", "18b7da8ae95871015ec9c52d1435824e"),
        "cu_seqlens": ("int32", "9522e8b611466f95d60d76076d4bd63f"),
        "global_indices": ("int64", "e34c76200d73911486f029214b551321"),
        "input_ids": ("int64", "e68759b1a3f7d14f23a003878b15c798"),
        "labels": ("int64", "774964980ad3afdc745f00859ee5a3e5"),
        "loss_mask": ("uint8", "18ce99c65947a718703310ae2a722b18"),
        "micro_step": ("int", "f88d78b3f8b351dfe42417761ef3ed7c"),
        "position_ids": ("int64", "add397a2f45fedf383a0a2c369eed44c"),
        "source_ids": ("int64", "62edefaaf3e728652848c5922c5a15bf"),
        "step": ("int", "07a44740e36b6621fa9dbc8f56a66795"),
        "token_source_ids": ("int64", "92aa1c6c1fdc34ccb3a407b39ebdebbf"),
    },
}
PINNED_PIXELS = {
    "image": ("float32", "bdadfa64639c0d80162217fd823a03b7"),
    "image_chat": ("float32", "2b138a438938dd358ff742289e25e856"),
}


def split_pillow_fields(digests: dict) -> tuple[dict, dict]:
    return ({k: v for k, v in digests.items() if k not in PILLOW_FIELDS},
            {k: v for k, v in digests.items() if k in PILLOW_FIELDS})


@pytest.mark.parametrize("name", sorted(set(FIELD_CONFIGS) | set(WORKER_CONFIGS)))
def test_every_batch_field_keeps_its_values(runs, field_runs, name) -> None:
    digests, lines = field_runs[(name, 0)]
    fields, pixels = split_pillow_fields(digests)
    assert fields == PINNED_FIELDS[name]
    assert (name in IMAGE_CONFIGS) == bool(pixels)
    # The byte layout README documents gives the `zephon fingerprints` lines.
    assert lines == runs[name][0]
    if pixels:
        require_pinned_libraries("Pillow")
        assert pixels == {"pixel_values": PINNED_PIXELS[name]}


@pytest.mark.parametrize("name", WORKER_CONFIGS)
def test_two_workers_give_the_pinned_in_process_batches(field_runs, name) -> None:
    digests, lines = field_runs[(name, 2)]
    fields, pixels = split_pillow_fields(digests)
    assert fields == PINNED_FIELDS[name]
    if pixels:  # and the lines, which hash them
        require_pinned_libraries("Pillow")
        assert pixels == {"pixel_values": PINNED_PIXELS[name]}
    assert pinned_lines(lines) == PINNED_FINGERPRINTS[name]


# ---------------------------------------------------------------------------------------
# Lane files of the Beam job.

BEAM_DATASETS = ("chat_offline", "chat_online", "image", "image_chat", "tombstoned")


def _cell_bytes(value: Any) -> bytes:
    """A length-prefixed, typed encoding of one cell of a lane file (pyarrow-independent)."""
    if value is None:
        body = b"n"
    elif isinstance(value, bool):
        body = b"?" + str(int(value)).encode()
    elif isinstance(value, str):
        body = b"s" + value.encode("utf-8")
    elif isinstance(value, bytes):
        body = b"b" + value
    elif isinstance(value, int):
        body = b"i" + str(value).encode()
    elif isinstance(value, float):
        body = b"f" + value.hex().encode()
    elif isinstance(value, list):
        body = b"l" + b"".join(_cell_bytes(item) for item in value)
    elif isinstance(value, dict):
        body = b"d" + b"".join(_cell_bytes(k) + _cell_bytes(v) for k, v in sorted(value.items()))
    else:
        raise TypeError(f"unexpected lane file value {value!r:.60}")
    return len(body).to_bytes(8, "little") + body


def dataset_content(path: str) -> dict[str, Any]:
    """What a dataset holds, independent of how Parquet encodes it: schema, which rows are in
    which file and row group, every cell in lane order (``content_sha256``; the Pillow-made
    image columns apart, in ``images_sha256``), and the manifest's counts."""
    manifest = read_manifest(path)
    content, images = hashlib.sha256(), hashlib.sha256()
    layout = []
    for lane in range(manifest.num_lanes):
        content.update(f"lane {lane}\n".encode())
        for entry in manifest.lane_files(lane):
            parquet = pq.ParquetFile(os.path.join(path, entry.path))
            groups = [parquet.metadata.row_group(g).num_rows for g in range(parquet.metadata.num_row_groups)]
            layout.append((entry.path, entry.rows, entry.tokens, groups))
            table = parquet.read()
            for row in table.to_pylist():
                for name in table.column_names:
                    cell = name.encode() + b"=" + _cell_bytes(row[name])
                    (images if name in PILLOW_COLUMNS else content).update(cell)
    return {
        "schema": [(f["name"], f["type"]) for f in manifest.schema],
        "layout": layout,
        "content_sha256": content.hexdigest(),
        "images_sha256": images.hexdigest() if manifest.images is not None else None,
        "documents": manifest.documents,
        "tombstones": manifest.tombstones,
        "rejected": {reason: n for reason, n in sorted(manifest.rejected.items()) if n},
    }


# Guards the lane files as the loader reads them (no library version moves these): column
# names and types, rows / tokens / row groups of every file, every cell of every row in lane
# order, documents, tombstones and reject counts. images_sha256 (the encoded test images and
# their SHA-256 column) follows the Pillow version.
PINNED_CONTENT = {
    "chat_offline": {
        "schema": [
            ("key", "string"),
            ("order_key", "uint64"),
            ("text", "string"),
            ("input_ids", "binary"),
            ("num_tokens", "int32"),
            ("loss_mask", "binary"),
        ],
        "layout": [
            ("lane=00000/part-00001.parquet", 1, 511, [1]),
            ("lane=00000/part-00003.parquet", 1, 161, [1]),
            ("lane=00000/part-00006.parquet", 1, 511, [1]),
            ("lane=00000/part-00008.parquet", 1, 511, [1]),
            ("lane=00001/part-00001.parquet", 3, 872, [3]),
            ("lane=00001/part-00002.parquet", 1, 511, [1]),
            ("lane=00001/part-00007.parquet", 3, 1533, [3]),
            ("lane=00001/part-00008.parquet", 2, 1022, [2]),
            ("lane=00002/part-00000.parquet", 2, 1022, [2]),
            ("lane=00002/part-00001.parquet", 1, 511, [1]),
            ("lane=00002/part-00002.parquet", 3, 1533, [3]),
            ("lane=00002/part-00003.parquet", 3, 1320, [3]),
            ("lane=00002/part-00004.parquet", 1, 511, [1]),
            ("lane=00002/part-00005.parquet", 2, 713, [2]),
            ("lane=00002/part-00006.parquet", 1, 511, [1]),
            ("lane=00002/part-00007.parquet", 1, 511, [1]),
            ("lane=00002/part-00008.parquet", 2, 579, [2]),
            ("lane=00002/part-00009.parquet", 1, 511, [1]),
            ("lane=00002/part-00010.parquet", 1, 511, [1]),
            ("lane=00003/part-00000.parquet", 1, 511, [1]),
            ("lane=00003/part-00001.parquet", 2, 678, [2]),
            ("lane=00003/part-00002.parquet", 1, 511, [1]),
            ("lane=00003/part-00004.parquet", 2, 778, [2]),
            ("lane=00003/part-00005.parquet", 2, 832, [2]),
            ("lane=00003/part-00006.parquet", 1, 511, [1]),
            ("lane=00003/part-00007.parquet", 1, 511, [1]),
            ("lane=00003/part-00009.parquet", 3, 1139, [3]),
        ],
        "content_sha256": "0bcf990c6dde91dcd4cd0603ac10a28fb6288f5ceb18cc48dd12bce38d365ee8",
        "images_sha256": None,
        "documents": 44,
        "tombstones": 0,
        "rejected": {"empty_loss_mask": 4},
    },
    "chat_online": {
        "schema": [("key", "string"), ("order_key", "uint64"), ("text", "string"), ("conversation", "string")],
        "layout": [
            ("lane=00000/part-00002.parquet", 1, None, [1]),
            ("lane=00000/part-00004.parquet", 1, None, [1]),
            ("lane=00000/part-00007.parquet", 1, None, [1]),
            ("lane=00000/part-00009.parquet", 1, None, [1]),
            ("lane=00001/part-00001.parquet", 3, None, [3]),
            ("lane=00001/part-00002.parquet", 1, None, [1]),
            ("lane=00001/part-00003.parquet", 2, None, [2]),
            ("lane=00001/part-00008.parquet", 1, None, [1]),
            ("lane=00001/part-00009.parquet", 3, None, [3]),
            ("lane=00001/part-00010.parquet", 1, None, [1]),
            ("lane=00001/part-00011.parquet", 1, None, [1]),
            ("lane=00002/part-00000.parquet", 2, None, [2]),
            ("lane=00002/part-00002.parquet", 1, None, [1]),
            ("lane=00002/part-00003.parquet", 3, None, [3]),
            ("lane=00002/part-00004.parquet", 4, None, [4]),
            ("lane=00002/part-00006.parquet", 2, None, [2]),
            ("lane=00002/part-00007.parquet", 1, None, [1]),
            ("lane=00002/part-00008.parquet", 1, None, [1]),
            ("lane=00002/part-00009.parquet", 1, None, [1]),
            ("lane=00002/part-00010.parquet", 1, None, [1]),
            ("lane=00002/part-00011.parquet", 1, None, [1]),
            ("lane=00002/part-00012.parquet", 1, None, [1]),
            ("lane=00003/part-00000.parquet", 1, None, [1]),
            ("lane=00003/part-00001.parquet", 1, None, [1]),
            ("lane=00003/part-00002.parquet", 1, None, [1]),
            ("lane=00003/part-00003.parquet", 1, None, [1]),
            ("lane=00003/part-00004.parquet", 2, None, [2]),
            ("lane=00003/part-00006.parquet", 1, None, [1]),
            ("lane=00003/part-00007.parquet", 2, None, [2]),
            ("lane=00003/part-00009.parquet", 1, None, [1]),
            ("lane=00003/part-00010.parquet", 2, None, [2]),
            ("lane=00003/part-00011.parquet", 2, None, [2]),
        ],
        "content_sha256": "b18d26d013ee39aaa964027fb16d40e34db15b8e3cd3ecc1f39c04b0741d623a",
        "images_sha256": None,
        "documents": 48,
        "tombstones": 0,
        "rejected": {},
    },
    "image": {
        "schema": [
            ("key", "string"),
            ("order_key", "uint64"),
            ("text", "string"),
            ("segments", "list<int32>"),
            ("num_images", "int32"),
            ("image_bytes", "list<binary>"),
            ("image_format", "list<string>"),
            ("image_width", "list<int32>"),
            ("image_height", "list<int32>"),
            ("image_sha256", "list<string>"),
            ("image_visual_tokens", "list<int32>"),
        ],
        "layout": [
            ("lane=00000/part-00000.parquet", 1, None, [1]),
            ("lane=00000/part-00004.parquet", 2, None, [2]),
            ("lane=00001/part-00000.parquet", 3, None, [3]),
            ("lane=00001/part-00001.parquet", 3, None, [3]),
            ("lane=00001/part-00002.parquet", 2, None, [2]),
            ("lane=00001/part-00004.parquet", 2, None, [2]),
            ("lane=00002/part-00000.parquet", 1, None, [1]),
            ("lane=00002/part-00002.parquet", 3, None, [3]),
            ("lane=00002/part-00003.parquet", 3, None, [3]),
            ("lane=00002/part-00004.parquet", 1, None, [1]),
            ("lane=00003/part-00000.parquet", 3, None, [3]),
            ("lane=00003/part-00002.parquet", 2, None, [2]),
            ("lane=00003/part-00003.parquet", 2, None, [2]),
            ("lane=00003/part-00004.parquet", 2, None, [2]),
        ],
        "content_sha256": "5626460b3784dde4ca45d53dac367c0c7297369d8e2441eb59033b326cd86c34",
        "images_sha256": "485c532cd02e8fe71923f00cc94486066a6938b390f2b1dcb504d9077924a4a0",
        "documents": 30,
        "tombstones": 0,
        "rejected": {},
    },
    "image_chat": {
        "schema": [
            ("key", "string"),
            ("order_key", "uint64"),
            ("text", "string"),
            ("conversation", "string"),
            ("segments", "list<int32>"),
            ("num_images", "int32"),
            ("image_bytes", "list<binary>"),
            ("image_format", "list<string>"),
            ("image_width", "list<int32>"),
            ("image_height", "list<int32>"),
            ("image_sha256", "list<string>"),
            ("image_visual_tokens", "list<int32>"),
        ],
        "layout": [
            ("lane=00000/part-00000.parquet", 2, None, [2]),
            ("lane=00000/part-00001.parquet", 2, None, [2]),
            ("lane=00000/part-00002.parquet", 1, None, [1]),
            ("lane=00000/part-00003.parquet", 2, None, [2]),
            ("lane=00001/part-00001.parquet", 1, None, [1]),
            ("lane=00001/part-00002.parquet", 2, None, [2]),
            ("lane=00002/part-00000.parquet", 2, None, [2]),
            ("lane=00002/part-00001.parquet", 3, None, [3]),
            ("lane=00002/part-00002.parquet", 3, None, [3]),
            ("lane=00003/part-00000.parquet", 1, None, [1]),
            ("lane=00003/part-00001.parquet", 1, None, [1]),
            ("lane=00003/part-00003.parquet", 4, None, [4]),
        ],
        "content_sha256": "456a49a075fb7e52cc92da7ee68003c83886afa83b9f6ba20ad2a35984115a46",
        "images_sha256": "b0f314bfc1b04da5ff7c28d2fa29048a54a943e126052df9473d7f657993bb83",
        "documents": 24,
        "tombstones": 0,
        "rejected": {},
    },
    "tombstoned": {
        "schema": [
            ("key", "string"),
            ("order_key", "uint64"),
            ("text", "string"),
            ("input_ids", "binary"),
            ("num_tokens", "int32"),
            ("dropped_by", "int16"),
            ("lang", "string"),
        ],
        "layout": [
            ("lane=00000/part-00000.parquet", 8, 146, [8]),
            ("lane=00000/part-00001.parquet", 6, 65, [6]),
            ("lane=00001/part-00000.parquet", 4, 149, [4]),
            ("lane=00001/part-00001.parquet", 9, 200, [9]),
            ("lane=00002/part-00000.parquet", 11, 263, [11]),
            ("lane=00002/part-00001.parquet", 9, 232, [9]),
            ("lane=00003/part-00000.parquet", 7, 93, [7]),
            ("lane=00003/part-00001.parquet", 10, 240, [10]),
        ],
        "content_sha256": "7b9c8c6cc284e9f68128777e2c68b1d1a13bd27a16867dd6a82186145380bb60",
        "images_sha256": None,
        "documents": 37,
        "tombstones": 27,
        "rejected": {},
    },
}


@pytest.mark.parametrize("name", BEAM_DATASETS)
def test_beam_lane_files_hold_the_pinned_content(paths, name) -> None:
    got = dataset_content(paths[name])
    pinned = dict(PINNED_CONTENT[name])
    images = pinned.pop("images_sha256")
    assert {k: v for k, v in got.items() if k != "images_sha256"} == pinned
    if images is not None:
        require_pinned_libraries("Pillow")
    assert got["images_sha256"] == images


# Guards the exact bytes on disk: each lane file's SHA-256 (first 16 hex digits), the
# manifest.json bytes and the dataset fingerprint checkpoints store (pyarrow, tokenizers and,
# for image datasets, Pillow versions checked first).
PINNED_BYTES = {
    "chat_offline": {
        "dataset_fingerprint": "fd8afe3349f214430aab183c63b1f1b21a003e2e552d141d1add05b20ceacbda",
        # The one pin moved since ba86f0e: offline chat manifests record chat.longest_tokens (an
        # additive entry, outside the dataset fingerprint; every other value here is ba86f0e's).
        "manifest_sha256": "8cc047d13ba31940b216dd1e7b1dcefa3c4f2e7778d0d748f190e94332c2b405",
        "file_sha256_16": {
            "lane=00000/part-00001.parquet": "799695d3c84cf274",
            "lane=00000/part-00003.parquet": "d7834eb49dbcae6c",
            "lane=00000/part-00006.parquet": "9b9222e985d0d63a",
            "lane=00000/part-00008.parquet": "72e417d501b7fb73",
            "lane=00001/part-00001.parquet": "daf61b58079491f7",
            "lane=00001/part-00002.parquet": "5257ddb44f5284e2",
            "lane=00001/part-00007.parquet": "33a21651635bde60",
            "lane=00001/part-00008.parquet": "3fab61e07b74d138",
            "lane=00002/part-00000.parquet": "a528f14d767e12ba",
            "lane=00002/part-00001.parquet": "9c69bee484c14ef9",
            "lane=00002/part-00002.parquet": "444f296521067fc8",
            "lane=00002/part-00003.parquet": "a180409f317336c2",
            "lane=00002/part-00004.parquet": "679b5719cb17af52",
            "lane=00002/part-00005.parquet": "0bf21cf60edadab3",
            "lane=00002/part-00006.parquet": "e18cc2effb5ef819",
            "lane=00002/part-00007.parquet": "5d1692158f6d67f5",
            "lane=00002/part-00008.parquet": "1121522e8ae643e1",
            "lane=00002/part-00009.parquet": "599cbbf5c195f967",
            "lane=00002/part-00010.parquet": "c819669eb854e2fe",
            "lane=00003/part-00000.parquet": "bf3fab467ce7d09b",
            "lane=00003/part-00001.parquet": "27dcdc86dbf8c4b0",
            "lane=00003/part-00002.parquet": "a41cd01526e5d5f8",
            "lane=00003/part-00004.parquet": "d767055e3a0d13de",
            "lane=00003/part-00005.parquet": "3cc0b397d003360f",
            "lane=00003/part-00006.parquet": "28167ec1d114eb7c",
            "lane=00003/part-00007.parquet": "be4de94e24828bb7",
            "lane=00003/part-00009.parquet": "6102fda5db8be502",
        },
        "created_by": "parquet-cpp-arrow version 25.0.1",
    },
    "chat_online": {
        "dataset_fingerprint": "e74664c90f395e3bad27f7c55cd763b86a807491a181a470968c37447d2f00ec",
        "manifest_sha256": "2efb317305e4fd189d8159cf8b30d9595df6429242a05103c3fdcf788e832f27",
        "file_sha256_16": {
            "lane=00000/part-00002.parquet": "feafa2e7d39057dc",
            "lane=00000/part-00004.parquet": "9e2f733bb39b47aa",
            "lane=00000/part-00007.parquet": "d05bfc3df295fcfa",
            "lane=00000/part-00009.parquet": "419f2ef79f5c3a65",
            "lane=00001/part-00001.parquet": "6cf4b6d17389ffe2",
            "lane=00001/part-00002.parquet": "3114da5c31424a7f",
            "lane=00001/part-00003.parquet": "85e20edc49069eb6",
            "lane=00001/part-00008.parquet": "8ccfe61b86c8f934",
            "lane=00001/part-00009.parquet": "56e2b598ef196d5d",
            "lane=00001/part-00010.parquet": "ca405667271a02b0",
            "lane=00001/part-00011.parquet": "53ed6c25becfc6f0",
            "lane=00002/part-00000.parquet": "2b1f77e4894f1065",
            "lane=00002/part-00002.parquet": "33dbb9a5fd44ac96",
            "lane=00002/part-00003.parquet": "2a0b9407e333255f",
            "lane=00002/part-00004.parquet": "63306d60273bcfc9",
            "lane=00002/part-00006.parquet": "2499f9d0011c00ae",
            "lane=00002/part-00007.parquet": "a8e53092f1de4b31",
            "lane=00002/part-00008.parquet": "5ccd64fb0db834ef",
            "lane=00002/part-00009.parquet": "1fa648e75a06a0d0",
            "lane=00002/part-00010.parquet": "6eeb887f09a63f75",
            "lane=00002/part-00011.parquet": "3a2ebdb1073520fe",
            "lane=00002/part-00012.parquet": "a8a7ba76dfbb171d",
            "lane=00003/part-00000.parquet": "c30d38418b805071",
            "lane=00003/part-00001.parquet": "cc325a1372fe8660",
            "lane=00003/part-00002.parquet": "587dc6e525d2cde7",
            "lane=00003/part-00003.parquet": "854ac2836b24f80f",
            "lane=00003/part-00004.parquet": "d04cbb842ffa4148",
            "lane=00003/part-00006.parquet": "b7c0effdaa677e2d",
            "lane=00003/part-00007.parquet": "03fe2970e6512a9e",
            "lane=00003/part-00009.parquet": "5cdb411cc2d5f446",
            "lane=00003/part-00010.parquet": "5bf783a02960191f",
            "lane=00003/part-00011.parquet": "71c00816521d103d",
        },
        "created_by": "parquet-cpp-arrow version 25.0.1",
    },
    "image": {
        "dataset_fingerprint": "0adf35956eae6a8f973737e84cdda60e1941b65a5a4df7f86ce49fd632466869",
        "manifest_sha256": "0101cd6abbb221dd210fbbc9f77bfd7981e16abbeec79186ebfdfc1e248a3c5f",
        "file_sha256_16": {
            "lane=00000/part-00000.parquet": "ea23a331310a39dd",
            "lane=00000/part-00004.parquet": "b6c3c2c8de94cb63",
            "lane=00001/part-00000.parquet": "ca73b0d3195b9e3b",
            "lane=00001/part-00001.parquet": "3989d425d4bc5a45",
            "lane=00001/part-00002.parquet": "f438f65365cf4fab",
            "lane=00001/part-00004.parquet": "cc6430045cad9fed",
            "lane=00002/part-00000.parquet": "0bbe60e81b0ef46a",
            "lane=00002/part-00002.parquet": "5830c863c2e0c267",
            "lane=00002/part-00003.parquet": "5d26f44ac8d8411b",
            "lane=00002/part-00004.parquet": "fb4dfcb0d0c83a8e",
            "lane=00003/part-00000.parquet": "9f05f81430f670a3",
            "lane=00003/part-00002.parquet": "807fcba4640a9274",
            "lane=00003/part-00003.parquet": "4c5702a1c4023fbf",
            "lane=00003/part-00004.parquet": "f9e48984cbac70cc",
        },
        "created_by": "parquet-cpp-arrow version 25.0.1",
    },
    "image_chat": {
        "dataset_fingerprint": "671be3c39e200635de031bfbbcf6829ee7354cfb27af51d4922a5658e264f853",
        "manifest_sha256": "18b6dddf1a220e6c168045a74e3bca2fa7df7ba07e8e33e9613bb75c1e8e6f31",
        "file_sha256_16": {
            "lane=00000/part-00000.parquet": "1facfd5a885af336",
            "lane=00000/part-00001.parquet": "4d3eda5be8569c36",
            "lane=00000/part-00002.parquet": "de10f9e9f8444cc2",
            "lane=00000/part-00003.parquet": "12a2494789b78fb7",
            "lane=00001/part-00001.parquet": "fd33af6acb6bb62b",
            "lane=00001/part-00002.parquet": "fac650fc1c28e071",
            "lane=00002/part-00000.parquet": "16af1ededc8821b7",
            "lane=00002/part-00001.parquet": "df1312282af4951f",
            "lane=00002/part-00002.parquet": "1669988df75df62c",
            "lane=00003/part-00000.parquet": "7f2a4831b2cea39d",
            "lane=00003/part-00001.parquet": "a1a8ae76740f4322",
            "lane=00003/part-00003.parquet": "a2afda3d7079b145",
        },
        "created_by": "parquet-cpp-arrow version 25.0.1",
    },
    "tombstoned": {
        "dataset_fingerprint": "f880898a23a7345f8f8693fbb406205941f2dc3e333d80d427d9bee1c68d28c0",
        # The one pin moved since d17fcff: pre-tokenized text manifests record longest_tokens (an
        # additive entry, outside the dataset fingerprint; test_the_tombstoned_manifest_pin_moved_only_by_longest_tokens).
        "manifest_sha256": "bf9eacb682378d22f56743a84f302c68eee234dc640e524fc5113a1dc316551c",
        "file_sha256_16": {
            "lane=00000/part-00000.parquet": "b2281ed45180ef0a",
            "lane=00000/part-00001.parquet": "60f353448d98ddfa",
            "lane=00001/part-00000.parquet": "7c826665f3ef67d8",
            "lane=00001/part-00001.parquet": "3bff4b4400f523c2",
            "lane=00002/part-00000.parquet": "ff306133c1d8afaf",
            "lane=00002/part-00001.parquet": "c87876f9f0efc478",
            "lane=00003/part-00000.parquet": "cc8bc8cb5763ef46",
            "lane=00003/part-00001.parquet": "b7d77d3b29153893",
        },
        "created_by": "parquet-cpp-arrow version 25.0.1",
    },
}


REPOSITORY_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def portable_dataset_bytes(path: str) -> dict[str, Any]:
    """:func:`dataset_bytes` with the manifest hashed as if the checkout were at ``<repo>``.

    A chat manifest records where its template came from (``template_origin``, an absolute
    path of the machine that sharded it; outside the dataset fingerprint), so its raw bytes
    differ between two clones of the repository. Everything else is hashed as written.
    """
    values = dataset_bytes(path)
    with open(os.path.join(path, MANIFEST_NAME), "rb") as fh:
        raw = fh.read()
    values["manifest_sha256"] = hashlib.sha256(raw.replace(REPOSITORY_ROOT.encode(), b"<repo>")).hexdigest()
    return values


@pytest.mark.parametrize("name", BEAM_DATASETS)
def test_beam_lane_file_bytes_and_dataset_fingerprints_keep_their_values(paths, name) -> None:
    require_pinned_libraries(*libraries_of(name))
    assert portable_dataset_bytes(paths[name]) == PINNED_BYTES[name]


def test_the_tombstoned_manifest_pin_moved_only_by_longest_tokens(paths) -> None:
    """Without the entry the tombstoned manifest has d17fcff's bytes (tests.golden.test_golden_pins
    shows the same for the Beam text dataset)."""
    require_pinned_libraries(*libraries_of("tombstoned"))
    longest, before = manifest_without_longest(paths["tombstoned"])
    assert before == "b9251f71ce0cae5866a6b1a62587c49e08448097c6fab49a99d970bc9378efff"
    assert longest == read_manifest(paths["tombstoned"]).longest_tokens <= 40  # its --transform truncate_tokens
