"""Self-attention on torch's fused scaled_dot_product_attention: multi-head or grouped-query, with
optional q/k RMSNorm and rotary positions.

Parameters (the names the Hugging Face import/export maps): ``qkv`` one Linear D -> (H + 2 Hkv) Dh
whose output rows are [q (H Dh) | k (Hkv Dh) | v (Hkv Dh)]; ``out`` Linear H Dh -> D; with
``qk_norm="head"`` ``q_norm`` / ``k_norm`` are RMSNorms over Dh applied to every head (Qwen3), with
``"full"`` RMSNorms over the whole q (H Dh) and k (Hkv Dh) projections (OLMoE); both before RoPE.

Shape legend: B batch, S sequence, D d_model, H query heads, Hkv key/value heads, Dh head dim.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from m6.model.cast_on_use import Linear
from m6.model.rope import apply_rotary

QKNorm = Literal["none", "head", "full"]
Rotary = Optional[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin), each fp32 [S, Dh]


class SelfAttention(nn.Module):
    """x [B, S, D], bool mask [B, 1, S, S] (True = may attend), optional rotary (cos, sin) [S, Dh]
    -> [B, S, D]."""

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, num_kv_heads: int | None = None,
                 head_dim: int | None = None, qk_norm: QKNorm = "none", qkv_bias: bool = True,
                 out_bias: bool = True, norm_eps: float = 1e-5) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        head_dim = head_dim or d_model // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        if qk_norm not in ("none", "head", "full"):
            raise ValueError(f"qk_norm must be 'none', 'head' or 'full', got {qk_norm!r}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.dropout = num_heads, num_kv_heads, head_dim, dropout
        self.qk_norm = qk_norm
        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv = Linear(d_model, q_dim + 2 * kv_dim, bias=qkv_bias)
        self.out = Linear(q_dim, d_model, bias=out_bias)
        if qk_norm != "none":
            self.q_norm = nn.RMSNorm(head_dim if qk_norm == "head" else q_dim, eps=norm_eps)
            self.k_norm = nn.RMSNorm(head_dim if qk_norm == "head" else kv_dim, eps=norm_eps)

    def forward(self, x_BSD: torch.Tensor, mask_B1SS: torch.Tensor, rotary: Rotary = None) -> torch.Tensor:
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x_BSD).split([q_dim, kv_dim, kv_dim], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = rearrange(q, "b s (h d) -> b h s d", h=self.num_heads)
        k = rearrange(k, "b s (h d) -> b h s d", h=self.num_kv_heads)
        v = rearrange(v, "b s (h d) -> b h s d", h=self.num_kv_heads)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            # cos/sin cast to q's dtype once for q and k (a no-op in fp32: the tables are then shared by all blocks)
            cos, sin = (t.to(q.dtype) for t in rotary)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SS,
                                           dropout_p=self.dropout if self.training else 0.0,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        return self.out(rearrange(y, "b h s d -> b s (h d)"))
