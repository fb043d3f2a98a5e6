"""Multi-head self-attention on torch's fused scaled_dot_product_attention.

Shape legend: B batch, S sequence, D d_model, H heads, Dh head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from m6.model.cast_on_use import Linear


class SelfAttention(nn.Module):
    """x [B, S, D], bool mask [B, 1, S, S] (True = may attend) -> [B, S, D]."""

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.qkv = Linear(d_model, 3 * d_model)
        self.out = Linear(d_model, d_model)

    def forward(self, x_BSD: torch.Tensor, mask_B1SS: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x_BSD), "b s (three h d) -> three b h s d", three=3, h=self.num_heads)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SS,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(rearrange(y, "b h s d -> b s (h d)"))
