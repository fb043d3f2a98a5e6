"""Input embeddings: text tokens and image patches, each with positions and a modality vector.

Shape legend: B batch, L text length, C channels, H/W image size, N patches, D d_model.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from m6.model.cast_on_use import Conv2d, Linear


class TextEmbedding(nn.Module):
    """Token + learned 1-D position embeddings: int [B, L] -> [B, L, D]. ``learned_positions=False``
    (rotary positions, applied in attention): the token embeddings alone, and no ``positions`` table."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int, learned_positions: bool = True) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model) if learned_positions else None

    def forward(self, ids_BL: torch.Tensor) -> torch.Tensor:
        if self.positions is None:
            return self.tokens(ids_BL)
        pos = torch.arange(ids_BL.shape[1], device=ids_BL.device)
        return self.tokens(ids_BL) + self.positions(pos)


class PatchEmbedding(nn.Module):
    """Image [B, C, H, W] -> patch tokens [B, N, D] with 2-D (row + column) position embeddings.

    ``kind="linear"``: each p x p patch flattened and projected (ViT / M6). ``kind="conv"``: a small
    3x3 conv stem before the patchifying projection, which helps tiny models see edges.
    ``learned_positions=False`` (2-D rotary positions, applied in attention): no ``rows`` / ``cols`` tables.
    """

    def __init__(self, image_size: int, patch_size: int, channels: int, d_model: int, kind: str = "linear",
                 learned_positions: bool = True) -> None:
        super().__init__()
        if kind not in ("linear", "conv"):
            raise ValueError(f"model.patch_embed must be 'linear' or 'conv', got {kind!r}")
        self.patch_size, self.grid = patch_size, image_size // patch_size
        self.kind = kind
        if kind == "linear":
            self.proj = Linear(channels * patch_size * patch_size, d_model)
        else:
            stem_dim = max(16, d_model // 4)
            self.stem = nn.Sequential(Conv2d(channels, stem_dim, 3, padding=1), nn.GELU())
            self.proj = Conv2d(stem_dim, d_model, patch_size, stride=patch_size)
        self.rows = nn.Embedding(self.grid, d_model) if learned_positions else None
        self.cols = nn.Embedding(self.grid, d_model) if learned_positions else None

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        if self.kind == "linear":
            patches = rearrange(images_BCHW, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=p, p2=p)
            x_BND = self.proj(patches)
        else:
            x_BND = rearrange(self.proj(self.stem(images_BCHW)), "b d h w -> b (h w) d")
        if self.rows is None:
            return x_BND
        idx = torch.arange(self.grid, device=images_BCHW.device)
        pos_ND = (self.rows(idx).unsqueeze(1) + self.cols(idx).unsqueeze(0)).reshape(-1, x_BND.shape[-1])
        return x_BND + pos_ND
