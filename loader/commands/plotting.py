"""Matplotlib for the plot commands (``zephon inspect --plot``, ``zephon plot-mix``).

Matplotlib is optional (the ``plots`` extra, or ``pip install matplotlib``), imported only when
a plot is asked for, and never through ``pyplot``: a :class:`matplotlib.figure.Figure` with the Agg
canvas needs no display, touches no global figure state, and can be inspected by tests
before it is saved.
"""

from __future__ import annotations

import os
from typing import Any

from loader.errors import PlotError

INSTALL_HINT = "install matplotlib: pip install matplotlib (or the plots extra: pip install -e '.[plots]' in a checkout)"
DPI = 120


def new_figure(width: float, height: float) -> Any:
    """An empty Figure of ``width`` x ``height`` inches; a clear error if matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotError(f"plotting needs matplotlib, which is not installed ({exc}); {INSTALL_HINT}") from exc
    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def save_figure(figure: Any, path: str) -> None:
    """Write ``figure`` to ``path``; the file type is the extension (``.png``, ``.svg``, ``.pdf``, ...)."""
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    supported = sorted(figure.canvas.get_supported_filetypes())
    if extension not in supported:
        raise PlotError(f"{path}: cannot tell the image type from the extension {extension!r}; "
                        f"use one of {', '.join('.' + s for s in supported)} (e.g. FILE.png)")
    figure.savefig(path, dpi=DPI)
