"""Rotary position embeddings (RoPE) of q and k: 1-D for text, 2-D for image patches.

Hugging Face's convention (Llama, Mixtral, Qwen, OLMoE), so imported weights give the same
attention: the head's dims are split into halves that pair up (i, i + Dh/2) — ``rotate_half``, not
interleaved pairs; pair i turns by angle ``position * inv_freq[i]`` with
``inv_freq[i] = 1 / theta**(2i / Dh)``; angles, cos and sin are computed in fp32 and cast to q's
dtype, as transformers does. Text positions count 0..L-1 from the first text token.

2-D (image patches on a grid): the first Dh/4 pairs turn with the patch's row and the other Dh/4
with its column, each axis with the frequencies of a Dh/2-dim rotary (``1 / theta**(4j / Dh)``), as
in 2-D axial RoPE (EVA-02, Qwen2-VL's spatial sections). A position that takes no rotation (image
patches when model.image_positions=learned) has angle 0: cos 1, sin 0.

Shape legend: B batch, H heads, S positions, Dh head dim.
"""

from __future__ import annotations

import torch


def inv_frequencies(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """fp32 [dim/2]: 1 / theta**(2i / dim), computed as transformers computes it."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    return 1.0 / (theta ** exponent)


def text_angles(length: int, head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """fp32 [L, Dh/2]: the angle of each rotary pair at text positions 0..L-1."""
    pos = torch.arange(length, device=device).to(torch.float32)
    return pos[:, None] * inv_frequencies(head_dim, theta, device)[None, :]


def grid_angles(grid: int, head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """fp32 [grid*grid, Dh/2]: 2-D angles of the patches in row-major order (row pairs, then column pairs)."""
    inv = inv_frequencies(head_dim // 2, theta, device)  # [Dh/4]
    idx = torch.arange(grid, device=device).to(torch.float32)
    rows = (idx[:, None] * inv[None, :]).repeat_interleave(grid, dim=0)  # patch r*grid + c has row r
    cols = (idx[:, None] * inv[None, :]).repeat(grid, 1)  # ... and column c
    return torch.cat([rows, cols], dim=1)


def cos_sin(angles_SP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, Dh/2] angles -> (cos, sin), each fp32 [S, Dh] (the halves repeated, rotate_half layout)."""
    emb = torch.cat([angles_SP, angles_SP], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., Dh] -> [..., Dh]: (x1, x2) -> (-x2, x1) over the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x_BHSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with cos/sin cast to x's dtype (q or k, [B, H, S, Dh])."""
    cos, sin = cos_SD.to(x_BHSD.dtype), sin_SD.to(x_BHSD.dtype)
    return x_BHSD * cos + rotate_half(x_BHSD) * sin
