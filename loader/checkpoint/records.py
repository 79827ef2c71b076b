"""The stage protocol and the registry of checkpoint records: the bottom of a checkpoint's shape.

Every stateful stage (a lane stream, a token mix, a packer, a lane) follows one protocol,
:class:`Stateful`, as torchdata's ``nodes`` do::

    get_state() -> dict          JSON values (numpy arrays and integers until saved)
    set_state(state, path)       continue from a state the schema checked; ``path`` is its JSON
                                 path, named by the checks that need the data

Its state's keys are module-level constants of the stage's record module, and a child's state
nests under its key (a lane's packers under ``sources.<name>.packer``, a packer's stream under
``stream``). Each stage *registers* its record (:func:`register_record`): a
:class:`RecordType` names it, gives its version, its keys and its parser (shape and types,
reported to a :class:`~loader.validation.Problems` by JSON path, built into a frozen typed
record). The checkpoint schema (:mod:`loader.checkpoint.schema`) assembles a lane from the
registry (``lane`` -> the packer record of the config's packing -> ``cursor`` or
``mixed_stream``) and checks the ranges that need the dataset. A record whose JSON carries its
own version (the windowed packer's ``window``) migrates an older one with its ``migrations``.

The records registered (module -> record): :mod:`loader.io.cursor_record` ``cursor``,
:mod:`loader.stages.mixed_record` ``mixed_stream``, :mod:`loader.stages.packer_records`
``concat``, ``best_fit``, ``best_fit_window``, :mod:`loader.stages.lane_record` ``lane``.
This module imports nothing of the project but the validation engine and the error types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, runtime_checkable

from loader.errors import StateError
from loader.registry import Registry
from loader.validation import Problems, fields_of

MAX_REPORTED = 20  # bad fields listed in one error; the count of the rest is given


def lane_key(lane_id: int) -> str:
    """A lane's key in a state's ``lanes`` ("00017")."""
    return f"{lane_id:05d}"


@runtime_checkable
class Stateful(Protocol):
    """A stage whose position a checkpoint holds (module docstring)."""

    def get_state(self) -> dict: ...

    def set_state(self, state: dict, path: str) -> None: ...


class StateSnapshot:
    """A stage's state taken at one moment, turned into its ``get_state()`` dict on demand
    (``build(*args)``): what a stage hands out where the state is rarely saved (every step
    boundary, every item a worker ships), so that the dicts and arrays are built only if used."""

    __slots__ = ("_build", "_args")

    def __init__(self, build: Callable[..., dict], *args: Any) -> None:
        self._build, self._args = build, args

    def get_state(self) -> dict:
        return self._build(*self._args)


@dataclass(frozen=True)
class RecordContext:
    """What a record's parser needs to know of the state around it (from the state's header)."""

    packing: str  # "concat" or "best_fit"
    packing_window: Optional[int]  # best fit per window of documents (its own packer record)
    source_names: tuple[str, ...]
    token_mixing: bool  # one mixed stream and packer per lane

    @property
    def packer_record(self) -> str:
        """The name of the packer record a lane of this state holds."""
        return "best_fit_window" if self.packing_window is not None else self.packing


@dataclass(frozen=True)
class RecordType:
    """One kind of checkpoint record (module docstring).

    ``parse(raw, path, problems, context, **options)`` returns the typed record, or None with
    the problems reported; ``keys`` / ``optional`` are the record's JSON keys (``fields`` checks
    them). ``version`` is the record's current version; ``migrations`` maps an older version to
    the step that makes a record of it the next version (versions read: :attr:`readable`)."""

    name: str
    version: int
    keys: tuple[str, ...]
    parse: Callable[..., Any]
    optional: tuple[str, ...] = ()
    migrations: Mapping[int, Callable[[dict], dict]] = field(default_factory=dict)

    @property
    def readable(self) -> tuple[int, ...]:
        """The versions of this record this Zephon reads (older ones through ``migrations``)."""
        return tuple(range(min(self.migrations, default=self.version), self.version + 1))

    def fields(self, raw: Any, path: str, problems: Problems, required: Optional[tuple[str, ...]] = None) -> Optional[dict]:
        """``raw`` as this record's object: every key present, none unknown (else None)."""
        return fields_of(raw, path, self.keys if required is None else required, problems, optional=self.optional)

    def upgrade(self, raw: dict, version: int) -> dict:
        """A record of an older readable ``version`` as the current one."""
        while version < self.version:
            raw = self.migrations[version](raw)
            version += 1
        return raw

    def __call__(self, raw: Any, path: str, problems: Problems, context: RecordContext, **options: Any) -> Any:
        return self.parse(raw, path, problems, context, **options)


_RECORDS: Registry[RecordType] = Registry("checkpoint record", "import the stage module that registers it")


def register_record(record: RecordType) -> RecordType:
    """Add a stage's record type (its name must be new); returns it."""
    return _RECORDS.register(record.name, record)


def record_type(name: str) -> RecordType:
    """The registered record ``name``; the stage modules register theirs on import."""
    return _RECORDS.lookup(name, StateError)


def registered_records() -> tuple[RecordType, ...]:
    return _RECORDS.values()


class StateProblems(Problems):
    """A checkpoint's bad fields, the first :data:`MAX_REPORTED` listed; :meth:`raise_if_any`
    reports them all in one :class:`~loader.errors.StateError`."""

    def __init__(self) -> None:
        super().__init__(limit=MAX_REPORTED)

    def raise_if_any(self, what: str = "the loader state") -> None:
        if not self.count:
            return
        more = f"\n  ... and {self.count - len(self.items)} more" if self.count > len(self.items) else ""
        raise StateError(
            f"{what} is invalid ({self.count} bad field{'s' if self.count > 1 else ''}; a checkpoint "
            "must be loaded as written by Zephon, not edited):\n  - " + "\n  - ".join(self.items) + more
        )
