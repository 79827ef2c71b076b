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


class RecordRejected(ZephonError, ValueError):
    """One input record refused for a named reason; the pipeline counts and skips it.

    Subclasses name their stable reasons in ``REASONS`` (the names manifests and metrics count
    by); ``detail`` says what is wrong where, so the record can be fixed at its source.
    """

    REASONS: tuple[str, ...] = ()

    def __init__(self, reason: str, detail: str):
        if reason not in self.REASONS:
            raise ValueError(f"unknown reject reason {reason!r} for {type(self).__name__}; known: {', '.join(self.REASONS)}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self):
        # Beam and worker processes pickle exceptions; rebuild from both fields, not from args.
        return (type(self), (self.reason, self.detail))


class SharedMemoryError(ZephonError, OSError):
    """Shared memory (``/dev/shm``) too small for the loader workers' segments; the message says
    how much is free and needed, and the fix (a larger ``/dev/shm``, fewer workers or prefetch)."""
