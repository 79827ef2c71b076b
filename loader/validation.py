"""Declarative field validation: one rule per field, checked in one place, all bad fields at once.

A record (a frozen dataclass such as :class:`loader.config.LoaderConfig`) declares a table
``FIELD_RULES = {field name: rule}``. A rule states what the field accepts (its
``expected`` text goes into the message verbatim) and returns the value's stored form (a
list of names becomes a tuple, a table becomes the nested record). :func:`check_record`
applies a record's rules to a mapping and collects one problem per bad field, named by its
path and showing the value::

    config.toml: add_eos must be true or false: a TOML/JSON boolean, not a string or a number
    (got 'false'); datasets[1].weight must be a finite number >= 0 (got nan)

so a config with three mistakes is fixed in one round. A field missing from the table gets
the rule of its annotation (``bool``, ``int``, ``float``, ``str``, ``Optional[...]`` of
those), so a field added later is type-checked even before someone writes its range.

The rules are strict on purpose: TOML and JSON have real booleans, integers and floats, and
a string ``"false"`` where a boolean belongs is truthy in Python (it would turn the option
*on*). Integers are never booleans or floats, numbers are never NaN or infinite.

The same engine checks the records of a checkpoint (``loader.checkpoint.records``): a record
type declares its keys, and its parser reads each value with the JSON-value checks at the end of
this module (:func:`fields_of`, :func:`json_int`, ...), reporting to the same :class:`Problems`
(``path: what is wrong (got value)``, up to a ``limit`` of them listed).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import typing
from collections import Counter
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, NoReturn, Optional, Sequence

import numpy as np

_SHOWN_CHARS = 80  # a value's repr in a message is cut here (a 10 MB string must not become the message)


def show(value: Any) -> str:
    """The value as the message shows it: its repr, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 5] + " ...)"


