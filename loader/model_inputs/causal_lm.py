"""``model_inputs = "causal_lm"``: decoder-only language models (Llama, Qwen2, Mistral, GPT-2, ...).

A micro-batch holds ``input_ids``, ``labels`` (``-100`` at every document's first token, on
padding and where a loss mask is 0), ``position_ids`` restarting at every document start,
``use_cache=False``, the flash-attention varlen kwargs of the documents
(:func:`~loader.model_inputs.base.flash_varlen_kwargs`) and ``num_items_in_batch``.

Why these make ``model(**batch)`` exact, in transformers 5.24 (``masking_utils``):
``create_causal_mask`` looks for packed sequences in ``position_ids`` only when there is no
2-D attention mask *and no cache*; ``forward`` creates a ``DynamicCache`` whenever
``use_cache`` is true, and the configs default it to true, so without ``use_cache=False``
every document attends to the documents before it in its row. With it, sdpa and eager (and
flex) attention get a block-diagonal causal mask built inside the model, in the model's
dtype; flash attention takes the varlen kwargs instead of a mask.
"""

from __future__ import annotations

from typing import Any

from loader.model_inputs.base import Layout, ModelInputsError, flash_varlen_kwargs, register

FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@register
class CausalLM(Layout):
    """Packed text for ``AutoModelForCausalLM`` models."""

    name = "causal_lm"
    keys = ("input_ids", "labels", "position_ids", "use_cache", *FLASH_KEYS, "num_items_in_batch")

    def __init__(self, *, seq_len: int, image_options: Any = None) -> None:
        super().__init__(seq_len=seq_len, image_options=image_options)
        if image_options is not None:
            # The layout has no pixels: the model would train on placeholder tokens that stand for nothing.
            raise ModelInputsError("model_inputs = \"causal_lm\" has no image fields, but the loader's sources hold "
                                   "images; use model_inputs = \"qwen2_vl\" (dynamic resolution) or leave "
                                   "model_inputs unset and feed pixel_values yourself")

    def lay_out(self, batch: dict[str, Any]) -> dict[str, Any]:
        out = {"input_ids": batch["input_ids"], "labels": batch["labels"], "position_ids": batch["position_ids"],
               "use_cache": False}
        out.update(flash_varlen_kwargs(batch["cu_seqlens"]))
        return out
