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

_SHOWN_CHARS = 80  # a value's repr in a message is cut here (a 10 MB string must not become the message)


def show(value: Any) -> str:
    """The value as the message shows it: its repr, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 5] + " ...)"


def child(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class Problems:
    """The problems found in one record, in field order; each names its field's path."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def bad(self, path: str, value: Any, expected: str, hint: str = "") -> None:
        self.items.append(f"{path} must be {expected} (got {show(value)})" + (f"; {hint}" if hint else ""))

    def add(self, text: str) -> None:
        self.items.append(text)

    def __bool__(self) -> bool:
        return bool(self.items)


def fail(error: type[Exception], where: str, problems: Sequence[str]) -> NoReturn:
    """Raise ``error`` listing every problem on one line; ``.problems`` keeps them for re-prefixing."""
    exc = error(f"{where}: " + "; ".join(problems))
    exc.problems = list(problems)  # type: ignore[attr-defined]
    raise exc


# -- rules --------------------------------------------------------------------------------
class Rule:
    """What one field accepts. ``check`` returns the stored form, or adds a problem."""

    expected: str = "a valid value"

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
            problems.bad(path, value, self.expected, getattr(self.inner, "hint", ""))
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
        before = len(problems.items)
        weight = Number(minimum=0)
        for name, number in value.items():
            weight.check(number, child(path, name), problems)
        if len(problems.items) == before and not any(number > 0 for number in value.values()):
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
        before = len(problems.items)
        stored = check_record(self.record, value, path, problems)
        if len(problems.items) > before:
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
