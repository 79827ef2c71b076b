"""Model-input layouts: micro-batches a Hugging Face model family takes as-is and computes exactly.

``LoaderConfig.model_inputs`` names a layout of :data:`LAYOUTS` (``"causal_lm"``,
``"qwen2_vl"``; None: the loader's own batches, unchanged). A layout is a class that
registers itself with :func:`register`; the loader builds it once (:func:`build_layout`) and
calls :meth:`Layout.lay_out` on every collated micro-batch (NumPy, before the torch wrap).
What a layout returns holds only keyword arguments of its family's ``forward``, so
``model(**batch)`` runs as it is and

* attention stays inside each packed document: the batch carries per-document
  ``position_ids`` and ``use_cache=False``; transformers 5 then derives a block-diagonal causal
  mask from the positions (``masking_utils.find_packed_sequence_indices``), a detection it
  switches off whenever a cache object exists, which ``use_cache=True`` (the models' default)
  creates in ``forward``. docs/guides/model-inputs.md measures this against a 4-D mask;
* the loss is the step's mean token loss: ``num_items_in_batch`` (added by the loader,
  :mod:`loader.model_inputs.loss_tokens`) is the number of tokens of the whole optimizer step
  whose shifted label is not ``-100``, which HF's causal-LM losses divide the summed token
  loss by.

A layout also names the batch fields it reads (:attr:`Layout.needs_fields`), checked against
``batch_fields`` with the config.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import numpy as np

from loader.errors import ModelInputsError
from loader.validation import Problems, Rule

LAYOUTS: dict[str, type["Layout"]] = {}


def register(cls: type["Layout"]) -> type["Layout"]:
    """Class decorator: make ``cls`` selectable as ``model_inputs = cls.name``."""
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__name__} needs a class attribute 'name' to be registered as a model-input layout")
    if cls.name in LAYOUTS and LAYOUTS[cls.name] is not cls:
        raise ValueError(f"model-input layout {cls.name!r} is registered twice ({LAYOUTS[cls.name].__name__}, "
                         f"{cls.__name__})")
    LAYOUTS[cls.name] = cls
    return cls


class LayoutName(Rule):
    """The config's ``model_inputs``: absent, or the name of a registered layout."""

    @property
    def expected(self) -> str:  # type: ignore[override]
        return "one of " + ", ".join(repr(n) for n in sorted(LAYOUTS)) + " (or absent: the loader's own batch fields)"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if value is not None and not (isinstance(value, str) and value in LAYOUTS):
            problems.bad(path, value, self.expected)
        return value


class Layout:
    """One model family's micro-batch. Subclasses set :attr:`name`, :attr:`needs_fields` and
    :attr:`keys` and implement :meth:`lay_out`.

    ``context``: what the loader knows and a layout may need (``seq_len``, ``image_options``:
    the resolved :class:`~loader.vision.block.ImageOptions` or None).
    """

    name: ClassVar[str] = ""
    # Batch fields the layout reads (they must be among the config's batch_fields).
    needs_fields: ClassVar[tuple[str, ...]] = ("input_ids", "labels", "position_ids", "cu_seqlens")
    # Every key a micro-batch of this layout can hold (num_items_in_batch included).
    keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, seq_len: int, image_options: Any = None) -> None:
        self.seq_len = seq_len
        self.image_options = image_options

    def lay_out(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The model's keyword arguments from one collated micro-batch (NumPy arrays)."""
        raise NotImplementedError(f"{type(self).__name__}.lay_out")


def build_layout(name: Optional[str], **context: Any) -> Optional[Layout]:
    """The layout ``name`` (a config's ``model_inputs``) built for this loader; None for None."""
    if name is None:
        return None
    return LAYOUTS[name](**context)


def missing_fields(name: Optional[str], batch_fields: tuple[str, ...]) -> list[str]:
    """Fields layout ``name`` reads that ``batch_fields`` does not hold (for the config check)."""
    if name is None or name not in LAYOUTS:
        return []
    return [f for f in LAYOUTS[name].needs_fields if f not in batch_fields]


def flash_varlen_kwargs(cu_seqlens: np.ndarray) -> dict[str, Any]:
    """transformers' ``FlashAttentionKwargs`` of a micro-batch's segments: with
    ``attn_implementation="flash_attention_2"`` (or 3) the attention runs varlen over the
    flattened micro-batch, one segment per document, whatever the micro-batch size (from
    ``position_ids`` alone transformers detects packing only for one row). sdpa and eager
    attention ignore them."""
    cu = np.ascontiguousarray(cu_seqlens, dtype=np.int32)
    longest = int(np.diff(cu).max()) if len(cu) > 1 else 0
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
