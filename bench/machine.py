"""Facts about the machine for the benchmark reports (standard library only)."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def memory_gib() -> str:
    try:
        with open("/proc/meminfo") as fh:
            return f"{int(fh.readline().split()[1]) / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError, IndexError):
        return "?"


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def machine_line(load: bool = True) -> str:
    """One line for every benchmark report: cores, CPU, RAM, kernel, Python (and the load)."""
    import platform as _platform

    line = (f"nproc {os.cpu_count()}, {cpu_model()}, RAM {memory_gib()}, Linux {_platform.release()}, "
            f"Python {_platform.python_version()}")
    return line + (f"; load average {load_average()}" if load else "")
