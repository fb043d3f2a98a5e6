"""Step metrics: throughput, model FLOP utilisation, peak memory and expert load."""

from __future__ import annotations

import re
import resource

import torch
from torch import nn

from m6.moe.expert_gemm import EXPERT_KERNEL_CODES

# Dense (no 2:4 sparsity) peaks from NVIDIA's datasheets, TFLOP/s: the MFU denominator, spec-sheet
# figures, not measurements (half the sparsity figure where a datasheet prints only that one).
# "tf32" is an fp32 matmul on tensor cores, which runs only when TF32 matmuls are enabled; "fp32"
# is the plain (CUDA-core) rate, what an fp32 matmul gets by default. Volta has no TF32 (and no bf16
# tensor cores). First match wins, so a variant comes before its family's default; a variant set
# to None differs from its family and is not tabulated here (set train.peak_tflops).
_HOPPER_SXM = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0}
_AMPERE_A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
DEVICE_PEAK_TFLOPS: list[tuple[str, str | None, dict[str, float] | None]] = [
    # (model word, variant word or None, peaks) matched against the words of the device name
    ("H100", "PCIE", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    ("H100", "NVL", None),
    ("H100", None, _HOPPER_SXM),  # "NVIDIA H100 80GB HBM3" is the SXM5 part
    ("H200", "NVL", None),
    ("H200", None, _HOPPER_SXM),  # H200 SXM: H100 SXM's compute with more memory
    ("GH200", None, _HOPPER_SXM),
    ("A100", None, _AMPERE_A100),  # SXM4 and PCIe, 40 and 80 GB: the same peaks
    ("V100S", None, {"fp16": 130.0, "fp32": 16.4}),
    ("V100", "PCIE", {"fp16": 112.0, "fp32": 14.0}),
    ("V100", None, {"fp16": 125.0, "fp32": 15.7}),  # SXM2
]
_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def peak_tflops_for(device_name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """Datasheet peak of the GPU called ``device_name`` (as torch.cuda.get_device_name gives it) for
    matmuls in ``dtype``, fp32 at the TF32 rate only when ``tf32``; None for a device, variant or
    dtype not in DEVICE_PEAK_TFLOPS. Words are matched whole, so "A10" is not an A100."""
    words = set(re.split(r"[\s\-_/]+", device_name.upper()))
    key = _DTYPE_KEYS.get(dtype)
    if key == "fp32" and tf32:
        key = "tf32"
    for model, variant, peaks in DEVICE_PEAK_TFLOPS:
        if model in words and (variant is None or variant in words):
            if peaks is None or key is None:
                return None
            return peaks.get(key, peaks["fp32"] if key == "tf32" else None)  # no TF32 unit: plain fp32
    return None


def tf32_matmuls_enabled() -> bool:
    """Whether CUDA fp32 matmuls run on TF32 tensor cores (torch's fp32_precision setting, which
    the legacy allow_tf32 and set_float32_matmul_precision also write; off by default)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:  # a torch without the fp32_precision API
        return bool(matmul.allow_tf32)
    if precision == "none":  # inherits the global setting
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"


def device_peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None) -> float | None:
    """The device's peak for ``dtype`` as it runs now (config ``train.peak_tflops`` wins); None when
    unknown (CPU, an untabulated GPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return peak_tflops_for(torch.cuda.get_device_name(device), dtype, tf32_matmuls_enabled())


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: allocator high-water mark since the last reset; CPU: process RSS high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def expert_load(moe_layers: dict[str, nn.Module]) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Scalar load metrics per MoE layer and the raw per-expert token counts, from layer.stats.

    This is the one place routing statistics are copied to the host: at logging time only, all
    layers' in one transfer (one host sync per logging step). The scalars are computed on the device
    as they always were (float32 mean and max of the counts) and travel in float64, which holds
    every float32 value and every count below 2**53 exactly.
    """
    layers = {name: layer.stats for name, layer in moe_layers.items() if layer.stats is not None}
    if not layers:
        return {}, {}
    packed = []
    for stats in layers.values():
        tokens = stats.tokens_per_expert.float()
        packed.append(torch.cat([torch.stack([tokens.mean(), tokens.max(), stats.dropped_fraction.float(),
                                              stats.router_entropy.float()]).double(),
                                 stats.tokens_per_expert.double()]))
    values = torch.cat(packed).tolist()
    scalars: dict[str, float] = {}
    counts: dict[str, list[int]] = {}
    start = 0
    for name, stats in layers.items():
        mean, top, dropped, entropy = values[start:start + 4]
        num_experts = stats.tokens_per_expert.numel()
        scalars[f"moe/{name}/max_tokens"] = top
        scalars[f"moe/{name}/mean_tokens"] = mean
        scalars[f"moe/{name}/max_over_mean"] = top / mean if mean > 0 else 0.0
        scalars[f"moe/{name}/dropped_fraction"] = dropped
        scalars[f"moe/{name}/router_entropy"] = entropy
        ran = moe_layers[name].experts.last_kernel
        if ran is not None:  # which expert kernel ran: 0 loop, 1 grouped_mm, 2 fused
            scalars[f"moe/{name}/expert_kernel"] = EXPERT_KERNEL_CODES[ran]
        counts[name] = [int(n) for n in values[start + 4:start + 4 + num_experts]]
        start += 4 + num_experts
    return scalars, counts