def child(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class Problems:
    """The problems found in one record, in field order; each names its field's path.

    ``count`` counts every problem; ``items`` lists the first ``limit`` of them (all without one)."""

    def __init__(self, limit: Optional[int] = None) -> None:
        self.items: list[str] = []
        self.count = 0
        self.limit = limit

    def bad(self, path: str, value: Any, expected: str, hint: str = "") -> None:
        self.add(f"{path} must be {expected} (got {show(value)})" + (f"; {hint}" if hint else ""))

    def at(self, path: str, message: str) -> None:
        """``path: message`` (a checkpoint record's form; the empty path is the whole state)."""
        self.add(f"{path or '(the state)'}: {message}")

    def add(self, text: str) -> None:
        self.count += 1
        if self.limit is None or len(self.items) < self.limit:
            self.items.append(text)

    def __bool__(self) -> bool:
        return bool(self.count)


def fail(error: type[Exception], where: str, problems: Sequence[str]) -> NoReturn:
    """Raise ``error`` listing every problem on one line; ``.problems`` keeps them for re-prefixing."""
    exc = error(f"{where}: " + "; ".join(problems))
    exc.problems = list(problems)  # type: ignore[attr-defined]
    raise exc


# -- rules --------------------------------------------------------------------------------
class Rule:
    """What one field accepts. ``check`` returns the stored form, or adds a problem."""

    expected: str = "a valid value"
    hint: str = ""  # the fix appended to the problem, for rules that name one (OrAbsent keeps it)

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Boolean(Rule):
    expected: str = "true or false: a TOML/JSON boolean, not a string or a number"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if not isinstance(value, bool):
            problems.bad(path, value, self.expected)
        return value


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class Integer(Rule):
    minimum: Optional[int] = None
    hint: str = ""  # the fix, appended to the problem

    @property
    def expected(self) -> str:  # type: ignore[override]
        return "an integer" + (f" >= {self.minimum}" if self.minimum is not None else "")

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if not _is_integer(value) or (self.minimum is not None and value < self.minimum):
            problems.bad(path, value, self.expected, self.hint)
            return value
        return int(value)  # numpy integers become ints (they would not serialise to JSON)


@dataclass(frozen=True)
class Number(Rule):
    """A finite real number (an integer counts), bounded below by ``minimum``."""

    minimum: Optional[float] = None
    exclusive: bool = False  # True: strictly greater than ``minimum``
    hint: str = ""  # the fix or the reason, appended to the problem

    @property
    def expected(self) -> str:  # type: ignore[override]
        bound = "" if self.minimum is None else f" {'>' if self.exclusive else '>='} {self.minimum:g}"
        return f"a finite number{bound}"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and (
            isinstance(value, numbers.Integral) or math.isfinite(value))  # a huge int overflows isfinite
        if ok and self.minimum is not None:
            ok = value > self.minimum if self.exclusive else value >= self.minimum
        if not ok:
            problems.bad(path, value, self.expected, self.hint)
        return value


@dataclass(frozen=True)
class Text(Rule):
    """A non-empty string, one of ``choices`` when given."""

    choices: Optional[tuple[str, ...]] = None

    @property
    def expected(self) -> str:  # type: ignore[override]
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return "a non-empty string"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        ok = isinstance(value, str) and bool(value)
        if ok and self.choices is not None:
            ok = value in self.choices
        if not ok:
            problems.bad(path, value, self.expected)
        return value


@dataclass(frozen=True)
class FilePath(Rule):
    """A non-empty path string (local, ``gs://`` or ``s3://``); an ``os.PathLike`` is stored as its string."""

    expected: str = "a non-empty path string (local, gs:// or s3://)"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value:
            problems.bad(path, value, self.expected)
        return value


@dataclass(frozen=True)
class OrAbsent(Rule):
    """``None`` (absent in TOML, ``null`` in JSON) or what ``inner`` accepts."""

    inner: Rule

    @property
    def expected(self) -> str:  # type: ignore[override]
        return f"{self.inner.expected}, or absent"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if value is None:
            return None
        scratch = Problems()  # the inner rule's problem, restated with "or absent"
        stored = self.inner.check(value, path, scratch)
        if scratch:
            problems.bad(path, value, self.expected, self.inner.hint)
        return stored


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


@dataclass(frozen=True)
class Names(Rule):
    """A list of distinct names from ``choices`` that holds every name of ``required``; stored as a tuple."""

    choices: tuple[str, ...]
    required: tuple[str, ...] = ()

    @property
    def expected(self) -> str:  # type: ignore[override]
        text = f"a list of names from {list(self.choices)}"
        if self.required:
            text += f" that includes {', '.join(repr(r) for r in self.required)}"
        return text + ", each at most once"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if not _is_list(value) or not all(isinstance(v, str) for v in value):
            problems.bad(path, value, self.expected)
            return value
        unknown = [v for v in value if v not in self.choices]
        missing = [r for r in self.required if r not in value]
        repeated = sorted(name for name, count in Counter(value).items() if count > 1)
        if unknown or missing or repeated:
            details = [f"{label} {names}" for label, names in
                       (("unknown:", unknown), ("missing:", missing), ("repeated:", repeated)) if names]
            problems.bad(path, value, self.expected, ", ".join(details))
            return value
        return tuple(value)


@dataclass(frozen=True)
class Weights(Rule):
    """A table of name -> finite number >= 0 with a positive sum; stored as a dict."""

    expected: str = "a table of source name -> finite number >= 0 with a positive sum (at least one weight > 0)"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) and k for k in value):
            problems.bad(path, value, self.expected)
            return value
        before = problems.count
        weight = Number(minimum=0)
        for name, number in value.items():
            weight.check(number, child(path, name), problems)
        if problems.count == before and not any(number > 0 for number in value.values()):
            problems.bad(path, value, self.expected)
        return dict(value)


