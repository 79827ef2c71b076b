"""``zephon audit --load-state``: best-fit (and token-mixing) lanes restored from a checkpoint.

A version-2 checkpoint's open best-fit bins say where each piece came from (``piece_origins``),
so the audit restores the lanes there, resolves the bins' pieces to their documents and
produces only the steps from the checkpoint to the audited one; a version-1 checkpoint cannot
say, and the audit replays and says why.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import numpy as np
import pytest

from loader.checkpoint.state import dumps
from loader.commands.audit import audit_step
from loader.pipeline import ZephonLoader
from tests.audit.conftest import NUM_LANES, SEQ_LEN, audit_with_reads, rebuild_from_documents, step_batch


def _state_at(config, step: int) -> dict:
    with ZephonLoader(config) as loader:
        while loader.step < step:
            next(loader)
        return json.loads(dumps(loader.global_state_dict(step=step)))


def _bins(state: dict) -> list[dict]:
    out = []
    for lane in state["lanes"].values():
        packers = [lane["mixed"]] if "mixed" in lane else [s["packer"] for s in lane["sources"].values()]
        out += [b for p in packers for b in p["bins"]]
    return out


def _num_tokens_reads(config, step, **kwargs) -> tuple[object, set]:
    """The audit and the (source, lane, file, row group) whose num_tokens it read."""
    audit, reads = audit_with_reads(config, step, **kwargs)
    return audit, {r[:4] for r in reads if r[4] == "num_tokens"}


def _blocks_between(config, before: dict, after: dict) -> set:
    """(source, lane, file, row group) of every block from each stream's cursor in ``before``
    to its cursor in ``after``, both included: what producing the steps between them reads."""
    from loader.stages.producer import build_lanes

    with ZephonLoader(config) as loader:
        lanes = build_lanes(loader.spec, list(range(NUM_LANES)), {})
        wanted = set()
        for lane_id, lane in lanes.items():
            key = f"{lane_id:05d}"
            first, last = before["lanes"][key], after["lanes"][key]
            if "mixed" in first:
                pairs = zip(first["mixed"]["stream"]["sources"], last["mixed"]["stream"]["sources"])
            else:  # in the lane's source order (the JSON's keys are sorted)
                pairs = ((first["sources"][n]["packer"]["stream"], last["sources"][n]["packer"]["stream"])
                         for n in loader.source_names)
            for stream, (lo, hi) in zip(lane.source_streams(), pairs):
                epoch, block = lo["epoch"], lo["block"]
                while (epoch, block) <= (hi["epoch"], hi["block"]):
                    blocks = stream.blocks_of_epoch(epoch)
                    file_ordinal, row_group = blocks[block]
                    wanted.add((stream.source_name, lane_id, stream.files[file_ordinal].path, row_group))
                    epoch, block = (epoch, block + 1) if block + 1 < len(blocks) else (epoch + 1, 0)
            lane.close()
    return wanted


def _origin_blocks(config, state: dict) -> set:
    """(source, lane, file, row group) of every open bin piece's origin in ``state``."""
    from loader.stages.producer import build_lanes

    with ZephonLoader(config) as loader:
        lanes = build_lanes(loader.spec, list(range(NUM_LANES)), {})
        names = loader.source_names
        out = set()
        for lane_id, lane in lanes.items():
            lane_state = state["lanes"][f"{lane_id:05d}"]
            streams = lane.source_streams()
            packers = [(None, lane_state["mixed"])] if "mixed" in lane_state else [
                (names.index(n), s["packer"]) for n, s in lane_state["sources"].items()]
            for source, packer in packers:
                for bin_ in packer["bins"]:
                    for origin, start in zip(bin_["piece_origins"], bin_["piece_starts"]):
                        stream = streams[bin_["token_sources"][start] if source is None else source]
                        file_ordinal, row_group = stream.blocks_of_epoch(origin[0])[origin[1]]
                        out.add((stream.source_name, lane_id, stream.files[file_ordinal].path, row_group))
            lane.close()
    return out


