"""Which parameters the optimizer must not weight-decay (a property of the model's modules)."""

from __future__ import annotations

from torch import nn


def no_decay_ids(model: nn.Module) -> set[int]:
    """Norm weights, biases and embedding tables: decaying them hurts and saves nothing."""
    ids = set()
    for module in model.modules():
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.Embedding)):
            ids.update(id(p) for p in module.parameters(recurse=False))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            ids.add(id(p))
    return ids
