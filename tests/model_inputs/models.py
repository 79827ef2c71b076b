"""Tiny randomly initialised Hugging Face models built from config, and per-document checks."""

from __future__ import annotations

import torch

VOCAB = 8000  # the shipped test tokenizer's


def tiny_llama(attn_implementation: str, vocab_size: int = VOCAB, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

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
