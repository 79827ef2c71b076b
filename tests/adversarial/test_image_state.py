"""An edited ``image_ref`` in a saved state is refused (issue 28, class 1).

A best-fit bin of an image source saves each piece's tokens, its ``image_ref`` values and its
origin (the stream cursor of its first token). A restore checks every such piece against the
block it came from, so a ref pointed at another image (here: with as many visual tokens, the
fixed policy's 16) is a :class:`StateError` naming the field, never another image's pixels.
Restores of unedited states give the uninterrupted run's batches. No new state bytes: the
golden pins are untouched (tests/golden).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vision"))

from image_loader_data import FIXED, image_config, image_tokenizer, shard_images  # noqa: E402
from loader.checkpoint.state import StateError  # noqa: E402
from loader.pipeline import ZephonLoader  # noqa: E402

SAVED_AT = 5  # micro-batches before the state is taken
AFTER = 4


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("image_state")
    shard_images(root, root / "ds", 60, FIXED)
    config = image_config([{"path": str(root / "ds")}], image_tokenizer(root / "tok.json"), num_workers=0)
    with ZephonLoader(config, output="numpy") as loader:
        for _ in range(SAVED_AT):
            next(loader)
        state = loader.state_dict()
        after = [next(loader) for _ in range(AFTER)]
    return config, state, after


def _bins(state):
    for lane, entry in sorted(state["lanes"].items()):
        for source, lane_state in entry["sources"].items():
            for k, saved in enumerate(lane_state["packer"]["bins"]):
                yield lane, source, k, saved


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if not isinstance(a[k], list) else all(map(np.array_equal, a[k], b[k]))
        for k in a)


def test_an_unedited_state_restores_the_same_batches(images):
    config, state, after = images
    with ZephonLoader(config, output="numpy") as loader:
        loader.load_state_dict(copy.deepcopy(state))
        assert all(_same(next(loader), batch) for batch in after)


def _edit_ref(state, how):
    edited = copy.deepcopy(state)
    for lane, source, k, saved in _bins(edited):
        refs = np.asarray(saved["image_ref"])
        values = sorted(set(refs[refs >= 0].tolist()))
        if not values:
            continue
        old = values[0]
        new = how(old)
        saved["image_ref"] = [new if r == old else r for r in saved["image_ref"]]
        return edited, lane, k
    raise AssertionError("no bin holds an image")


# Each ref is epoch << 47 | block << 27 | row << 8 | image: another row, image, block or epoch.
EDITS = {"row": lambda r: r + (1 << 8), "row_far": lambda r: r ^ (4 << 8), "image": lambda r: r + 1,
         "block": lambda r: r + (1 << 27), "epoch": lambda r: r + (1 << 47), "no_image": lambda r: -1}


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_image_ref_is_a_state_error_naming_the_field(images, edit):
    config, state, _ = images
    edited, lane, k = _edit_ref(state, EDITS[edit])
    with ZephonLoader(config, output="numpy") as loader:
        with pytest.raises(StateError, match=rf"lanes\.{lane}\..*bins\[{k}\]\.image_ref: piece \d+ holds image_ref "
                                             r"values that are not those of the data"):
            loader.load_state_dict(edited)
            next(loader)  # lanes are restored when first used


def test_a_ref_added_on_a_text_token_is_refused(images):
    config, state, _ = images
    edited = copy.deepcopy(state)
    lane, source, k, saved = next(b for b in _bins(edited) if -1 in b[3]["image_ref"])
    refs = saved["image_ref"]
    at = refs.index(-1)
    refs[at] = max(refs)
    with ZephonLoader(config, output="numpy") as loader:
        with pytest.raises(StateError, match=rf"bins\[{k}\]\.image_ref"):
            loader.load_state_dict(edited)
            next(loader)  # lanes are restored when first used


def test_edited_bin_tokens_are_refused_too(images):
    config, state, _ = images
    edited = copy.deepcopy(state)
    lane, source, k, saved = next(_bins(edited))
    saved["tokens"][0] = (saved["tokens"][0] + 1) % 50
    with ZephonLoader(config, output="numpy") as loader:
        with pytest.raises(StateError, match=rf"bins\[{k}\] piece 0 .*its tokens are not the data at its origin"):
            loader.load_state_dict(edited)
            next(loader)  # lanes are restored when first used
