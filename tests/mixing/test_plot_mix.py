"""``zephon plot-mix``: the figure holds each source's observed share per step and the
schedule's target, and shows the schedule change.

The log is a real ``collect_fingerprints`` run of a two-source mix whose schedule changes
the weights at step ``CHANGE``; the expected series are recomputed from the log's text and
the weights written in the test, not from the module's own helpers.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from PIL import Image

from loader import cli
from loader.commands.diff import parse_log
from loader.commands.fingerprints import collect_fingerprints
from loader.commands.plot_mix import mix_figure, mix_series
from tests.mixing.conftest import GLOBAL_BATCH

CHANGE = 6
STEPS = 12
BEFORE = {"web": 1 / 3, "code": 2 / 3}  # weights 1 : 2
AFTER = {"web": 3 / 4, "code": 1 / 4}  # schedule entry {web = 3, code = 1}


@pytest.fixture(scope="module")
def run(mix_config, tmp_path_factory):
    """(config file, log file, config) of a 1:2 mix changed to 3:1 at step CHANGE."""
    config = mix_config({"web": 1, "code": 2}, schedule=[{"step": CHANGE, "weights": {"web": 3, "code": 1}}])
    base = tmp_path_factory.mktemp("plot_mix")
    results, _ = collect_fingerprints(config, world_size=1, end_step=STEPS)
    log = base / "run.txt"
    log.write_text("".join(r.line() + "\n" for r in results))
    config_file = base / "run.json"
    config_file.write_text(json.dumps(config.to_dict()))
    return str(config_file), str(log), config


def _logged_counts(log: str) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = {"web": [], "code": []}
    for line in open(log).read().splitlines():
        for pair in line.split()[2:]:
            name, count = pair.split("=")
            counts[name].append(int(count))
    return counts


def test_the_plot_is_an_image_holding_observed_and_target_shares(run, tmp_path, capsys):
    config_file, log, config = run
    out = tmp_path / "mix.png"
    assert cli.main(["plot-mix", log, str(out), "--config", config_file]) == 0
    assert "schedule changes at [6]" in capsys.readouterr().out
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[0] > 600 and image.size[1] > 400
        image.verify()

    counts = _logged_counts(log)
    expected_target = {n: [BEFORE[n] if s < CHANGE else AFTER[n] for s in range(STEPS)] for n in BEFORE}
    figure = mix_figure(mix_series(parse_log(log), config, ["web", "code"], log), "title")
    lines = {line.get_gid(): line for ax in figure.axes for line in ax.get_lines() if line.get_gid()}
    for name in ("web", "code"):
        observed = 100 * np.array(counts[name]) / GLOBAL_BATCH
        assert np.allclose(lines[f"observed:{name}"].get_ydata(), observed)
        assert np.allclose(lines[f"target:{name}"].get_ydata(), 100 * np.array(expected_target[name]))
        assert list(lines[f"observed:{name}"].get_xdata()) == list(range(STEPS))
        errors = np.array(counts[name]) - GLOBAL_BATCH * np.array(expected_target[name])
        assert np.allclose(lines[f"error:{name}"].get_ydata(), errors)
        assert np.all(np.abs(errors) < 1)  # the mixing contract the lower panel shows
    # the shares really change at the schedule step, and the change is drawn there
    assert np.mean(counts["web"][:CHANGE]) < GLOBAL_BATCH / 2 < np.mean(counts["web"][CHANGE:])
    verticals = [line for ax in figure.axes for line in ax.get_lines()
                 if not line.get_gid() and list(line.get_xdata()) == [CHANGE, CHANGE]]
    assert len(verticals) == 2  # one per panel


def test_a_log_that_does_not_match_the_config_is_refused(run, tmp_path, mix_config, capsys):
    config_file, log, config = run
    single = tmp_path / "single.txt"
    single.write_text(f"0 {'ab' * 32}\n")
    renamed = tmp_path / "renamed.txt"
    renamed.write_text(open(log).read().replace("code=", "math="))
    token_config = tmp_path / "token.json"
    token_config.write_text(json.dumps(config.replace(mixing_unit="token").to_dict()))
    cases = [
        ([str(single), "x.png", "--config", config_file], f"{single}: step 0 has no per-source counts"),
        ([str(renamed), "x.png", "--config", config_file], "counts sources ['math', 'web']"),
        ([log, str(tmp_path / "x.png"), "--config", str(token_config)], "mixing_unit = 'token'"),
        ([log, str(tmp_path / "x.unknown"), "--config", config_file], "cannot tell the image type"),
    ]
    for argv, message in cases:
        assert cli.main(["plot-mix", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)


def test_missing_matplotlib_is_one_line_naming_the_extra(run, tmp_path, monkeypatch, capsys):
    config_file, log, _ = run
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    assert cli.main(["plot-mix", log, str(tmp_path / "x.png"), "--config", config_file]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install matplotlib" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.png").exists()
