"""Per-token features end to end, with ``loss_mask`` as the feature under test.

A pre-tokenized copy of the suite's corpus gets a ``loss_mask`` column whose value for a
document token is a fixed function of its id (``_mask_of``). The loader is configured with
BOS and without EOS, so every position of a batch is a document token, a BOS or padding,
told apart by the id alone (document ids are never the BOS or pad id). The reference of a
batch is then computed without the feature code: ``loss_mask`` is ``_mask_of(id)`` on
document tokens and 0 on BOS and padding, and ``labels`` are those of the *same* config on
the copy without the column (document starts and padding already -100) with -100 added
wherever the reference mask is 0.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loader.commands.fingerprints import collect_fingerprints
from loader.io.blocks import TokenFormat
from loader.io.integrity import LaneDataError
from loader.io.lane_reader import LaneTokenStream
from loader.io.manifest import read_manifest
from loader.pipeline import ZephonLoader
from loader.checkpoint.state import StateError
from tests.dataset_factory import write_dataset
from tests.loader.settings import DATA_SEED, NUM_LANES, PACKINGS, eos_id_of

STEPS = 5
ROW_KEYS = ("input_ids", "labels", "loss_mask", "token_source_ids", "position_ids", "source_ids")


def _mask_of(ids: np.ndarray) -> np.ndarray:
    """The test mask of document tokens: a fixed function of the id (not a prefix rule, so
    any shift of the mask against the ids shows)."""
    ids = np.asarray(ids, dtype=np.int64)
    return ((ids * 7 + 3) % 5 < 3).astype(np.uint8)


@pytest.fixture(scope="module")
def masked(tmp_path_factory, corpus, tokenizer) -> dict[str, str]:
    base = tmp_path_factory.mktemp("features")
    ids = [e.ids for e in tokenizer.encode_batch(list(corpus.texts), add_special_tokens=False)]
    options = dict(num_lanes=NUM_LANES, seed=DATA_SEED, files_per_lane=2, row_group_rows=4, tokenizer=tokenizer)
    write_dataset(str(base / "masked"), corpus.texts, loss_masks=[_mask_of(i) for i in ids], **options)
    write_dataset(str(base / "masked_list"), corpus.texts, loss_masks=[_mask_of(i) for i in ids],
                  token_encoding="list", **options)
    write_dataset(str(base / "all_ones"), corpus.texts, loss_masks=[np.ones(len(i)) for i in ids], **options)
    other = [f"other {t}" for t in corpus.texts[::2]]
    other_ids = [e.ids for e in tokenizer.encode_batch(other, add_special_tokens=False)]
    write_dataset(str(base / "other_masked"), other, loss_masks=[_mask_of(i) for i in other_ids],
                  keys=[f"other-{k}" for k in range(len(other))], source_name="other", **options)
    write_dataset(str(base / "other_plain"), other, keys=[f"other-{k}" for k in range(len(other))],
                  source_name="other", **options)
    return {"masked": str(base / "masked"), "masked_list": str(base / "masked_list"),
            "all_ones": str(base / "all_ones"), "other_masked": str(base / "other_masked"),
            "other_plain": str(base / "other_plain"), "plain": corpus.pretokenized_path}


# Each case: (datasets with the mask, the same without it, mixing unit).
CASES = {
    "single": ([("masked", 1.0)], [("plain", 1.0)], "sequence"),
    "token_mix": ([("masked", 0.6), ("other_masked", 0.4)], [("plain", 0.6), ("other_plain", 0.4)], "token"),
    "token_mix_one_masked": ([("masked", 0.6), ("other_plain", 0.4)], [("plain", 0.6), ("other_plain", 0.4)], "token"),
    "sequence_mix": ([("masked", 0.5), ("other_plain", 0.5)], [("plain", 0.5), ("other_plain", 0.5)], "sequence"),
}


def _config(make_config, masked, packing, datasets, mixing_unit="sequence", **overrides):
    entries = [{"path": masked[name], "name": f"s{k}", "weight": weight} for k, (name, weight) in enumerate(datasets)]
    return make_config(packing, datasets=entries, mixing_unit=mixing_unit, add_bos=True, add_eos=False, **overrides)


def _rows(config, *, world_size: int = 1, steps: int = STEPS, output: str = "torch") -> dict[int, dict]:
    """Every global index's row (numpy arrays) over ``steps`` steps, ranks simulated in one process."""
    loaders = [ZephonLoader(config, rank=r, world_size=world_size, output=output) for r in range(world_size)]
    rows: dict[int, dict] = {}
    try:
        for _ in range(steps):
            for loader in loaders:
                for _ in range(loader.topology.micro_steps_per_step):
                    batch = next(loader)
                    for k, index in enumerate(np.asarray(batch["global_indices"]).tolist()):
                        rows[index] = {key: np.asarray(batch[key][k]) for key in ROW_KEYS if key in batch}
    finally:
        for loader in loaders:
            loader.close()
    return rows


