"""The :func:`transform` decorator: a transform function declares its stage and version.

It sits below :mod:`loader.transforms.spec` (which reads the declarations) and
:mod:`loader.transforms.builtins` (whose functions carry them), so neither imports the other
to get it.
"""

from __future__ import annotations

from typing import Callable, Optional

STAGES = ("text", "tokens", "records")
ANY_STAGE = "any"  # declared by functions that work on either (stage taken from the source)


def transform(stage: str = "text", version: Optional[str] = None) -> Callable[[Callable], Callable]:
    """Declare a transform function's stage (``"text"``, ``"tokens"`` or ``"any"``) and version."""
    if stage not in STAGES + (ANY_STAGE,):
        raise ValueError(f"transform(stage=...) must be one of {STAGES + (ANY_STAGE,)} (got {stage!r})")

    def declare(function: Callable) -> Callable:
        function.__zephon_stage__ = stage
        function.__zephon_version__ = version
        return function

    return declare