@pytest.mark.parametrize("mix,unit", [(False, "sequence"), (True, "sequence"), (True, "token")])
def test_best_fit_from_a_checkpoint_rebuilds_the_step_and_reads_from_it_on(make_config, sources, mix, unit):
    config = make_config("best_fit", mix=mix, mixing_unit=unit)
    saved_step, step = 30, 34
    state = _state_at(config, saved_step)
    assert _bins(state) and all("piece_origins" in b for b in _bins(state))
    audit, reads = _num_tokens_reads(config, step, load_state=state)
    assert audit.method == "checkpoint" and audit.state_step == saved_step and not audit.notes
    expected, (token_format, pad_id) = step_batch(config, step)
    datasets = {"web": sources.web, "code": sources.code}
    np.testing.assert_array_equal(rebuild_from_documents(audit, datasets, token_format, pad_id, SEQ_LEN), expected)
    # Only the row groups of the open bins' pieces and those the steps from the checkpoint on pass through.
    after = _state_at(config, step + 1)
    origins = _origin_blocks(config, state)
    allowed = _blocks_between(config, state, after) | origins
    assert origins <= reads, origins - reads
    assert reads <= allowed, reads - allowed
    _, replay_reads = _num_tokens_reads(config, step)
    assert len(reads) < len(replay_reads)


def test_a_version_1_checkpoint_replays_and_says_why(make_config, sources):
    """Without piece origins (the format before version 2) the bins cannot be resolved: the
    audit replays from step 0, which still gives the step exactly, and its notes say why."""
    config = make_config("best_fit", mix=True)
    state = _state_at(config, 12)
    for bin_ in _bins(state):
        del bin_["piece_origins"]
    state["version"] = 1
    notes = []
    audit = audit_step(config, 15, load_state=state, notice=notes.append)
    assert audit.method == "replay" and audit.notes == notes
    assert "version-1 checkpoint" in notes[0] and "replaying from step 0" in notes[0]
    assert "best-fit packing" in notes[1] and "--load-state" in notes[1]
    expected, (token_format, pad_id) = step_batch(config, 15)
    datasets = {"web": sources.web, "code": sources.code}
    np.testing.assert_array_equal(rebuild_from_documents(audit, datasets, token_format, pad_id, SEQ_LEN), expected)


def test_a_wrong_piece_origin_is_refused_by_its_path(make_config):
    from loader.io.provenance import OriginError

    config = make_config("best_fit")
    state = _state_at(config, 10)
    lane, bin_ = next((key, lane["sources"]["web"]["packer"]["bins"][0]) for key, lane in state["lanes"].items()
                      if lane["sources"]["web"]["packer"]["bins"])
    bin_["piece_origins"][0][2] += 1  # one token later: the piece's document start is not there
    with pytest.raises(OriginError, match=rf"lanes\.{lane}\.sources\.web\.packer\.bins\[0\]\.piece_origins\[0\]"):
        audit_step(config, 12, load_state=state)


def test_load_state_directory_takes_the_newest_checkpoint_at_or_before_the_step(make_config, sources, tmp_path,
                                                                                 capsys):
    """A Trainer output_dir (checkpoint-N/zephon_state.json beside other JSON files)."""
    from loader.cli import main

    config = make_config("best_fit", mix=True)
    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps(asdict(config)))
    out = tmp_path / "out"
    with ZephonLoader(config) as loader:
        for saved in (4, 8, 12):
            while loader.step < saved:
                next(loader)
            os.makedirs(out / f"checkpoint-{saved}")
            (out / f"checkpoint-{saved}" / "zephon_state.json").write_text(dumps(loader.global_state_dict(step=saved)))
            (out / f"checkpoint-{saved}" / "trainer_state.json").write_text(json.dumps({"global_step": saved}))
    assert main(["audit", str(config_path), "--step", "10", "--load-state", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed["method"] == "checkpoint" and printed["state_step"] == 8
    assert "checkpoint-8" in printed["notes"][0] and "checkpoint-8" in captured.err
    assert printed["sequences"] == [asdict(s) for s in audit_step(config, 10).sequences]
    # Before the first checkpoint: none is used, and the replay says why and what it costs.
    assert main(["audit", str(config_path), "--step", "2", "--load-state", str(out)]) == 0
    err = capsys.readouterr().err
    assert "no checkpoint at or before step 2" in err and "cannot seek to step 2 (best-fit packing" in err
    assert "documents/s" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.ckpt").write_bytes(b"\x80\x04pickle")
    assert main(["audit", str(config_path), "--step", "2", "--load-state", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "holds no Zephon loader state" in err and "model.ckpt" in err and "never opened" in err
