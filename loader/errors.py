"""The root of Zephon's exception types.

Every error Zephon raises for something a user handed it (input records, lane files,
manifests, checkpoint state, configs, command-line arguments) or for a failed worker is a
:class:`ZephonError`, so a caller can tell "your data / state / config is wrong" from a bug.
Each concrete type also derives from the builtin that fits (``ValueError``, ``IOError``,
``RuntimeError``), so existing ``except ValueError`` code keeps working.

The CLI prints a ``ZephonError`` as one ``zephon <command>: error: ...`` line; anything
else is a bug and keeps its traceback.

Every exception type of ``loader/`` and ``beam_jobs/`` is defined here, and this module imports
nothing of the project, so any module can raise any of them without an import cycle. The
modules that raise them also re-export them (``from loader.config import ConfigError`` keeps
working). The one exception: a kind's record reject (a :class:`RecordRejected` subclass) lives
beside the tuple of reason names it checks, which belongs to that kind.
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


# -- Configuration and the data-parallel layout --------------------------------------------
class ConfigError(ZephonError, ValueError):
    """A loader configuration value that cannot work; the message names the field."""

    exit_code = 2  # the CLI's usage-error status


class TopologyError(ZephonError, ValueError):
    """A world size, batch size or micro-batch size that the lane layout cannot serve."""

    exit_code = 2  # the CLI's usage-error status


class TokenizerError(ZephonError, ValueError):
    """A tokenizer file that cannot be loaded or lacks a needed special token."""

    exit_code = 2  # the CLI's usage-error status: the tokenizer named cannot be used


class TransformError(ZephonError, ValueError):
    """A transform that cannot be used: not importable, not deterministic, or a bad result.

    The message names the function (``module:function``), where it is configured and, for a
    result, the document key.
    """

    exit_code = 2  # a usage error: the config (or --transform) names something unusable


# -- Datasets on disk: manifests, lane files, storage --------------------------------------
class ManifestError(ZephonError, ValueError):
    """A manifest that is missing, malformed, or does not match what it is used with."""


class LaneDataError(ZephonError, RuntimeError):
    """A lane file whose content cannot be used; the message names the file and the fix."""


class EmptyLaneError(LaneDataError):
    """A lane left without a token for a whole epoch: every document rejected or dropped."""


class StorageError(ZephonError, IOError):
    """A lane file that cannot be read correctly; the message names the object."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist (``except FileNotFoundError`` catches it too)."""


# -- Checkpoint state ----------------------------------------------------------------------
class UnsupportedSchemeError(StorageError, ValueError):
    """A path whose ``scheme://`` no storage backend is registered for."""

    exit_code = 2  # a path the user typed or configured


class StateError(ZephonError, ValueError):
    """A checkpoint that cannot be loaded here; the message names what differs."""

    exit_code = 2  # the CLI's usage-error status: the state file given cannot be used


class OriginError(ZephonError, ValueError):
    """A checkpoint's best-fit piece origin that does not match the dataset."""

    exit_code = 2


# -- Chat and image options ----------------------------------------------------------------
# (a kind's record rejects, RecordRejected subclasses, live beside the reason names they
# check: loader.chat.conversations, loader.vision.reasons, loader.vision.chat)
class ChatOptionError(ZephonError, ValueError):
    """A chat encoding option with a value outside its choices (the message lists them)."""

    exit_code = 2  # usage: the option as typed or configured is wrong


class ChatTemplateError(ZephonError, ValueError):
    """A chat template file or tokenizer config that cannot be used (the message names it and the fix)."""

    exit_code = 2  # the CLI's usage-error status: the --chat-template named cannot be used


class ChatConfigError(ConfigError):
    """A chat source that cannot be used with this loader config (the message says the fix)."""


class ImagePolicyError(ZephonError, ValueError):
    """An image-processing policy config that cannot work; the message names the field."""

    exit_code = 2


# -- The loader runtime --------------------------------------------------------------------
class ModelInputsError(ZephonError, ValueError):
    """A ``model_inputs`` layout that cannot lay out this loader's batches; names the field and the fix."""

    exit_code = 2


class WorkerError(ZephonError, RuntimeError):
    """A loader worker process failed; the message carries its traceback."""


class LaneExhausted(Exception):
    """Every source of the lane has stopped: the lane produces nothing more."""


# -- Commands and trainer integrations -----------------------------------------------------
class AuditError(ZephonError, ValueError):
    """A step ``zephon audit`` cannot reconstruct as asked; the message says what to do instead."""

    exit_code = 2


class DiffError(ZephonError, ValueError):
    """Something ``zephon diff`` was handed cannot be compared (exit status 2, never 1)."""

    exit_code = 2  # zephon diff: 0 identical, 1 different, 2 could not compare


class PlotError(ZephonError, ValueError):
    """A plot that cannot be drawn or written (matplotlib missing, an unknown file type)."""

    exit_code = 2


class SeekIndexError(ZephonError, ValueError):
    """A seek index file that cannot be used (the message names the file and the fix)."""

    exit_code = 2


class WindowCountError(ZephonError, ValueError):
    """A packing_window count file that disagrees with the lane files it is bound to (the message
    names the file and the fix)."""

    exit_code = 2


class HFIntegrationError(ZephonError, ValueError):
    """Trainer arguments or a checkpoint that would make Trainer train on other data than Zephon's stream."""

    exit_code = 2


class LightningIntegrationError(ZephonError, RuntimeError):
    """Lightning is set up so that the model would not train on Zephon's steps; the message says the fix."""


# -- The Beam sharding job (beam_jobs) -----------------------------------------------------
# Job-side failures carry this prefix so the launcher can find the message inside whatever
# exception the runner wraps it in (the in-process runner re-raises it, the multi-process
# runner embeds the remote traceback as text).
JOB_ERROR_PREFIX = "zephon shard: "


class InputError(ZephonError, ValueError):
    """An ``--input`` pattern or file that the sharding job cannot use."""

    exit_code = 2  # a usage error of `zephon shard`


class ImageOptionError(ZephonError, ValueError):
    """Image options of ``zephon shard`` that cannot work, named with the fix."""

    exit_code = 2


class ShardConfigError(ZephonError, ValueError):
    """Job options that cannot work together, named with the fix."""

    exit_code = 2  # a usage error of `zephon shard`


class ShardError(ZephonError, RuntimeError):
    """The job ran and failed (too many rejects, no records, a worker error)."""


class OutputExistsError(ZephonError, FileExistsError):
    """``--output`` already holds a dataset (or part of one) and ``--overwrite`` was not given."""


class ShardJobError(ZephonError, RuntimeError):
    """A failure the job raises on purpose (reject fraction, empty input), with a clear message."""

    def __init__(self, message: str):
        super().__init__(JOB_ERROR_PREFIX + message)


class SharedMemoryError(ZephonError, OSError):
    """Shared memory (``/dev/shm``) too small for the loader workers' segments; the message says
    how much is free and needed, and the fix (a larger ``/dev/shm``, fewer workers or prefetch)."""