def _is_json_value(value: Any) -> bool:
    if value is None or isinstance(value, (str, bool)) or _is_integer(value):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if _is_list(value):
        return all(_is_json_value(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_json_value(v) for k, v in value.items())
    return False


@dataclass(frozen=True)
class JsonTable(Rule):
    """A table of name -> JSON value (strings, finite numbers, booleans, lists, tables); a dict."""

    expected: str = "a table of name -> JSON value (string, finite number, boolean, list or table)"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if not isinstance(value, Mapping) or not _is_json_value(value):
            problems.bad(path, value, self.expected)
            return value
        return dict(value)


@dataclass(frozen=True)
class ListOf(Rule):
    """A list (TOML array, JSON array) of ``item``; stored as a tuple."""

    item: Rule
    min_items: int = 0
    example: str = ""  # shown when the list is too short

    @property
    def expected(self) -> str:  # type: ignore[override]
        text = f"a list of {self.item.expected}"
        if self.min_items:
            text += f" with at least {self.min_items} item(s)"
        return text + (f", e.g. {self.example}" if self.example else "")

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if not _is_list(value) or len(value) < self.min_items:
            problems.bad(path, value, self.expected)
            return value
        return tuple(self.item.check(v, f"{path}[{k}]", problems) for k, v in enumerate(value))


@dataclass(frozen=True)
class Record(Rule):
    """A table checked against a record's rules and built into it (an instance is taken as is)."""

    record: type

    @property
    def expected(self) -> str:  # type: ignore[override]
        return "a table with " + ", ".join(f.name for f in fields(self.record))

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if isinstance(value, self.record):
            return value  # validated when it was built
        if not isinstance(value, Mapping):
            problems.bad(path, value, self.expected)
            return value
        before = problems.count
        stored = check_record(self.record, value, path, problems)
        if problems.count > before:
            return value
        try:
            return self.record(**stored)
        except ValueError as exc:  # the record's own cross-field checks
            for item in getattr(exc, "problems", [str(exc)]):
                problems.add(f"{path}: {item}")
            return value


@dataclass(frozen=True)
class SubTable(Rule):
    """A table of some of a record's fields (all optional), checked by that record's rules; a dict.

    ``record`` is a function returning the class, so the record's module (and its imports)
    loads only when such a table is checked.
    """

    record: Callable[[], type]
    exclude: Callable[[], frozenset[str]] = frozenset
    note: str = ""  # appended to an unknown-field problem

    @property
    def expected(self) -> str:  # type: ignore[override]
        return "a table of " + ", ".join(sorted(self._rules()))

    def _rules(self) -> dict[str, Rule]:
        excluded = self.exclude()
        return {name: rule for name, rule in field_rules(self.record()).items() if name not in excluded}

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if not isinstance(value, Mapping):
            problems.bad(path, value, self.expected)
            return value
        rules = self._rules()
        unknown = sorted(str(k) for k in set(value) - set(rules))
        if unknown:
            problems.add(f"{path}: unknown field(s) {unknown}; valid: {sorted(rules)}" + (f" ({self.note})" if self.note else ""))
        return {name: rules[name].check(v, child(path, name), problems) if name in rules else v
                for name, v in value.items()}


# -- records ------------------------------------------------------------------------------
def _rule_of_annotation(annotation: Any) -> Optional[Rule]:
    """The default rule of a plain annotation (``bool``, ``int``, ``float``, ``str``, optional)."""
    simple = {bool: Boolean(), int: Integer(), float: Number(), str: Text()}
    if annotation in simple:
        return simple[annotation]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and len(args) == 2 and type(None) in args:
        inner = _rule_of_annotation(next(a for a in args if a is not type(None)))
        return OrAbsent(inner) if inner is not None else None
    return None


@functools.cache
def field_rules(record: type) -> dict[str, Rule]:
    """Every field's rule: the record's ``FIELD_RULES`` entry, else its annotation's."""
    table: dict[str, Rule] = dict(getattr(record, "FIELD_RULES", {}))
    hints = typing.get_type_hints(record)
    rules = {}
    for f in fields(record):
        rule = table.get(f.name) or _rule_of_annotation(hints.get(f.name))
        if rule is None:
            raise TypeError(f"{record.__name__}.{f.name}: no validation rule; add it to {record.__name__}.FIELD_RULES")
        rules[f.name] = rule
    return rules


def required_fields(record: type) -> list[str]:
    return [f.name for f in fields(record) if f.default is MISSING and f.default_factory is MISSING]


def check_record(record: type, data: Mapping[str, Any], path: str, problems: Problems) -> dict[str, Any]:
    """The stored form of every field of ``data``; unknown, missing and bad fields go to ``problems``."""
    rules = field_rules(record)
    unknown = sorted(str(k) for k in set(data) - set(rules))
    if unknown:
        problems.add(f"{path or 'config'}: unknown field(s) {unknown}; valid fields: {sorted(rules)}")
    for name in required_fields(record):
        if name not in data:
            problems.add(f"{child(path, name)} is required: it must be {rules[name].expected}")
    return {name: rules[name].check(data[name], child(path, name), problems) for name in rules if name in data}


def validate_instance(instance: Any, error: type[Exception], where: str) -> None:
    """Check every field of a just-built dataclass and store the normalised values (frozen too)."""
    values = {f.name: getattr(instance, f.name) for f in fields(instance)}
    problems = Problems()
    stored = check_record(type(instance), values, "", problems)
    if problems:
        fail(error, where, problems.items)
    for name, value in stored.items():
        if value is not values[name]:
            object.__setattr__(instance, name, value)


# -- JSON values (checkpoint records) ---------------------------------------------------------
# A checkpoint is JSON written by Zephon, or an in-memory state that ``get_state`` made (numpy
# integers and arrays where the JSON has integers and lists): each check accepts both.
def type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def fields_of(value: Any, path: str, required: tuple[str, ...], problems: Problems,
              optional: tuple[str, ...] = ()) -> Optional[dict]:
    """``value`` as an object with exactly these keys (``optional`` ones may be absent), else None."""
    if not isinstance(value, dict):
        problems.at(path, f"must be an object with keys {list(required)} (got {type_name(value)} {show(value)})")
        return None
    ok = True
    for name in required:
        if name not in value:
            problems.at(child(path, name), "missing")
            ok = False
    for name in value:
        if name not in required and name not in optional:
            problems.at(child(path, str(name)), f"unknown key (expected only {list(required + optional)})")
            ok = False
    return value if ok else None


def json_int(value: Any, path: str, problems: Problems, low: Optional[int] = 0,
             high: Optional[int] = None) -> Optional[int]:
    """An integer (not a bool) in ``[low, high]``."""
    if type(value) is not int:
        if isinstance(value, np.integer):  # an in-memory state that was not made JSON
            value = int(value)
        else:
            problems.at(path, f"must be an integer (got {type_name(value)} {show(value)})")
            return None
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        problems.at(path, f"must be {bounds} (got {value})")
        return None
    return value


def json_bool(value: Any, path: str, problems: Problems) -> Optional[bool]:
    if type(value) is not bool and not isinstance(value, np.bool_):
        problems.at(path, f"must be true or false (got {type_name(value)} {show(value)})")
        return None
    return bool(value)


def json_str(value: Any, path: str, problems: Problems, choices: Optional[tuple] = None) -> Optional[str]:
    if not isinstance(value, str):
        problems.at(path, f"must be a string (got {type_name(value)} {show(value)})")
        return None
    if choices is not None and value not in choices:
        problems.at(path, f"must be one of {list(choices)} (got {value!r})")
        return None
    return value


def int_list(value: Any, path: str, problems: Problems) -> Optional[list]:
    """A list of integers (not bools); the first few bad items are named."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.ndim == 1:
        return value  # an in-memory state (get_state keeps bins as arrays)
    if not isinstance(value, list):
        problems.at(path, f"must be a list of integers (got {type_name(value)} {show(value)})")
        return None
    if value and set(map(type, value)) != {int}:  # a C-speed type scan: bools and floats are out
        bad = 0
        for k, item in enumerate(value):
            if type(item) is not int:
                problems.at(f"{path}[{k}]", f"must be an integer (got {type_name(item)} {show(item)})")
                bad += 1
                if bad == 3:
                    break
        return None
    return value


def id_array(value: Any, path: str, problems: Problems) -> Optional[np.ndarray]:
    """A list of integers (not bools) as an int64 array: token ids and their sources.

    One inferred conversion does the type check (floats, strings, nulls or nested lists do
    not make an integer array) except for bools, which numpy turns into 0 and 1 among
    integers: only the items that came out 0 or 1 are looked at. A type scan of every item
    cost more than the conversion itself (tens of ms for a restore's bins)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.ndim == 1:
        return value.astype(np.int64, copy=False)  # an in-memory state (get_state keeps bins as arrays)
    if not isinstance(value, list):
        problems.at(path, f"must be a list of integers (got {type_name(value)} {show(value)})")
        return None
    if not value:
        return np.zeros(0, dtype=np.int64)
    try:
        array = np.array(value)
    except (ValueError, OverflowError):  # ragged nesting
        array = None
    if array is not None and array.dtype.kind == "i" and array.ndim == 1:
        zero_or_one = np.flatnonzero((array == 0) | (array == 1)).tolist()
        if not any(type(value[k]) is bool for k in zero_or_one):
            return array.astype(np.int64, copy=False)
    if int_list(value, path, problems) is None:  # names the first bad items
        return None
    k = next(k for k, v in enumerate(value) if not -(1 << 63) <= v < (1 << 63))
    problems.at(f"{path}[{k}]", f"is beyond the int64 range (got {show(value[k])})")
    return None
