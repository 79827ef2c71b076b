"""``zephon audit``: every token of a step traced back to its document, without replaying from step 0."""

from __future__ import annotations

import numpy as np
import pytest

from loader.commands.audit import audit_step

from tests.audit.conftest import SEQ_LEN, audit_with_reads, rebuild_from_documents, step_batch


def _check(config, sources, step, **kwargs):
    audit = audit_step(config, step, **kwargs)
    expected, (token_format, pad_id) = step_batch(config, step)
    rebuilt = rebuild_from_documents(audit, {"web": sources.web, "code": sources.code}, token_format, pad_id, SEQ_LEN)
    np.testing.assert_array_equal(rebuilt, expected)
    return audit


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
@pytest.mark.parametrize("step", [0, 3, 45])
def test_audit_rebuilds_the_step(make_config, sources, packing, step):
    audit = _check(make_config(packing), sources, step)
    assert audit.method == ("seek" if packing == "concat" else "replay")
    if step == 45:  # a later epoch: files, row groups and rows replayed in a permutation
        assert {p.epoch for s in audit.sequences for p in s.pieces} - {0}


@pytest.mark.parametrize("packing,unit", [("concat", "sequence"), ("best_fit", "sequence"), ("concat", "token"),
                                          ("best_fit", "token")])
def test_audit_of_a_mix(make_config, sources, packing, unit):
    audit = _check(make_config(packing, mix=True, mixing_unit=unit), sources, 9)
    assert {p.source for s in audit.sequences for p in s.pieces} == {"web", "code"}
    assert audit.method == ("seek" if (packing, unit) == ("concat", "sequence") else "replay")


def test_seek_and_replay_agree(make_config, sources, monkeypatch):
    """The O(1) seek of concat lanes gives the very report of a replay of every earlier output."""
    import loader.commands.audit as audit_module

    config = make_config("concat", mix=True)
    seek = audit_step(config, 23)
    monkeypatch.setattr(audit_module, "choose_method", lambda *args: "replay")
    replay = audit_step(config, 23)
    assert (seek.method, replay.method) == ("seek", "replay")
    assert seek.sequences == replay.sequences


def test_one_sequence_with_text(make_config, sources, tokenizer):
    config = make_config("best_fit")
    whole = audit_step(config, 5)
    one = audit_step(config, 5, sequence=3, text=True)
    assert len(one.sequences) == 1 and one.sequences[0].position == 3
    assert [(p.key, p.start, p.end) for p in one.sequences[0].pieces] == [
        (p.key, p.start, p.end) for p in whole.sequences[3].pieces]
    expected, _ = step_batch(config, 5)
    decoded = "".join(p.text for p in one.sequences[0].pieces)
    used = expected[3][: one.sequences[0].padding_start].tolist()
    assert decoded == tokenizer.decode(used, skip_special_tokens=False)


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_audit_after_a_resume_on_another_world_size(make_config, sources, packing):
    """A run checkpointed on W=2 at step 6 and resumed on W=4: step 14 as that run saw it equals
    the audit from the checkpoint (``--load-state``) and from the datasets alone."""
    from loader.checkpoint.state import merge_rank_states
    from loader.pipeline import ZephonLoader

    config = make_config(packing, mix=True, micro_batch_size=2)
    loaders = [ZephonLoader(config, rank=r, world_size=2) for r in range(2)]
    for loader in loaders:
        while loader.step < 6:
            next(loader)
    state = merge_rank_states([loader.state_dict(step=6) for loader in loaders])
    for loader in loaders:
        loader.close()
    expected, (token_format, pad_id) = step_batch(config, 14, load_state=state, world_size=4)
    datasets = {"web": sources.web, "code": sources.code}
    for audit in (audit_step(config, 14, load_state=state), audit_step(config, 14)):
        np.testing.assert_array_equal(rebuild_from_documents(audit, datasets, token_format, pad_id, SEQ_LEN), expected)
    # best fit too: the open bins' pieces are resolved to their documents (piece_origins)
    assert audit_step(config, 14, load_state=state).method == "checkpoint"


def test_reads_only_the_row_groups_the_step_needs(make_config, sources, monkeypatch):
    """Seek at a late step: no token is read; num_tokens of at most one file per lane and source;
    the key column of exactly the row groups holding the step's documents."""
    import pyarrow.parquet as pq

    reads = []
    original = pq.ParquetFile.read_row_group

    def counting(self, i, columns=None, **kwargs):
        reads.append((self.metadata.num_rows, i, tuple(columns or ())))
        return original(self, i, columns=columns, **kwargs)

    config = make_config("concat", mix=True)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    audit = audit_step(config, 41)
    monkeypatch.undo()
    columns = [c for _, _, cs in reads for c in cs]
    assert "input_ids" not in columns and "text" not in columns
    needed = {(p.source, p.file, p.row_group) for s in audit.sequences for p in s.pieces}
    assert audit.reads["key"] == len(needed) == columns.count("key")
    # num_tokens: only inside the file each cursor falls in (2 files per lane of 4-row groups)
    assert 0 < audit.reads["num_tokens"] == columns.count("num_tokens")
    files_per_stream = {}
    for source, lane, path, _, column in _log_of(config, 41):
        if column == "num_tokens":
            files_per_stream.setdefault((source, lane), set()).add(path)
    assert files_per_stream and all(len(files) == 1 for files in files_per_stream.values())


