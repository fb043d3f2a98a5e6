"""Pre-norm transformer block whose FFN is either a dense MLP or an MoE layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m6.model.attention import SelfAttention
from m6.model.cast_on_use import Linear
from m6.moe import MoELayer


class DenseMLP(nn.Module):
    """x [..., D] -> [..., D] through D -> ffn_dim -> D with GELU."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.fc_in = Linear(d_model, ffn_dim)
        self.fc_out = Linear(ffn_dim, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then + ffn(norm(x)); returns the new x and the FFN's auxiliary loss."""

    def __init__(self, d_model: int, num_heads: int, ffn: nn.Module, dropout: float, norm_eps: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model, eps=norm_eps)
        self.attn = SelfAttention(d_model, num_heads, dropout)
        self.ffn_norm = nn.LayerNorm(d_model, eps=norm_eps)
        self.ffn = ffn
        self.dropout = nn.Dropout(dropout)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoELayer)

    def attention_residual(self, x_BSD: torch.Tensor, mask_B1SS: torch.Tensor) -> torch.Tensor:
        """x + dropout(attn(norm(x))) [B, S, D]: the attention sub-block, a unit that runs no
        collective, so m6.parallel may recompute it in backward (activation checkpointing)."""
        return x_BSD + self.dropout(self.attn(self.attn_norm(x_BSD), mask_B1SS))

    def forward(self, x_BSD: torch.Tensor, mask_B1SS: torch.Tensor,
                token_mask_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``token_mask_BS`` (True = real token) keeps padding out of MoE routing and capacity."""
        x_BSD = self.attention_residual(x_BSD, mask_B1SS)
        h = self.ffn_norm(x_BSD)
        if self.is_moe:
            y, aux = self.ffn(h, token_mask_BS)
        else:
            y, aux = self.ffn(h), None
        return x_BSD + self.dropout(y), aux
