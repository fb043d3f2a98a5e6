"""Per-step compute weights with fp32 masters on the device (train.weight_copy=per_step): the
on-device counterpart of Megatron's Float16Module + main params, or FSDP2's
MixedPrecisionPolicy(param_dtype=bf16) without the sharding.

Which weights: those the forward already computes with in the compute dtype under cast-on-use
(the cast_on_use Linear and Conv2d layers, the stacked expert FFN weights, an untied LM head).
Those module parameters become compute-dtype (bf16) tensors; their fp32 masters live here and are
what the optimizer updates, clips and checkpoints. Every other parameter (norms, embeddings, the
router, a tied embedding that is also looked up in fp32) stays an fp32 module parameter and is its
own master, exactly as under cast-on-use.

What changes against cast-on-use (train.weight_copy=per_use): the bf16 weight is made once per
step, by ``write_compute_weights`` after the update, instead of twice per use (forward and
backward) in every micro-batch; the cast-on-use ops then find a weight already in the compute
dtype and cast nothing. The bf16 values are the same (round-to-nearest of the same fp32 master),
so the forward and the weight gradients are the same bitwise.

Gradients: backward writes the compute-dtype gradient on the module parameter; a
post-accumulate-grad hook (registered before the gradient sync's, so it runs first) folds it into
the master's fp32 ``.grad`` (Megatron's main_grad) and drops it: the first micro-batch of a step
casts it (one cast), later ones add it in fp32, so accumulation does not round to bf16. The
gradient sync and the clip read the masters' gradients (``grad_holder``, ``masters_of``): the
all-reduce runs in fp32, as under cast-on-use.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from m6.model.cast_on_use import Conv2d, Linear
from m6.moe.experts import GroupedExperts


def compute_weight_params(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters the forward computes with in the compute dtype (see the module
    docstring), each once, in ``model.parameters()`` order; a parameter that a module outside
    those layers also holds (a tied embedding) is left out: it is used in fp32 there."""
    chosen: set[int] = set()
    for module in model.modules():
        if isinstance(module, (Linear, Conv2d, GroupedExperts)):
            chosen.update(id(p) for p in module.parameters(recurse=False))
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, nn.Linear):  # used by M6Model.logits through the cast-on-use linear
        chosen.add(id(lm_head.weight))
    for module in model.modules():
        if isinstance(module, (Linear, Conv2d, GroupedExperts)) or module is lm_head:
            continue
        chosen.difference_update(id(p) for p in module.parameters(recurse=False))
    return [p for p in model.parameters() if p.requires_grad and id(p) in chosen]


class MasterWeights:
    """fp32 masters of the compute weights on the device; the module holds their compute-dtype copy.

    ``master(p)`` is the tensor the optimizer updates for ``p`` (itself when ``p`` has no master),
    ``write_compute_weights()`` refreshes every copy from its master after an update or a load.
    """

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype) -> None:
        self.compute_dtype = compute_dtype
        self.params = compute_weight_params(model)
        self.masters: dict[int, torch.Tensor] = {}
        for p in self.params:
            master = p.detach().clone().float()
            p.data = master.to(compute_dtype)
            self.masters[id(p)] = master
            p.register_post_accumulate_grad_hook(self._fold_grad)
        self._master_list = [self.masters[id(p)] for p in self.params]

    @property
    def num_params(self) -> int:
        """Elements with a master (each costs 2 B more than cast-on-use: its bf16 copy)."""
        return sum(p.numel() for p in self.params)

    def _fold_grad(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: the compute-dtype gradient of this backward into the fp32
        master gradient (cast on the step's first micro-batch, added in fp32 on later ones)."""
        master = self.masters[id(p)]
        if master.grad is None:
            master.grad = p.grad.to(master.dtype)
        else:
            master.grad.add_(p.grad)
        p.grad = None

    def master(self, p: nn.Parameter) -> torch.Tensor:
        return self.masters.get(id(p), p)

    def masters_of(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        return [self.master(p) for p in params]

    def grad_holder(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor whose ``.grad`` holds ``p``'s gradient once its backward hook ran."""
        return self.master(p)

    def copies(self) -> dict[int, torch.Tensor]:
        """id(master) -> the module weight it is copied into (what AdamWWithCopy writes)."""
        return {id(self.masters[id(p)]): p.data for p in self.params}

    def master_names(self, model: nn.Module) -> dict[int, str]:
        """id(optimized tensor) -> the model parameter's name, for every trainable parameter
        (checkpoints index optimizer state by name)."""
        return {id(self.master(p)): n for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def write_compute_weights(self) -> None:
        """Every compute-dtype weight from its master: one multi-tensor copy (cast) per step,
        asynchronous on the device (no host sync)."""
        if self.params:
            torch._foreach_copy_([p.data for p in self.params], self._master_list)

    def describe(self, update: str) -> str:
        """The banner's words for it; ``update``: what writes the copy."""
        n = self.num_params
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"
        return f"weight copy per step of {size} params, fp32 masters and gradients on the device; {update}"
