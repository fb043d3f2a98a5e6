"""Prefix-LM attention mask built from per-position segment ids.

Segments (m6.batch_format): PAD=0, SOURCE=1 (prefix: image patches and source text), TARGET=2.
Rules: prefix attends bidirectionally to the prefix; target attends to the whole prefix and
causally to target positions at or before it; prefix never attends to target; padding is never
attended to. A padding query may only see itself: an all-masked row would make the softmax NaN,
and a padding position's output is never used (no loss, nobody attends to it).
"""

from __future__ import annotations

import torch

from m6.batch_format import SEG_PAD, SEG_SOURCE, SEG_TARGET


def prefix_lm_mask(segment_ids_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] segment ids -> bool [B, 1, S, S] mask, True where query (row) may attend key (col)."""
    S = segment_ids_BS.shape[1]
    q = segment_ids_BS.unsqueeze(2)  # [B, S, 1]
    k = segment_ids_BS.unsqueeze(1)  # [B, 1, S]
    pos = torch.arange(S, device=segment_ids_BS.device)
    causal_SS = pos.view(S, 1) >= pos.view(1, S)
    key_is_prefix = k == SEG_SOURCE
    prefix_query = (q == SEG_SOURCE) & key_is_prefix
    target_query = (q == SEG_TARGET) & (key_is_prefix | ((k == SEG_TARGET) & causal_SS))
    pad_self = (q == SEG_PAD) & torch.eye(S, dtype=torch.bool, device=segment_ids_BS.device)
    return (prefix_query | target_query | pad_self).unsqueeze(1)
