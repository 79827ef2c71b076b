"""``zephon plot-mix FINGERPRINTS_LOG FILE.png --config CONFIG``: the mix a run received.

For every step of a fingerprint log (``zephon fingerprints`` output of a config that mixes
several sources, so each line carries ``name=count`` per source), the share of the step's
sequences each source had, against the schedule's target weight at that step (the
datasets' weights and ``schedule`` of ``CONFIG``, exactly as the loader builds its phases).
A second panel shows ``count - weight * B`` per source: the mixing contract keeps it within
one sequence (``floor`` or ``ceil`` of ``w * B``) while every source still has data.
Schedule changes are drawn as vertical lines.

The log counts sequences by source, so this is for ``mixing_unit = "sequence"``; with
``"token"`` the weights are token shares, which the log does not record, and the command
refuses.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from loader.cli import run_command
from loader.commands.diff import parse_log, schedule_phases, weights_at
from loader.commands.fingerprints import StepFingerprint
from loader.commands.plotting import new_figure, save_figure
from loader.config import LoaderConfig
from loader.errors import ConfigError, DiffError
from loader.io.manifest import read_manifest


@dataclass(frozen=True)
class MixSeries:
    """What the plot draws, per source and step (lists aligned with ``steps``)."""

    steps: list[int]
    names: list[str]
    counts: dict[str, list[int]]  # sequences of the source in the step
    observed: dict[str, list[float]]  # counts / B
    target: dict[str, list[float]]  # the schedule's weight at the step
    batch_size: int
    change_steps: list[int]  # steps in the log's range where a schedule phase starts


def source_names(config: LoaderConfig) -> list[str]:
    """The sources' names as the loader names them (a dataset's ``name`` or its manifest's)."""
    return [d.name or read_manifest(d.path, config.storage_options()).source_name for d in config.datasets]


def mix_series(log: Sequence[StepFingerprint], config: LoaderConfig, names: Sequence[str], where: str) -> MixSeries:
    """Observed and target shares per step; a log that is not of this config is a :class:`DiffError`."""
    if config.mixing_unit != "sequence":
        raise ConfigError(f"config mixing_unit = {config.mixing_unit!r}: plot-mix compares sequence counts per "
                          "source with the weights, which are token shares under 'token'; it needs "
                          "mixing_unit = 'sequence'")
    batch = config.global_batch_size
    for result in log:
        if not result.source_counts:
            raise DiffError(f"{where}: step {result.step} has no per-source counts (`name=count` after the hash); "
                            "`zephon fingerprints` prints them only for a config that mixes several sources")
        if sorted(result.source_counts) != sorted(names):
            raise DiffError(f"{where}: step {result.step} counts sources {sorted(result.source_counts)} but the "
                            f"config's sources are {sorted(names)}: is the log from another config?")
        if sum(result.source_counts.values()) != batch:
            raise DiffError(f"{where}: step {result.step} counts {sum(result.source_counts.values())} sequences but "
                            f"the config's global_batch_size is {batch}: is the log from another config?")
    phases = schedule_phases(config, names)
    steps = [r.step for r in log]
    weights = [weights_at(phases, step) for step in steps]
    return MixSeries(
        steps=steps,
        names=list(names),
        counts={n: [r.source_counts[n] for r in log] for n in names},
        observed={n: [r.source_counts[n] / batch for r in log] for n in names},
        target={n: [float(w[n]) for w in weights] for n in names},
        batch_size=batch,
        change_steps=[start for start, _ in phases if start > 0 and steps[0] < start <= steps[-1]],
    )


def mix_figure(series: MixSeries, title: str) -> Any:
    """Two panels sharing the step axis: shares (observed solid, target dashed), then
    ``count - target * B`` with the +-1 sequence band of the mixing contract."""
    figure = new_figure(10, 6.5)
    share_axes, error_axes = figure.subplots(2, 1, sharex=True, height_ratios=[3, 1.4])
    colors = [f"C{k}" for k in range(len(series.names))]
    for name, color in zip(series.names, colors):
        share_axes.plot(series.steps, [100 * v for v in series.observed[name]], color=color, marker=".",
                        linewidth=1, label=f"{name}: observed", gid=f"observed:{name}")
        share_axes.plot(series.steps, [100 * v for v in series.target[name]], color=color, linestyle="--",
                        linewidth=2, drawstyle="steps-post", label=f"{name}: schedule target", gid=f"target:{name}")
        error_axes.plot(series.steps, [c - t * series.batch_size for c, t in zip(series.counts[name], series.target[name])],
                        color=color, marker=".", linewidth=1, label=name, gid=f"error:{name}")
    error_axes.axhspan(-1, 1, color="0.9", zorder=0, label="within one sequence")
    error_axes.axhline(0, color="0.5", linewidth=0.8)
    for step in series.change_steps:
        for axes in (share_axes, error_axes):
            axes.axvline(step, color="0.3", linestyle=":", linewidth=1.2)
        share_axes.annotate(f"schedule change\nat step {step}", xy=(step, 1), xycoords=("data", "axes fraction"),
                            xytext=(4, -4), textcoords="offset points", va="top", fontsize=8)
    share_axes.set_title(title)
    share_axes.set_ylabel("share of the step's sequences (%)")
    share_axes.set_ylim(0, 100)
    share_axes.grid(alpha=0.3)
    share_axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    error_axes.set_xlabel("global step")
    error_axes.set_ylabel("count - target x B\n(sequences)")
    error_axes.grid(alpha=0.3)
    error_axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    return figure


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon plot-mix",
        description="Plot each source's share of every step (from a `zephon fingerprints` log of a mix) "
                    "against the schedule's target weights.",
    )
    parser.add_argument("log", metavar="FINGERPRINTS_LOG", help="output of `zephon fingerprints` for a mixing config")
    parser.add_argument("output", metavar="FILE.png", help="image to write (.png, .svg, .pdf)")
    parser.add_argument("--config", required=True, help="the loader config (.toml/.json) the log was written with")
    parser.add_argument("--title", default=None, help="plot title (default: names the log and the config)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``zephon plot-mix``: errors are reported by :func:`loader.cli.run_command`."""
    return run_command("plot-mix", argv)


def command(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    config = LoaderConfig.from_file(args.config)
    log = parse_log(args.log)
    series = mix_series(log, config, source_names(config), args.log)
    title = args.title or (f"Per-source share per global step (B = {series.batch_size}) vs schedule target\n"
                           f"{os.path.basename(args.log)}, config {os.path.basename(args.config)}")
    save_figure(mix_figure(series, title), args.output)
    print(f"wrote {args.output}: {len(series.names)} sources over steps {series.steps[0]}..{series.steps[-1]}, "
          f"schedule changes at {series.change_steps or 'no step in range'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
