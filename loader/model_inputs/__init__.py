"""Micro-batches laid out for a model family's ``forward`` (``LoaderConfig.model_inputs``).

Importing the package registers the built-in layouts; see :mod:`loader.model_inputs.base`.
"""

from loader.model_inputs import causal_lm, qwen2_vl  # noqa: F401 - register the built-in layouts
from loader.model_inputs.base import LAYOUTS, Layout, LayoutName, ModelInputsError, build_layout, missing_fields, register

__all__ = ["LAYOUTS", "Layout", "LayoutName", "ModelInputsError", "build_layout", "missing_fields", "register"]
