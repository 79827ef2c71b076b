"""The root of Zephon's exception types.

Every error Zephon raises for something a user handed it (input records, lane files,
manifests, checkpoint state, configs, command-line arguments) or for a failed worker is a
:class:`ZephonError`, so a caller can tell "your data / state / config is wrong" from a bug.
Each concrete type also derives from the builtin that fits (``ValueError``, ``IOError``,
``RuntimeError``), so existing ``except ValueError`` code keeps working.

The CLI prints a ``ZephonError`` as one ``zephon <command>: error: ...`` line; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ZephonError(Exception):
    """Base class of every error Zephon raises on purpose; the message names the culprit and the fix."""

    # The CLI's exit status for this error: 1 = data or a job that failed; subclasses about
    # what the user typed or configured (options, config, topology, state) say 2 = usage.
    exit_code: int = 1
