"""The ``zephon`` command: one entry point, one module per subcommand, one way to report errors.

Subcommands are imported lazily so that ``zephon inspect`` does not pay for importing
torch or Beam. Each subcommand module exposes ``command(argv) -> int``, which raises a
:class:`loader.errors.ZephonError` for anything the user handed it, and
``main(argv) -> int``, which is ``run_command(<name>, argv)`` (so ``python -m
beam_jobs.shard`` behaves as ``zephon shard``).

Errors are reported here, once, for every subcommand (docs/guides/reliability.md, "Command-line errors"):

- a :class:`~loader.errors.ZephonError`, or an ``OSError`` about a file the user named
  (missing, a directory, permission denied, already exists), prints exactly one line
  ``zephon <command>: error: <message>`` to stderr (a message of several lines is folded
  onto that line) and exits with the error's ``exit_code``: 2 for a usage error (options,
  config, topology, a state or tokenizer file that cannot be used), 1 for data or a job
  that failed (manifest, lane files, rejects, workers) and for file errors;
- argparse usage errors print argparse's usage synopsis and its ``<prog>: error:`` line
  and exit 2;
- anything else is a bug and keeps its traceback.

``zephon --debug <command> ...`` or ``ZEPHON_DEBUG=1`` prints the traceback of reported
errors too (above the error line).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Optional, Sequence

import loader
from loader.errors import ZephonError

# subcommand -> (module, one-line help). Each module exposes ``command(argv) -> int``.
SUBCOMMANDS = {
    "make-sample": ("loader.samples.corpus", "generate a deterministic sample corpus (JSONL, .gz, .zst, Parquet)"),
    "shard": ("beam_jobs.shard", "run the Beam sharding job: raw documents -> lane-indexed Parquet + manifest"),
    "inspect": ("beam_jobs.inspect_dataset", "summarise a sharded dataset (lanes, documents, tokens, balance, rejects)"),
    "fingerprints": ("loader.commands.fingerprints", "print one SHA-256 per global batch for a loader config (compare runs, topologies, resumes)"),
    "audit": ("loader.commands.audit", "where every token of a global step came from: documents, lane files, spans, padding"),
    "diff": ("loader.commands.diff", "first differing step of two fingerprint logs or configs, and the config/manifest fields behind it"),
    "plot-mix": ("loader.commands.plot_mix", "plot each source's share per step from a fingerprint log against the schedule's target"),
    "quickstart": ("loader.commands.quickstart", "generate sample data, shard it, inspect it and stream batches, end to end"),
}

DEBUG_FLAG = "--debug"
VERSION_FLAGS = ("--version", "-V")
DEBUG_ENV = "ZEPHON_DEBUG"
USAGE_EXIT = 2  # argparse's code too
FAILURE_EXIT = 1
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as shells report it
# OSErrors that mean "the file you named cannot be used", not a bug: reported in one line.
USER_FILE_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def one_line(message: str) -> str:
    """A message of several lines (e.g. a list of differences) folded onto one line."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


def exit_code_of(exc: BaseException) -> int:
    """2 for usage errors (the error class says ``exit_code = 2``), 1 for the rest."""
    return int(getattr(exc, "exit_code", FAILURE_EXIT))


def report(prog: str, exc: BaseException, *, debug: bool) -> int:
    """Print ``<prog>: error: <message>`` (after the traceback with ``debug``); the exit code."""
    if debug:
        traceback.print_exception(exc)
    message = one_line(str(exc)) or type(exc).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return exit_code_of(exc)


def run_command(name: str, argv: Optional[Sequence[str]] = None, *, debug: Optional[bool] = None,
                prog: Optional[str] = None) -> int:
    """Run subcommand ``name`` with ``argv``; report user errors as one line (see module doc).

    ``prog`` is the name in the error line (default ``zephon <name>``), for modules that are
    not ``zephon`` subcommands but report the same way (``python -m beam_jobs.train_tokenizer``).
    """
    module_name = SUBCOMMANDS[name][0] if name in SUBCOMMANDS else name
    prog = prog or f"zephon {name}"
    debug = debug_enabled() if debug is None else debug
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        module = importlib.import_module(module_name)
        return int(module.command(args) or 0)
    except ZephonError as exc:
        return report(prog, exc, debug=debug)
    except USER_FILE_ERRORS as exc:
        return report(prog, exc, debug=debug)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT


# What a subcommand module calls the function that builds its argparse parser.
PARSER_BUILDERS = ("build_parser", "build_arg_parser")


def parser_of(name: str):
    """Subcommand ``name``'s argparse parser (the command-line reference is generated from it)."""
    module = importlib.import_module(SUBCOMMANDS[name][0])
    for builder in PARSER_BUILDERS:
        if hasattr(module, builder):
            return getattr(module, builder)()
    raise AttributeError(f"{module.__name__} defines none of {PARSER_BUILDERS}")


def _usage() -> str:
    lines = [f"usage: zephon [{DEBUG_FLAG}] <command> [options]", "       zephon --version", "", "commands:"]
    for name, (_, help_text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<14} {help_text}")
    lines.append("")
    lines.append("`zephon <command> --help` shows a command's options.")
    lines.append(f"{DEBUG_FLAG} (or {DEBUG_ENV}=1): show the traceback of an error, not only its one-line message.")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled()
    while args and args[0] == DEBUG_FLAG:
        debug = True
        args.pop(0)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else USAGE_EXIT
    if args[0] in VERSION_FLAGS:
        print(f"zephon {loader.__version__} ({loader.DISTRIBUTION})")
        return 0
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"zephon: error: unknown command {command!r}; commands: {', '.join(SUBCOMMANDS)} "
              "(`zephon --help` describes them)", file=sys.stderr)
        return USAGE_EXIT
    return run_command(command, rest, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
