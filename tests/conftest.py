"""Suite-wide test settings: every test runs under a hang guard.

A test fails with ``TimeoutError`` after ``DEFAULT_TIMEOUT_S`` (or the seconds given by
``@pytest.mark.timeout(N)``) instead of hanging CI: loaders, worker processes, emulators
and torch.distributed ranks are exactly the things that hang when they break.
"""

from __future__ import annotations

import signal

import pytest

DEFAULT_TIMEOUT_S = 120


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "timeout(seconds): fail the test after this many seconds")


@pytest.fixture(autouse=True)
def _timeout_guard(request: pytest.FixtureRequest):
    marker = request.node.get_closest_marker("timeout")
    seconds = int(marker.args[0]) if marker else DEFAULT_TIMEOUT_S

    def on_alarm(signum, frame):
        raise TimeoutError(f"{request.node.nodeid} took longer than {seconds} s (hang?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
