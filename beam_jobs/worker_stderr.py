"""Beam's subprocess workers' stderr, kept out of the job's own output unless ``--debug``.

With ``--direct_running_mode=multi_processing`` the FnApiRunner starts its SDK workers as
subprocesses that inherit this process's stderr, and a worker prints every failed bundle's
whole traceback there itself (``sdk_worker._execute``: ``print(traceback, file=sys.stderr)``,
whatever the log level), about a hundred lines before the job's one ``zephon shard: error:``
line, which already names the cause. :func:`kept_aside` points file descriptor 2, which the
workers inherit, at a scratch file for the run, while this process's own writes (``sys.stderr``
and the logging handlers on it) keep going to the real stderr. ``--debug`` leaves stderr alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import Iterator, Sequence


def runs_worker_processes(pipeline_args: Sequence[str]) -> bool:
    """Whether the pipeline options start Beam workers as subprocesses of this process."""
    args = list(pipeline_args)
    for k, arg in enumerate(args):
        if arg == "--direct_running_mode=multi_processing":
            return True
        if arg == "--direct_running_mode" and k + 1 < len(args) and args[k + 1] == "multi_processing":
            return True
    return False


@contextlib.contextmanager
def kept_aside(enabled: bool) -> Iterator[None]:
    """Inside: child processes write their stderr to a scratch file (removed on the way out);
    this process writes to the real stderr as before. Nothing changes when not ``enabled``."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    real = os.fdopen(saved, "w", buffering=1, closefd=False)
    before = sys.stderr
    handlers = [h for h in logging.getLogger().handlers
                if isinstance(h, logging.StreamHandler) and h.stream is before]
    with tempfile.TemporaryFile(prefix="zephon-beam-workers-") as aside:
        os.dup2(aside.fileno(), 2)
        sys.stderr = real
        for handler in handlers:
            handler.setStream(real)
        try:
            yield
        finally:
            real.flush()
            os.dup2(saved, 2)
            sys.stderr = before
            for handler in handlers:
                handler.setStream(before)
            os.close(saved)
