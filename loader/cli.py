"""The ``zephon`` command: one entry point, one module per subcommand.

Subcommands are imported lazily so that ``zephon inspect`` does not pay for importing
torch or Beam.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

# subcommand -> (module, one-line help). Each module exposes ``main(argv) -> int``.
SUBCOMMANDS = {
    "make-sample": ("beam_jobs.sample_data", "generate a deterministic sample corpus (JSONL, .gz, .zst, Parquet)"),
    "shard": ("beam_jobs.shard", "run the Beam sharding job: raw documents -> lane-indexed Parquet + manifest"),
    "inspect": ("beam_jobs.inspect_dataset", "summarise a sharded dataset (lanes, documents, tokens, balance, rejects)"),
    "fingerprints": ("loader.fingerprints", "print one SHA-256 per global batch for a loader config (the audit command)"),
    "quickstart": ("loader.quickstart", "generate sample data, shard it, inspect it and stream batches, end to end"),
}


def _usage() -> str:
    lines = ["usage: zephon <command> [options]", "", "commands:"]
    for name, (_, help_text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<14} {help_text}")
    lines.append("")
    lines.append("`zephon <command> --help` shows a command's options.")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"zephon: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
