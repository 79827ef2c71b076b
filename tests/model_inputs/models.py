"""Tiny randomly initialised Hugging Face models built from config, and per-document checks."""

from __future__ import annotations

import torch

VOCAB = 8000  # the shipped test tokenizer's


def tiny_llama(attn_implementation: str, vocab_size: int = VOCAB, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM  # optional: callers importorskip it

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attn_implementation=attn_implementation)
    assert config.use_cache  # the default the batches must be exact under
    return LlamaForCausalLM(config).eval()


def documents(position_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every segment: position ids restart at 0 at each one."""
    out = []
    for row, positions in enumerate(position_ids):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
        out += [(row, a, b) for a, b in zip(starts[:-1], starts[1:])]
    return out


def worst_document_difference(packed_logits: torch.Tensor, alone, docs) -> float:
    """Max abs difference between each document's packed logits and ``alone(row, start, end)``."""
    worst = 0.0
    for row, a, b in docs:
        worst = max(worst, (alone(row, a, b) - packed_logits[row, a:b]).abs().max().item())
    return worst


def tiny_qwen2_vl(tokenizer_path: str, attn_implementation: str = "sdpa", seed: int = 0):
    """A 2-layer Qwen2-VL with a 1-block vision tower (patch 14, merge 2, temporal patch 2: the
    loader's dynamic policy defaults), placeholder ids from ``tokenizer_path``."""
    from tokenizers import Tokenizer
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration  # optional: callers importorskip it

    tokenizer = Tokenizer.from_file(tokenizer_path)
    ids = {name: tokenizer.token_to_id(token) for name, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("image_token_id", "<|image_pad|>"),
        ("vision_end_token_id", "<|vision_end|>"))}
    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        attn_implementation=attn_implementation, **ids)
    assert config.text_config.use_cache
    return Qwen2VLForConditionalGeneration(config).eval(), ids
