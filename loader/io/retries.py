"""Retries with a budget: the one loop every remote backend runs its requests through.

A backend supplies two classifiers: ``is_transient(exc)`` (retry it) and
``permanent_error(obj, action, exc)`` (the :class:`StorageError` to raise instead, naming the
object and the fix). Everything else is shared, so ``gs://`` and ``s3://`` spend the same
budget the same way (:class:`loader.io.storage_options.StorageOptions`, ``retry_*``).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from loader.errors import StorageError
from loader.io.storage_options import StorageOptions

log = logging.getLogger(__name__)
T = TypeVar("T")

# HTTP statuses worth another attempt on every object store: timeouts, throttling, server errors.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class TruncatedRead(IOError):
    """A response body shorter than the bytes asked for (transient: retried)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: sleep ~ U(0, min(max, initial * 2**retry)).

    Full jitter (rather than a fixed or +-x% delay) spreads the retries of many workers hit
    by the same 429/503 over the whole interval, so they do not come back in lockstep.
    """

    max_attempts: int
    initial_backoff_s: float
    max_backoff_s: float
    deadline_s: float
    timeout_s: float

    @classmethod
    def from_options(cls, options: StorageOptions) -> "RetryPolicy":
        return cls(
            max_attempts=options.retry_max_attempts,
            initial_backoff_s=options.retry_initial_backoff_s,
            max_backoff_s=options.retry_max_backoff_s,
            deadline_s=options.retry_deadline_s,
            timeout_s=options.request_timeout_s,
        )

    @property
    def timeout(self) -> tuple[float, float]:
        return (min(10.0, self.timeout_s), self.timeout_s)  # (connect, read)

    def backoff_s(self, retry_index: int) -> float:
        return random.uniform(0.0, min(self.max_backoff_s, self.initial_backoff_s * 2**retry_index))


def run_with_retries(obj: str, action: str, fn: Callable[[], T], policy: RetryPolicy, *,
                     is_transient: Callable[[BaseException], bool],
                     permanent_error: Callable[[str, str, BaseException], StorageError]) -> T:
    """``fn()``, retried on transient errors within ``policy``; a StorageError otherwise.

    No new attempt starts once ``deadline_s`` would be passed by its backoff, so a run never
    waits longer than the deadline plus one request (``request_timeout_s``).
    """
    start = time.monotonic()
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return fn()
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not is_transient(exc):
                raise permanent_error(obj, action, exc) from exc
            elapsed = time.monotonic() - start
            delay = policy.backoff_s(attempt - 1)
            if attempt == policy.max_attempts or elapsed + delay > policy.deadline_s:
                raise StorageError(
                    f"{obj}: cannot {action}: still failing after {attempt} attempts in "
                    f"{elapsed:.1f}s (last error: {exc!r:.300}). The retry budget "
                    f"(retry_max_attempts={policy.max_attempts}, retry_deadline_s="
                    f"{policy.deadline_s}) is spent: check the network and the bucket's "
                    "status, or raise the budget in StorageOptions."
                ) from exc
            log.warning(
                "%s: %s failed (attempt %d/%d: %r); retrying in %.2fs",
                obj, action, attempt, policy.max_attempts, exc, delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # the loop always returns or raises
