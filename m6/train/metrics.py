"""Step metrics: throughput, model FLOP utilisation, peak memory and expert load."""

from __future__ import annotations

import resource

import torch
from torch import nn

# Dense (non-sparse) tensor-core peaks from NVIDIA's datasheets, TFLOP/s, by autocast dtype.
# Spec-sheet figures used as the MFU denominator, not measurements.
DEVICE_PEAK_TFLOPS = {
    "H200": {torch.bfloat16: 989.4, torch.float32: 494.7},
    "H100": {torch.bfloat16: 989.4, torch.float32: 494.7},
    "A100": {torch.bfloat16: 312.0, torch.float32: 156.0},
    "V100": {torch.float16: 125.0, torch.float32: 15.7},
}


def device_peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None) -> float | None:
    """The device's peak for ``dtype`` (config ``train.peak_tflops`` wins); None when unknown (CPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in DEVICE_PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(dtype)
    return None


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: allocator high-water mark since the last reset; CPU: process RSS high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def expert_load(moe_layers: dict[str, nn.Module]) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Scalar load metrics per MoE layer and the raw per-expert token counts, from layer.stats.

    This is the one place routing statistics are copied to the host: at logging time only.
    """
    scalars: dict[str, float] = {}
    counts: dict[str, list[int]] = {}
    for name, layer in moe_layers.items():
        stats = layer.stats
        if stats is None:
            continue
        tokens = stats.tokens_per_expert.float()
        mean = tokens.mean().item()
        scalars[f"moe/{name}/max_tokens"] = tokens.max().item()
        scalars[f"moe/{name}/mean_tokens"] = mean
        scalars[f"moe/{name}/max_over_mean"] = tokens.max().item() / mean if mean > 0 else 0.0
        scalars[f"moe/{name}/dropped_fraction"] = stats.dropped_fraction.item()
        scalars[f"moe/{name}/router_entropy"] = stats.router_entropy.item()
        counts[name] = stats.tokens_per_expert.tolist()
    return scalars, counts
