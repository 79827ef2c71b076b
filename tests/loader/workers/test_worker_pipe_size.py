"""A worker's message pipe holds several best-fit messages (:func:`loader.workers.child.widen_pipe`)."""

from __future__ import annotations

import fcntl
import os
from multiprocessing.connection import Connection

import pytest

from loader.workers.child import widen_pipe


@pytest.mark.skipif(not hasattr(fcntl, "F_GETPIPE_SZ"), reason="pipe sizes are a Linux fcntl")
def test_message_pipe_holds_several_best_fit_messages():
    """A best-fit message's descriptor carries ~200 KB of bin pieces; through a 64 KB pipe the
    worker waited in write() for the trainer's read of every message, so it prefetched none."""
    read_end, write_end = os.pipe()
    connection = Connection(write_end, readable=False)
    try:
        assert fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) < 1 << 20  # the default: what is widened
        widen_pipe(connection)
        assert fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) >= 1 << 20
        widen_pipe(connection, sizes=(-1,))  # refused (EINVAL): the pipe keeps its buffer, no error
        assert fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) >= 1 << 20
    finally:
        connection.close()
        os.close(read_end)