def _log_of(config, step):
    """The audit's own read log of a seek (num_tokens reads before the key reads)."""
    return audit_with_reads(config, step)[1]


def test_text_lanes_need_a_checkpoint(make_config, sources, tmp_path, capsys):
    from loader.cli import main
    from loader.commands.audit import AuditError

    config = make_config("concat", datasets=[{"path": sources.web_text}])
    with pytest.raises(AuditError, match="--load-state"):
        audit_step(config, 3)
    path = tmp_path / "text.json"
    import json
    from dataclasses import asdict
    data = asdict(config)
    path.write_text(json.dumps(data))
    assert main(["audit", str(path), "--step", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zephon audit: error: sources ['web'] are text lanes")


def test_text_lanes_from_a_checkpoint(make_config, sources):
    """Text lanes with --load-state: the cursors are restored and only the row groups from the
    checkpoint on are tokenized; the documents are the same as the pre-tokenized copy's."""
    from loader.pipeline import ZephonLoader

    config = make_config("concat", datasets=[{"path": sources.web_text}])
    with ZephonLoader(config) as loader:
        while loader.step < 4:
            next(loader)
        state = loader.global_state_dict(step=4)
    audit = audit_step(config, 7, load_state=state)
    assert audit.method == "checkpoint" and "text" in audit.reads
    expected, (token_format, pad_id) = step_batch(config, 7)
    np.testing.assert_array_equal(
        rebuild_from_documents(audit, {"web": sources.web}, token_format, pad_id, SEQ_LEN), expected)


def test_sources_rewritten_as_they_are_read_are_refused(make_config):
    """Online transforms change documents as they are read: their lengths are not num_tokens."""
    from loader.commands.audit import AuditError
    from loader.config import LoaderConfig

    fields = make_config("concat").to_dict()
    fields["transforms"] = [{"function": "drop_regex", "args": {"pattern": "zzz"}}]
    with pytest.raises(AuditError, match=r"sources \['web'\] are transformed or rendered as they are read"):
        audit_step(LoaderConfig.from_dict(fields), 2)


def test_command_line_json_with_a_state_file(make_config, sources, tmp_path, capsys):
    """``zephon audit CONFIG --step N --load-state FILE --json`` prints the report of audit_step."""
    import json
    from dataclasses import asdict

    from loader.checkpoint.state import dumps
    from loader.cli import main
    from loader.pipeline import ZephonLoader

    config = make_config("concat", mix=True)
    config_path, state_path = tmp_path / "run.json", tmp_path / "state.json"
    config_path.write_text(json.dumps(asdict(config)))
    with ZephonLoader(config) as loader:
        while loader.step < 3:
            next(loader)
        state_path.write_text(dumps(loader.global_state_dict(step=3)))
    assert main(["audit", str(config_path), "--step", "5", "--load-state", str(state_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = audit_step(config, 5)
    assert printed["method"] == "checkpoint" and printed["step"] == 5
    assert printed["sequences"] == [asdict(s) for s in expected.sequences]
    assert main(["audit", str(config_path), "--step", "2", "--load-state", str(state_path)]) == 2
    assert "resumes at step 3, after --step 2" in capsys.readouterr().err


def test_finite_data_replays_and_refuses_a_step_past_its_end(make_config, sources):
    """``exhaustion = "stop"``: lanes stop and fall back, so the audit replays; past the end it says so."""
    from loader.commands.audit import AuditError

    config = make_config("concat", mix=True, datasets=[{"path": sources.web, "weight": 0.6},
                                                       {"path": sources.code, "weight": 0.4, "exhaustion": "stop"}])
    audit = _check(config, sources, 130)  # code has stopped in every lane by then: web fills its share
    assert audit.method == "replay" and {p.source for s in audit.sequences for p in s.pieces} == {"web"}
    with pytest.raises(AuditError, match="past the end of the data"):
        audit_step(config.replace(datasets=tuple(d.__class__(**{**d.__dict__, "exhaustion": "stop"})
                                                 for d in config.datasets)), 10_000)


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_audit_across_a_schedule_change(make_config, sources, packing):
    config = make_config(packing, mix=True, schedule=[{"step": 4, "weights": {"web": 1, "code": 3}}])
    _check(config, sources, 11)
