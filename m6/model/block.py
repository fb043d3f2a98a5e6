"""Pre-norm transformer block whose FFN is either a dense MLP or an MoE layer."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from m6.model.attention import Rotary, SelfAttention
from m6.model.cast_on_use import Linear
from m6.moe import MoELayer

Norm = Literal["layernorm", "rmsnorm"]


def build_norm(kind: Norm, dim: int, eps: float) -> nn.Module:
    """torch's nn.LayerNorm (weight and bias) or nn.RMSNorm (weight only) over the last ``dim``."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")


class DenseMLP(nn.Module):
    """x [..., D] -> [..., D] through D -> ffn_dim -> D.

    ``activation="gelu"``: fc_out(gelu(fc_in(x))). ``"swiglu"``: fc_out(silu(fc_gate(x)) * fc_in(x))
    (Hugging Face's up_proj = fc_in, gate_proj = fc_gate, down_proj = fc_out). Also the shared
    experts of an MoE layer (m6.moe.MoELayer.shared_experts, no biases).
    """

    def __init__(self, d_model: int, ffn_dim: int, activation: Literal["gelu", "swiglu"] = "gelu",
                 bias: bool = True) -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"activation must be 'gelu' or 'swiglu', got {activation!r}")
        self.activation = activation
        self.fc_in = Linear(d_model, ffn_dim, bias=bias)
        self.fc_gate = Linear(d_model, ffn_dim, bias=bias) if activation == "swiglu" else None
        self.fc_out = Linear(ffn_dim, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc_gate is not None:
            return self.fc_out(F.silu(self.fc_gate(x)) * self.fc_in(x))
        return self.fc_out(F.gelu(self.fc_in(x)))


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then + ffn(norm(x)); returns the new x and the FFN's auxiliary loss."""

    def __init__(self, d_model: int, num_heads: int, ffn: nn.Module, dropout: float, norm_eps: float,
                 norm: Norm = "layernorm", attention: SelfAttention | None = None) -> None:
        super().__init__()
        self.attn_norm = build_norm(norm, d_model, norm_eps)
        self.attn = attention if attention is not None else SelfAttention(d_model, num_heads, dropout)
        self.ffn_norm = build_norm(norm, d_model, norm_eps)
        self.ffn = ffn
        self.dropout = nn.Dropout(dropout)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoELayer)

    def attention_residual(self, x_BSD: torch.Tensor, mask_B1SS: torch.Tensor, rotary: Rotary = None) -> torch.Tensor:
        """x + dropout(attn(norm(x))) [B, S, D]: the attention sub-block, a unit that runs no
        collective of its own, so m6.parallel may recompute it in backward (activation
        checkpointing; under tensor parallel the collectives m6.parallel installs run again)."""
        return x_BSD + self.dropout(self.attn(self.attn_norm(x_BSD), mask_B1SS, rotary))

    def forward(self, x_BSD: torch.Tensor, mask_B1SS: torch.Tensor, token_mask_BS: torch.Tensor | None = None,
                rotary: Rotary = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``token_mask_BS`` (True = real token) keeps padding out of MoE routing and capacity;
        ``rotary`` (cos, sin) [S, Dh] when the model uses rotary positions."""
        x_BSD = self.attention_residual(x_BSD, mask_B1SS, rotary)
        h = self.ffn_norm(x_BSD)
        if self.is_moe:
            y, aux = self.ffn(h, token_mask_BS)
        else:
            y, aux = self.ffn(h), None
        return x_BSD + self.dropout(y), aux
