"""A small GPT-style decoder in plain PyTorch, for the Zephon training example.

Attention is causal *and* confined to the document: a packed sequence holds several
documents, and a token attends only to earlier tokens of its own document. Document
boundaries come from ``position_ids`` (they restart at 0 where a document, or a document
piece carried over from the previous sequence, begins), so the model needs nothing but
the loader's ``input_ids`` and ``position_ids``::

    position_ids  0 1 2 3 0 1 2 0 1        segment = cumsum(position_ids == 0)
    segment       1 1 1 1 2 2 2 3 3        attend(i, j) = j <= i and segment[i] == segment[j]

Position embeddings are learned and indexed by ``position_ids``, so a document's first
token looks the same wherever packing put it. Labels follow the Hugging Face convention
(:func:`lm_loss_sum` shifts them): the loader sets ``-100`` on every document's first
token, so no token is trained to predict the next document.

No dropout, so a forward pass is a pure function of the parameters and the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    max_positions: int  # >= seq_len
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``[M, 1, T, T]`` boolean mask: True where query i may attend key j."""
    segment = torch.cumsum((position_ids == 0).to(torch.int32), dim=1)  # [M, T]
    same_doc = segment[:, :, None] == segment[:, None, :]
    T = position_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return (same_doc & causal)[:, None, :, :]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        M, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(M, T, self.n_heads, D // self.n_heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attn.transpose(1, 2).reshape(M, T, D))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, output head tied to the embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model must be divisible by n_heads (got {cfg.d_model=}, {cfg.n_heads=})")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        mask = document_causal_mask(position_ids)
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x) @ self.tok_emb.weight.T  # logits [M, T, vocab]


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy and the number of predicted tokens (HF label shift)."""
    shifted = labels[:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), shifted.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    return loss, int((shifted != IGNORE_INDEX).sum())
