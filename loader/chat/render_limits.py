"""Bounds on a chat template's render: determinism, time, output size and memory.

A chat template is a user-supplied program run once per conversation, in the Beam job and in
the loader; its render must be a function of the conversation and the template alone, and end.
transformers renders with no bound; here (docs/guides/what-is-checked.md):

* **No clock.** ``strftime_now`` is offered as *undefined*: a template that guards it
  (``{% if strftime_now is defined %}``, as Llama 3's does) takes its own fixed fallback; one
  that calls it anyway gets a ``ChatTemplateError`` naming the template and the fix (write
  the date in the template, or pass it as a variable). transformers formats today's date, so two runs of one
  config would differ.
* **Bounded work.** ``range`` draws from a budget of :data:`MAX_LOOP_ITERATIONS` per render
  (the sandbox bounds one range at 100,000 but not a loop nested in another), and a render
  that passes :data:`MAX_RENDER_SECONDS` stops at its next loop step or output chunk.
* **Bounded size.** ``*`` and ``**`` refuse results past :data:`MAX_RENDER_CHARS` characters
  or :data:`MAX_POWER_DIGITS` digits before computing them (``{{ "x" * 10**10 }}``), and the
  text rendered so far may not pass :data:`MAX_RENDER_CHARS`.
* ``MemoryError`` and ``RecursionError`` (a recursive macro) become ``ChatTemplateError``.

Every limit is an error of the template (a configuration error, raised, never a reject of one
record): whatever one conversation makes it do, the next can make it do too.
"""

from __future__ import annotations

import operator
import time
from contextvars import ContextVar
from typing import Any, Callable, Iterable, Iterator

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_SECONDS = 10.0  # one conversation's render; a real template takes well under a millisecond
MAX_RENDER_CHARS = 16 * 2**20  # characters of one render (and of one string a template builds)
MAX_LOOP_ITERATIONS = 1_000_000  # range() steps of one render, nested loops included
MAX_POWER_DIGITS = 4_300  # an int ** int result's digits (CPython's own int/str conversion limit)
_CHECK_EVERY = 1024  # range() steps between two clock reads


class _LimitExceeded(Exception):
    """A bound passed inside a render; :func:`run_bounded` raises it as the caller's error type.
    Not a ``TemplateError``/``ValueError``: the chat encoder must not count it as one record's reject."""


class _Budget:
    __slots__ = ("deadline", "steps")

    def __init__(self) -> None:
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self.steps = 0

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitExceeded(f"rendering one conversation took more than {MAX_RENDER_SECONDS:g} s "
                                    "(a loop that never ends?); fix the template")


_budget: ContextVar = ContextVar("zephon_render_budget", default=None)


class _ClockUndefined(jinja2.Undefined):
    """``strftime_now``: not defined (``is defined`` is false), and an error when called."""

    def _fail_with_undefined_error(self, *args, **kwargs):  # what calling (or printing) an Undefined does
        raise _LimitExceeded(
            "it calls strftime_now, which reads the clock: two runs of one config would render different "
            "text. Guard it ({% if strftime_now is defined %}), or write the date in the template "
            "({% set date_string = \"1 Jan 2025\" %}) or pass it as a variable (extra_variables)")


def _budgeted_range(*args) -> "_CountedRange":
    values = range(*args)
    if len(values) > MAX_LOOP_ITERATIONS:
        raise _LimitExceeded(f"range{args} has {len(values):,} steps, more than a render may take "
                             f"({MAX_LOOP_ITERATIONS:,}); fix the template")
    return _CountedRange(values)


class _CountedRange:
    """A ``range`` whose iteration draws from the render's budget (``len``, indexing and ``in`` as a range's)."""

    __slots__ = ("values",)

    def __init__(self, values: range) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index):
        return self.values[index]

    def __contains__(self, value) -> bool:
        return value in self.values

    def __iter__(self) -> Iterator[int]:
        budget = _budget.get()
        for value in self.values:
            if budget is not None:
                budget.steps += 1
                if budget.steps > MAX_LOOP_ITERATIONS:
                    raise _LimitExceeded(f"one render took more than {MAX_LOOP_ITERATIONS:,} loop steps (nested "
                                         "loops?); fix the template")
                if not budget.steps % _CHECK_EVERY:
                    budget.check_time()
            yield value


def _checked_multiply(left: Any, right: Any) -> Any:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * max(times, 0) > MAX_RENDER_CHARS:
            raise _LimitExceeded(f"a chat template builds a {type(seq).__name__} of {len(seq) * times:,} items "
                                    f"(more than {MAX_RENDER_CHARS:,}); fix the template")
    return operator.mul(left, right)


def _checked_power(left: Any, right: Any) -> Any:
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        digits = right * len(str(abs(left)))
        if digits > MAX_POWER_DIGITS:
            raise _LimitExceeded(f"a chat template computes {left} ** {right} (about {digits:,} digits, more than "
                                    f"{MAX_POWER_DIGITS:,}); fix the template")
    return operator.pow(left, right)


_BINOPS: dict[str, Callable[[Any, Any], Any]] = {"*": _checked_multiply, "**": _checked_power}


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the bounds of the module docstring on ``*``, ``**`` and ``range``."""

    intercepted_binops = frozenset(_BINOPS)

    def call_binop(self, context, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name in _BINOPS:
            return _BINOPS[operator_name](left, right)
        return super().call_binop(context, operator_name, left, right)


def install(env: BoundedEnvironment) -> None:
    """Set the module's globals on a template environment."""
    env.globals["strftime_now"] = _ClockUndefined(name="strftime_now")
    env.globals["range"] = _budgeted_range


def bounded_chunks(chunks: Iterable[str]) -> Iterator[str]:
    """``chunks`` of a render, each checked against the time and size limits."""
    budget = _budget.get()
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDER_CHARS:
            raise _LimitExceeded(f"one conversation renders to more than {MAX_RENDER_CHARS:,} characters; "
                                    "fix the template")
        if budget is not None:
            budget.check_time()
        yield chunk


def run_bounded(render: Callable[[], Any], origin: str, error: type) -> Any:
    """``render()`` under a fresh budget; a bound passed, ``MemoryError`` or ``RecursionError``
    raised as ``error`` (``ChatTemplateError``) naming ``origin``."""
    token = _budget.set(_Budget())
    try:
        return render()
    except _LimitExceeded as exc:
        raise error(f"{origin}: {exc}") from None
    except MemoryError:
        raise error(f"{origin}: rendering one conversation ran out of memory; fix the template") from None
    except RecursionError:
        raise error(f"{origin}: rendering one conversation recursed too deep (a recursive macro?); "
                    "fix the template") from None
    finally:
        _budget.reset(token)
