"""Flex Template entry point of the sharding job (``FLEX_TEMPLATE_PYTHON_PY_FILE``).

Dataflow's launcher runs this file with every template parameter as ``--name=value`` plus
its own pipeline options (``--project``, ``--region``, ``--temp_location``...). Template
parameter names are the job's flags with underscores (``num_lanes`` for ``--num-lanes``,
see ``metadata.json``); this translates them back, turns ``overwrite=true|false`` into the
flag, splits comma-separated lists for multi-value flags, and submits the job on Dataflow
without waiting for it: the launcher must exit for the job to start.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from beam_jobs import shard

DEFAULT_RUNNER = "--runner=DataflowRunner"


def template_parameters() -> dict[str, argparse.Action]:
    """Template parameter name -> the job's argparse action (``--num-lanes`` -> ``num_lanes``)."""
    found = {}
    for action in shard.build_parser()._actions:
        long_flags = [flag for flag in action.option_strings if flag.startswith("--") and flag != "--help"]
        if long_flags:
            found[long_flags[0][2:].replace("-", "_")] = action
    return found


def to_job_argv(argv: Sequence[str]) -> list[str]:
    """Launcher arguments -> the job's command line (non-job options pass through)."""
    parameters = template_parameters()
    job_argv: list[str] = []
    for arg in argv:
        name, sep, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        action = parameters.get(name) if sep else None
        if action is None:
            job_argv.append(arg)
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:  # store_true flags arrive as name=true / name=false
            if value.lower() not in ("true", "false"):
                raise SystemExit(f"template parameter {name} must be true or false (got {value!r})")
            job_argv += [flag] if value.lower() == "true" else []
        elif action.nargs in ("+", "*"):
            job_argv += [flag, *[part for part in value.split(",") if part]]
        else:
            job_argv.append(f"{flag}={value}")
    if not any(a == "--runner" or a.startswith("--runner=") for a in job_argv):
        job_argv.append(DEFAULT_RUNNER)
    return job_argv


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options, pipeline_args = shard.parse_args(to_job_argv(sys.argv[1:] if argv is None else argv))
    shard.run_shard(options, pipeline_args, wait=False)  # a template launcher must not block on the job
    return 0


if __name__ == "__main__":
    sys.exit(main())
