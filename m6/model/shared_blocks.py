"""Pseudo-to-real (M6-10T): blocks in consecutive groups of ``model.share_layers`` share one set of
weights (the "pseudo giant"), and delinking gives every block its own copy.

A follower block keeps its own module objects where per-application state lives (the block, its
MoE layer: routing statistics, dispatcher and the aux-free expert bias) and holds its group
leader's weight-bearing modules (norms, attention, dense MLP, router, experts, shared experts). So a parameter is
one object reached from every block of its group: autograd sums its gradient over the uses,
``named_parameters`` names it once (after the leader), and the forward costs what the real
model's does.
"""

from __future__ import annotations

import re

from torch import nn

_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")


def group_leader(block_idx: int, share_layers: int) -> int:
    """The block whose weights block ``block_idx`` uses."""
    return block_idx - block_idx % share_layers


def share_block_weights(blocks: nn.ModuleList, share_layers: int) -> None:
    """Point every follower block at its leader's weight-bearing modules (``share_layers`` 1: no-op)."""
    for i, block in enumerate(blocks):
        leader = blocks[group_leader(i, share_layers)]
        if leader is block:
            continue
        assert block.is_moe == leader.is_moe, "model.share_layers groups mix MoE and dense blocks (config check)"
        block.attn_norm, block.attn, block.ffn_norm = leader.attn_norm, leader.attn, leader.ffn_norm
        if block.is_moe:
            block.ffn.router, block.ffn.experts = leader.ffn.router, leader.ffn.experts
            block.ffn.shared_experts = leader.ffn.shared_experts
            block.ffn.shared_expert_gate = leader.ffn.shared_expert_gate
        else:
            block.ffn = leader.ffn


def delinked_copies(names: list[str], share_layers: int, num_layers: int) -> dict[str, str]:
    """For a pseudo model's unique tensor names (model parameters and buffers, or optimizer-state
    names), the names the real model adds, each mapped to the name it copies: every
    ``blocks.<leader>.<rest>`` becomes ``blocks.<leader + j>.<rest>`` for the group's followers j,
    unless that name exists already (a per-block buffer such as ``ffn.expert_bias``)."""
    present = set(names)
    copies = {}
    for name in names:
        match = _BLOCK_KEY.match(name)
        if match is None:
            continue
        leader, rest = int(match.group(1)), match.group(2)
        if group_leader(leader, share_layers) != leader:
            continue
        for follower in range(leader + 1, min(leader + share_layers, num_layers)):
            target = f"blocks.{follower}.{rest}"
            if target not in present:
                copies[target] = name
    return copies
