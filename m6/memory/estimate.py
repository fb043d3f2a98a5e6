"""Where the training state of one process lives, in bytes, given the chosen memory features.

Extends m6.model.flops.memory_estimate_bytes (fp32 AdamW, no features) with optim.apply_groups
(the update's temporaries shrink to the largest group) and memory.offload (model states move
to the host). Works on a model built on ``meta``, so any config is reported without allocating it.

Bytes per parameter: 4 weight, 4 gradient, 8 Adam moments (+ a 4 B step count per tensor).
The update's temporary is foreach AdamW's sqrt(exp_avg_sq): 4 B per element of one foreach
call, and torch calls it per (param group x apply group), so the largest such call counts.
DeepSpeed's CPU Adam (memory.host_optimizer=deepspeed) updates in place: no temporaries; auto
counts torch's, as it falls back to torch where DeepSpeed's op does not build.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from m6.config import Config, accumulation_steps, micro_batch_size
from m6.model.flops import count_parameters, memory_estimate_bytes
from m6.moe import MoELayer
from m6.memory.grouped_apply import split_apply_groups


COMPONENTS = ("params", "grads", "optimizer state", "optimizer step temporaries", "activations (per micro-batch)")


@dataclass
class MemoryReport:
    """Estimated bytes per component (names in COMPONENTS) on the accelerator and in host memory."""

    device: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)

    def total(self, where: str) -> float:
        return sum(getattr(self, where).values())


def _streamed_window(blocks: list[nn.Module]) -> int:
    """Elements of the two adjacent blocks resident at once (the one running + the prefetched one)."""
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    if len(sizes) < 2:
        return sum(sizes)
    return max(a + b for a, b in zip(sizes, sizes[1:]))


def estimate_memory(cfg: Config, model: nn.Module, no_decay: set[int], world_size: int = 1) -> MemoryReport:
    """Per-process estimate for ``cfg`` with ``model`` (meta or real) holding this process's params.

    ``no_decay``: ids of the params in the optimizer's no-weight-decay group (torch updates each
    param group in its own foreach call). ``world_size`` > 1: gradients are all-reduced on the
    device before they may be offloaded, so the device holds all of them until then.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    size = count_parameters(model)
    mb = micro_batch_size(cfg.train, world_size)
    activations = memory_estimate_bytes(cfg.model, size, cfg.data.seq_len, mb)["activations"]

    expert_ids = {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
    replicated = [p for p in params if id(p) not in expert_ids]
    experts = [p for p in params if id(p) in expert_ids]
    groups = split_apply_groups(replicated, experts, cfg.optim.apply_groups) if cfg.optim.apply_groups > 1 \
        else [params]
    largest_call = max((sum(p.numel() for p in g if (id(p) in no_decay) == nd) for g in groups for nd in (False, True)),
                       default=0)

    states = {
        "params": 4.0 * numel,
        "grads": 4.0 * numel,
        "optimizer state": 8.0 * numel + 4.0 * len(params),
        "optimizer step temporaries": 4.0 * largest_call,
    }
    mode = cfg.memory.offload
    if mode == "none":
        return MemoryReport(device={**states, "activations (per micro-batch)": activations}, host={})

    # Offloaded: a gradient leaves the device once final. Until then (accumulation, all-reduce)
    # the device holds it; without either, only a transient tensor at a time (the largest one).
    keeps_grads = accumulation_steps(cfg.train, world_size) > 1 or world_size > 1
    device_grads = 4.0 * numel if keeps_grads else 4.0 * max((p.numel() for p in params), default=0)
    if mode == "optimizer+params":
        blocks = list(getattr(model, "blocks", []))
        streamed = sum(p.numel() for b in blocks for p in b.parameters())
        device_params = 4.0 * (numel - streamed + _streamed_window(blocks))
    else:
        device_params = 4.0 * numel
    return MemoryReport(
        device={"params": device_params, "grads": device_grads, "activations (per micro-batch)": activations},
        host={"params": states["params"], "grads": states["grads"], "optimizer state": states["optimizer state"],
              "optimizer step temporaries": 0.0 if cfg.memory.host_optimizer == "deepspeed"
              else states["optimizer step temporaries"]},
    )
