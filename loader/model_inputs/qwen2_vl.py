"""``model_inputs = "qwen2_vl"``: Qwen2-VL (``Qwen2VLForConditionalGeneration``), packed and exact.

A micro-batch holds ``input_ids``, ``labels`` (also ``-100`` on the visual placeholder tokens),
``position_ids`` of shape ``[4, rows, seq_len]``, ``use_cache=False``, ``mm_token_type_ids``
(1 on image placeholder tokens), ``pixel_values`` and ``image_grid_thw`` (only when the
micro-batch holds an image) and ``num_items_in_batch``.

``position_ids`` rows 1..3 are M-RoPE's (temporal, height, width) positions computed per packed
document exactly as ``Qwen2VLModel.get_rope_index`` (transformers 5.24) computes them for that
document alone: text tokens count up from the document start; the merged patches of an image
that starts at position ``s`` get ``(s + t, s + row, s + column)``; the text after it continues
at ``s + max(rows, columns)``. Row 0 holds the plain per-document positions: the language model
reads a 4-row ``position_ids`` as "text positions first", and derives the packed
block-diagonal mask from them (with ``use_cache=False``, as for ``causal_lm``). Given
``position_ids``, the model never calls ``get_rope_index`` itself, which would number every row
as one document.

Left out on purpose: the loader's text ``cu_seqlens`` (``forward`` hands its keyword arguments
on to the vision tower, whose own ``cu_seqlens`` argument means the patches of each image) and
the flash varlen kwargs (the vision tower's attention sets them itself); with
``flash_attention_2`` the packed mask comes from ``position_ids``, which transformers detects
for one row only: use ``micro_batch_size = 1`` there.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loader.model_inputs.base import Layout, ModelInputsError, register


@register
class Qwen2VL(Layout):
    """Packed image-text sequences for ``Qwen2VLForConditionalGeneration``."""

    name = "qwen2_vl"
    keys = ("input_ids", "labels", "position_ids", "use_cache", "mm_token_type_ids", "pixel_values",
            "image_grid_thw", "num_items_in_batch")

    def __init__(self, *, seq_len: int, image_options: Any = None) -> None:
        super().__init__(seq_len=seq_len, image_options=image_options)
        if image_options is None:
            # Text-only sources: M-RoPE of text is three equal rows, the image fields never appear.
            self.image_id, self.merge_size = None, 1
            return
        policy = image_options.policy
        if policy.kind != "dynamic":
            raise ModelInputsError(f"model_inputs = \"qwen2_vl\" needs the \"dynamic\" image policy (Qwen2-VL's "
                               f"resolution), but images.policy is {policy.kind!r}; set images.policy = \"dynamic\" "
                               "or choose another model_inputs")
        self.image_id = image_options.image_id
        self.merge_size = policy.merge_size

    def lay_out(self, batch: dict[str, Any]) -> dict[str, Any]:
        input_ids, text_positions = batch["input_ids"], batch["position_ids"]
        rows, seq_len = input_ids.shape
        positions = np.empty((4, rows, seq_len), dtype=np.int64)
        positions[:] = text_positions
        out: dict[str, Any] = {"input_ids": input_ids, "labels": batch["labels"], "position_ids": positions,
                               "use_cache": False}
        if self.image_id is None:
            out["mm_token_type_ids"] = np.zeros((rows, seq_len), dtype=np.int32)
            return out
        is_image = input_ids == self.image_id
        out["mm_token_type_ids"] = is_image.astype(np.int32)
        grids = batch["image_grid_thw"]
        if len(grids):
            self._image_positions(positions[1:], text_positions, batch["cu_seqlens"], grids,
                                  batch["image_sequence_index"], batch["image_token_offsets"], is_image)
            out["pixel_values"] = batch["pixel_values"]
            out["image_grid_thw"] = grids
        return out

    def _image_positions(self, mrope: np.ndarray, text_positions: np.ndarray, cu_seqlens: np.ndarray,
                         grids: np.ndarray, image_rows: np.ndarray, offsets: np.ndarray, is_image: np.ndarray) -> None:
        """Rewrite ``mrope`` ``[3, rows, seq_len]`` (text positions on entry) around every image,
        images in row and token order (each shifts the rest of its document)."""
        seq_len = self.seq_len
        m = self.merge_size
        for (t, h, w), row, at in zip(grids.tolist(), image_rows.tolist(), offsets.tolist()):
            grid_h, grid_w = h // m, w // m
            tokens = t * grid_h * grid_w
            # The end of the document holding the image (a segment of the flattened micro-batch).
            flat = row * seq_len + at
            end = int(cu_seqlens[np.searchsorted(cu_seqlens, flat, side="right")]) - row * seq_len
            if not is_image[row, at : at + tokens].all() or (at + tokens < end and is_image[row, at + tokens]):
                # transformers groups adjacent image tokens into one image: two images with no
                # token between them would get other positions there than here.
                raise ModelInputsError(
                    f"row {row}: the {tokens} placeholder tokens of the image at token {at} (grid {t}x{h}x{w}, "
                    f"merge {m}) are not a run of image tokens ended by another token; with model_inputs = "
                    "\"qwen2_vl\" set images.image_start_token / image_end_token so that images are delimited")
            start = mrope[0, row, at]
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(grid_h), np.arange(grid_w), indexing="ij")
            span = slice(at, at + tokens)
            mrope[0, row, span] = start + tt.reshape(-1)
            mrope[1, row, span] = start + hh.reshape(-1)
            mrope[2, row, span] = start + ww.reshape(-1)
            mrope[:, row, at + tokens : end] += max(grid_h, grid_w) - tokens