def _special_ids(config) -> tuple[int, int]:
    with ZephonLoader(config) as loader:
        fmt = loader.spec.token_format
        return fmt.bos_id, loader.spec.pad_id


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("packing", PACKINGS)
def test_labels_and_loss_mask_match_the_reference(make_config, masked, packing, case):
    with_mask, without, unit = CASES[case]
    config = _config(make_config, masked, packing, with_mask, unit)
    got = _rows(config)
    plain = _rows(_config(make_config, masked, packing, without, unit))
    bos, pad = _special_ids(config)
    assert got.keys() == plain.keys()
    masked_sources = {k for k, (name, _) in enumerate(with_mask) if name in ("masked", "other_masked")}
    supervised = 0
    for index, row in got.items():
        ids, ref_labels = row["input_ids"], plain[index]["labels"]
        assert np.array_equal(ids, plain[index]["input_ids"]), f"row {index}: the mask changed the tokens"
        padding = ref_labels == -100
        padding[: np.flatnonzero(ids != pad).max() + 1] = False  # the padding tail only
        special = (ids == bos) | padding
        document = ~special
        ref_mask = np.where(special, 0, _mask_of(ids)).astype(np.uint8)
        if case == "token_mix_one_masked":  # tokens of the source without the column: mask 1 except padding
            unmasked = ~np.isin(row["token_source_ids"], list(masked_sources))
            ref_mask = np.where(unmasked & ~padding, 1, ref_mask).astype(np.uint8)
        elif case == "sequence_mix" and int(row["source_ids"]) not in masked_sources:
            ref_mask = np.where(padding, 0, 1).astype(np.uint8)
        assert row["loss_mask"].dtype == np.uint8
        np.testing.assert_array_equal(row["loss_mask"], ref_mask, err_msg=f"row {index}: loss_mask")
        ref = np.where(ref_mask == 0, -100, ref_labels)
        np.testing.assert_array_equal(row["labels"], ref, err_msg=f"row {index}: labels")
        supervised += int((row["labels"][document] != -100).sum())
        assert not np.array_equal(row["labels"], ref_labels) or ref_mask[document].all()
    assert supervised > 0


@pytest.mark.parametrize("packing", PACKINGS)
def test_topologies_and_resume_agree(make_config, masked, packing):
    """W 1/2, workers 0/2 give the same rows; fingerprints agree and a resume on another W
    continues them (best fit: open bins hold the mask in the checkpoint)."""
    config = _config(make_config, masked, packing, CASES["token_mix"][0], "token")
    reference = _rows(config)
    for world_size, workers in ((2, 0), (1, 2)):
        rows = _rows(config.replace(num_workers=workers), world_size=world_size)
        assert rows.keys() == reference.keys()
        for index, row in rows.items():
            for key in ("input_ids", "labels", "loss_mask", "token_source_ids", "position_ids"):
                np.testing.assert_array_equal(row[key], reference[index][key], err_msg=f"W={world_size} "
                                              f"workers={workers} row {index}: {key}")
    lines = lambda results: [r.line() for r in results]  # noqa: E731
    full, state = collect_fingerprints(config, world_size=1, end_step=STEPS, save_state_step=2)
    state = json.loads(json.dumps(state))
    if packing == "best_fit":
        bins = [b for lane in state["lanes"].values() for b in lane["mixed"]["bins"]]
        assert bins and all(len(b["loss_mask"]) == len(b["tokens"]) for b in bins)
    resumed, _ = collect_fingerprints(config, world_size=2, start_step=2, end_step=STEPS, load_state=state)
    assert lines(resumed) == lines(full)[2:]
    assert lines(collect_fingerprints(config, world_size=2, end_step=STEPS)[0]) == lines(full)
    plain = _config(make_config, masked, packing, CASES["token_mix"][1], "token")
    assert lines(collect_fingerprints(plain, end_step=STEPS)[0]) != lines(full)  # the labels differ


def test_a_dataset_without_the_column_has_no_loss_mask_and_an_all_ones_mask_changes_nothing(make_config, masked):
    plain = _rows(_config(make_config, masked, "concat", [("plain", 1.0)]))
    ones = _rows(_config(make_config, masked, "concat", [("all_ones", 1.0)]))
    assert "loss_mask" not in next(iter(plain.values()))
    for index, row in ones.items():
        for key in ("input_ids", "labels", "position_ids"):
            assert np.array_equal(row[key], plain[index][key]), (index, key)


