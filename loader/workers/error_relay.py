"""A worker's error, re-raised in the trainer as the project exception it was.

A loader worker that fails sends ``("error", run_id, traceback text, exception)``: the
exception pickled when it is a :class:`~loader.errors.ZephonError` (a ``TransformError``, a
``LaneDataError``, an ``EmptyLaneError``...), else None. The trainer raises that same type
with its message prefixed by the worker (``loader worker 1: ...``), its ``__cause__`` a
``WorkerError`` holding the worker's traceback: code that catches ``TransformError`` catches
it with workers as without, and the CLI prints its one line. Anything else (a bug, a
``MemoryError``) stays a ``WorkerError`` carrying the traceback. The pickle comes from the
loader's own child process, as its start-up input does; user data is never unpickled.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from typing import Optional

from loader.errors import ZephonError


def error_message(run_id: int) -> tuple:
    """The message a worker sends from inside ``except``: traceback text and the exception."""
    exc = sys.exc_info()[1]
    payload: Optional[bytes] = None
    if isinstance(exc, ZephonError):
        try:
            payload = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(payload)  # an exception that does not round-trip stays a traceback
        except Exception:  # noqa: BLE001 - any failure to pickle: fall back to the text
            payload = None
    return ("error", run_id, traceback.format_exc(), payload)


def worker_exception(worker_id: int, message: tuple, worker_error: type) -> BaseException:
    """The exception the trainer raises for an ``error`` message of ``worker_id``."""
    text = message[2]
    wrapped = worker_error(f"loader worker {worker_id} failed:\n{text}")
    payload = message[3] if len(message) > 3 else None
    if payload is None:
        return wrapped
    try:
        exc = pickle.loads(payload)
    except Exception:  # noqa: BLE001 - unreadable: the traceback still says everything
        return wrapped
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"loader worker {worker_id}: {exc.args[0]}",) + tuple(exc.args[1:])
    exc.__cause__ = wrapped
    return exc