def test_list_encoded_column_reads_like_binary(make_config, masked):
    binary = _rows(_config(make_config, masked, "best_fit", [("masked", 1.0)]), steps=2)
    listed = _rows(_config(make_config, masked, "best_fit", [("masked_list", 1.0)]), steps=2)
    for index, row in binary.items():
        for key in ("input_ids", "labels", "loss_mask"):
            assert np.array_equal(row[key], listed[index][key]), (index, key)


def test_numpy_output_equals_torch_output(make_config, masked):
    config = _config(make_config, masked, "concat", [("masked", 1.0)])
    with ZephonLoader(config) as torch_loader, ZephonLoader(config, output="numpy") as numpy_loader:
        for _ in range(4):
            a, b = next(torch_loader), next(numpy_loader)
            assert a.keys() == b.keys()
            for key in a:
                if isinstance(a[key], torch.Tensor):
                    assert isinstance(b[key], np.ndarray) and np.array_equal(a[key].numpy(), b[key]), key
                else:
                    assert a[key] == b[key]
    with pytest.raises(Exception, match="output='jax'.*torch.*numpy"):
        ZephonLoader(config, output="jax")


def test_eos_takes_the_documents_last_mask_value(masked, tokenizer):
    """With BOS and EOS: BOS gets 0, EOS the value of the document's last token."""
    manifest = read_manifest(masked["masked"])
    bos, eos = 1, eos_id_of(tokenizer)
    stream = LaneTokenStream(dataset_path=masked["masked"], manifest=manifest, source_name="x", lane_id=0, seed=0,
                             token_format=TokenFormat(bos_id=bos, eos_id=eos))
    chunk = stream.take(10_000)
    mask, starts = chunk.features["loss_mask"], chunk.doc_starts
    assert len(mask) == len(chunk.tokens) and len(starts) > 3
    ends = np.append(starts[1:], len(chunk.tokens)) - 1
    assert (mask[starts] == 0).all()
    assert np.array_equal(mask[ends], mask[ends - 1])
    inner = np.ones(len(mask), bool)
    inner[starts], inner[ends] = False, False
    assert np.array_equal(mask[inner], _mask_of(chunk.tokens[inner]))
    stream.close()


def test_a_best_fit_checkpoint_without_the_mask_is_refused(make_config, masked):
    config = _config(make_config, masked, "best_fit", [("masked", 1.0)])
    with ZephonLoader(config) as loader:
        for _ in range(3):
            next(loader)
        state = json.loads(json.dumps(loader.state_dict()))
    lane, saved = next((k, v) for k, v in state["lanes"].items() if v["sources"]["s0"]["packer"]["bins"])
    for b in saved["sources"]["s0"]["packer"]["bins"]:
        del b["loss_mask"]
    with ZephonLoader(config) as loader:
        with pytest.raises(StateError, match=rf"lanes\.{lane}\.sources\.s0\.packer\.bins\[0\].*loss_mask"):
            loader.load_state_dict(state)
            next(loader)
    bad = json.loads(json.dumps(state))
    bad["lanes"][lane]["sources"]["s0"]["packer"]["bins"][0]["loss_mask"] = [2] * len(
        bad["lanes"][lane]["sources"]["s0"]["packer"]["bins"][0]["tokens"])
    with ZephonLoader(config) as loader:
        with pytest.raises(StateError, match=rf"bins\[0\]\.loss_mask\[0\].*\[0, 1\]"):
            loader.load_state_dict(bad)


@pytest.mark.parametrize("problem", ["length", "range"])
def test_a_malformed_column_names_the_file_and_row(tmp_path, tokenizer, problem):
    texts = ["alpha beta gamma", "delta data model token", "lane zephon"]
    ids = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    masks = [np.ones(len(i) + (1 if problem == "length" and k == 1 else 0)) * (3 if problem == "range" else 1)
             for k, i in enumerate(ids)]
    write_dataset(str(tmp_path), texts, num_lanes=1, tokenizer=tokenizer, loss_masks=masks)
    stream = LaneTokenStream(dataset_path=str(tmp_path), manifest=read_manifest(str(tmp_path)), source_name="x",
                             lane_id=0, seed=0, token_format=TokenFormat(bos_id=None, eos_id=eos_id_of(tokenizer)))
    expected = r"part-00000\.parquet: row group 0.*loss_mask holds" + (
        r" \d+ values but input_ids holds \d+ ids" if problem == "length" else r" 3; its values must be in \[0, 1\]")
    with pytest.raises(LaneDataError, match=expected):
        stream.take(5)
    stream.close()
