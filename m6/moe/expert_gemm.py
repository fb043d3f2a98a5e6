"""The per-expert GEMMs of GroupedExperts: a Python loop of torch.mm, or one grouped GEMM call; and
the choice of expert kernel per layer call (``choose_kernel``: loop, grouped_mm, or m6's fused
Triton kernels of m6.moe.fused_experts, which replace the whole FFN rather than its GEMMs).

Shape legend: N rows grouped by expert, K the contracted size, M the output size, E experts.

Both backends compute the same three products over contiguous expert segments of the rows:
``out[s:t] = a[s:t] @ w[e]`` (forward and input gradients, ``w[e].T`` when transposed) and
``grad_w[e] = a[s:t].T @ g[s:t]`` (weight gradients, exact zeros for experts that got no rows).

Grouped GEMM layout (torch ``grouped_mm``): forward and input gradients are 2D x 3D with ``offs``
the cumulative int32 row ends; weight gradients are 2D x 2D, ``a.T`` (column-major view) times
``g`` (row-major), giving [E, K, M]. In both, the grouped dimension is the outer (strided) one of
every operand, so a group starts at row ``s`` of a row-major tensor: its address is 16-byte aligned
whenever the row length is, and the CUDA kernel's per-group alignment assert (which applies only to
the other layouts) is not reached. So groups need no padding; only K and M (d_model, ffn_dim) must
be 16-byte multiples (8 bf16 / 4 fp32 elements) and the base pointers 16-byte aligned.
``offs`` may end before the last row (torch ignores the rows past ``offs[-1]``): a dropless local
layer passes the kept counts on the device and a padding tail after them (``zero_tail``).
"""

from __future__ import annotations

from typing import Callable, Literal, Optional, Sequence

import numpy as np
import torch

from m6.config import ConfigError
from m6.moe.fused_experts import fused_runs_on, require_fused

ExpertKernel = Literal["auto", "loop", "grouped_mm", "fused"]
EXPERT_KERNELS = ("auto", "loop", "grouped_mm", "fused")


def grouped_mm_op() -> Optional[Callable[..., torch.Tensor]]:
    """torch's grouped GEMM: the public ``torch.nn.functional.grouped_mm`` where it exists, else
    the private ``torch._grouped_mm`` (torch 2.8-2.1x), else None."""
    public = getattr(torch.nn.functional, "grouped_mm", None)
    if public is not None:
        return public
    return getattr(torch, "_grouped_mm", None)


def _strides_fit(weights: Sequence[Optional[torch.Tensor]], compute_dtype: torch.dtype) -> bool:
    """Every row length (d_model, ffn_dim: the weights' inner dims) a 16-byte multiple in ``compute_dtype``."""
    elem = torch.empty((), dtype=compute_dtype).element_size()
    dims = {d for w in weights if w is not None for d in w.shape[1:]}
    return not any((d * elem) % 16 for d in dims)


# Compute capabilities (major) with torch's fused grouped GEMM (CUTLASS, bf16): Hopper sm90 and
# datacenter Blackwell sm100. On any other GPU, and for any dtype but bf16 on these, torch's CUDA
# grouped_mm falls back to a loop over the groups that first copies ``offs`` to the host: a host
# sync in every GEMM, three per expert FFN forward and four in its backward.
FUSED_GROUPED_MM_MAJORS = (9, 10)


def fused_grouped_mm_on(device: torch.device) -> bool:
    """Whether torch runs grouped_mm on ``device`` (a CUDA device) as one fused kernel for bf16."""
    return torch.cuda.get_device_capability(device)[0] in FUSED_GROUPED_MM_MAJORS


# auto's rule for m6's fused Triton kernels (m6.moe.fused_experts): fine-grained experts, many and
# narrow (DeepSeek-V3, Qwen3-MoE, OLMoE: 64-256 experts, ffn 512-2048), where one torch grouped GEMM
# per product leaves most of the time in the permute/combine copies and the [N, F] activations.
# Wide experts (E 8, ffn 8192+) keep torch's CUTLASS grouped GEMM.
FUSED_MIN_EXPERTS = 16
FUSED_MAX_FFN = 2048
FUSED_MIN_CAPABILITY = 8  # bf16 tensor cores (Ampere and newer)


def fine_grained(num_experts: int, ffn_dim: int) -> bool:
    """Whether the experts are many and narrow enough for auto's fused choice."""
    return num_experts >= FUSED_MIN_EXPERTS and ffn_dim <= FUSED_MAX_FFN


def auto_picks_fused(device: torch.device, dtype: torch.dtype, weights: Sequence[Optional[torch.Tensor]]) -> bool:
    """auto's fused rule: CUDA, bf16 tokens, compute capability 8.0+, Triton installed, fine-grained
    experts (w_in [E, D, F] first in ``weights``)."""
    E, _, F = weights[0].shape
    # Not under torch's deterministic algorithms (train.deterministic): the fused combine adds with atomics.
    return (device.type == "cuda" and dtype == torch.bfloat16 and fine_grained(E, F) and fused_runs_on(device)
            and not torch.are_deterministic_algorithms_enabled()
            and torch.cuda.get_device_capability(device)[0] >= FUSED_MIN_CAPABILITY)


# The kernel as a number for the metrics (moe/<layer>/expert_kernel): scalars only travel to every logger.
EXPERT_KERNEL_CODES = {"loop": 0, "grouped_mm": 1, "fused": 2}


def planned_kernel(kernel: ExpertKernel, device: torch.device, dtype: torch.dtype, num_experts: int,
                   d_model: int, ffn_dim: int) -> str:
    """What ``choose_kernel`` will run for tokens of this device and dtype, for the start-up banner:
    the configured kernel, or for auto 'auto -> <kernel>' (before any tensor exists)."""
    if kernel != "auto":
        return kernel
    weights = [torch.empty(num_experts, d_model, ffn_dim, device="meta")]
    if auto_picks_fused(device, dtype, weights):
        return "auto -> fused"
    elem = torch.empty((), dtype=dtype).element_size()
    grouped = (grouped_mm_op() is not None and device.type == "cuda" and dtype == torch.bfloat16
               and fused_grouped_mm_on(device) and not (d_model * elem) % 16 and not (ffn_dim * elem) % 16)
    return f"auto -> {'grouped_mm' if grouped else 'loop'}"


def uses_fused(kernel: ExpertKernel, device: torch.device, dtype: torch.dtype,
               weights: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether ``choose_kernel`` will pick 'fused' for tokens of this device and compute dtype (an
    explicit 'fused' that cannot run raises its ConfigError here)."""
    if kernel == "fused":
        require_fused(device)
        _check_fused_determinism()
        return True
    return kernel == "auto" and auto_picks_fused(device, dtype, weights)


def choose_kernel(kernel: ExpertKernel, x_NK: torch.Tensor, weights: Sequence[Optional[torch.Tensor]]) -> str:
    """'loop', 'grouped_mm' or 'fused' for one layer call, from the configured choice, the device, dtype and shapes.

    ``auto`` takes m6's fused Triton kernels on CUDA in bf16 (compute capability 8.0+) with Triton
    installed, for fine-grained experts (``fine_grained``). Otherwise it takes the grouped kernel only
    where torch has a fused one: CUDA, bf16, compute capability 9.x or 10.x (CUTLASS grouped GEMM on
    Hopper and datacenter Blackwell), aligned shapes, and at least one row. Elsewhere (CPU, fp32,
    other GPUs) it keeps the loop, which is what m6 ran before. An explicit ``grouped_mm`` on CUDA
    where there is no fused kernel is refused: it would run torch's fallback, a host sync per GEMM
    (on CPU, grouped_mm runs in fp32 and bf16). An explicit ``fused`` without Triton, or on CPU
    outside Triton's interpreter, is a ConfigError naming the key.
    """
    return kernel_for(kernel, x_NK.device, x_NK.dtype, weights, x_NK.shape[0], x_NK.data_ptr() % 16 == 0)


def kernel_for(kernel: ExpertKernel, device: torch.device, dtype: torch.dtype,
               weights: Sequence[Optional[torch.Tensor]], num_rows: int, aligned: bool = True) -> str:
    """``choose_kernel`` from the tokens' device, dtype, row count and base-pointer alignment alone:
    what a layer call will run, known before its rows are gathered (a freshly gathered buffer is
    aligned). Raises what choose_kernel raises."""
    if kernel == "loop":
        return "loop"
    if kernel == "fused":
        require_fused(device)
        _check_fused_determinism()
        return "fused"
    if kernel == "grouped_mm":
        if grouped_mm_op() is None:
            raise ValueError(f"model.moe.expert_kernel=grouped_mm but torch {torch.__version__} has no grouped_mm")
        if device.type == "cuda":
            _check_fused_grouped_mm(device, dtype)
        if not (_strides_fit(weights, dtype) and aligned):
            dims = [d for w in weights if w is not None for d in w.shape[1:]]
            elem = torch.empty((), dtype=dtype).element_size()
            raise ValueError(f"model.moe.expert_kernel=grouped_mm: torch's grouped GEMM needs 16-byte strides, but "
                             f"d_model/ffn_dim {sorted(set(dims))} in {dtype} are not all multiples of "
                             f"{16 // elem} (or the tokens are not 16-byte aligned); use 'auto' or 'loop'")
        return "grouped_mm"
    if kernel != "auto":
        raise ValueError(f"model.moe.expert_kernel must be one of {EXPERT_KERNELS}, got {kernel!r}")
    if auto_picks_fused(device, dtype, weights):
        return "fused"
    if grouped_mm_op() is None or device.type != "cuda" or dtype != torch.bfloat16 or num_rows == 0:
        return "loop"
    if not fused_grouped_mm_on(device):
        return "loop"
    return "grouped_mm" if _strides_fit(weights, dtype) and aligned else "loop"


def _check_fused_determinism() -> None:
    if torch.are_deterministic_algorithms_enabled():
        raise ConfigError("model.moe.expert_kernel=fused adds each token's top-k expert outputs (and input gradients) "
                          "with atomics, so it is not bitwise reproducible; train.deterministic needs "
                          "model.moe.expert_kernel=auto, grouped_mm or loop")


def _check_fused_grouped_mm(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse an explicit grouped_mm on CUDA where torch would run its per-group fallback."""
    if dtype != torch.bfloat16:
        raise ConfigError(f"model.moe.expert_kernel=grouped_mm needs bf16 expert inputs on CUDA (train.precision "
                          f"bf16 or bf16-autocast), got {dtype}: torch fuses the grouped GEMM only in bf16 and "
                          f"otherwise loops over experts with a host sync per GEMM; use model.moe.expert_kernel=auto "
                          f"or loop")
    if not fused_grouped_mm_on(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"model.moe.expert_kernel=grouped_mm: torch has a fused grouped GEMM only for compute "
                          f"capability 9.x and 10.x (Hopper, datacenter Blackwell); this GPU is {major}.{minor}, where "
                          f"it loops over experts with a host sync per GEMM; use model.moe.expert_kernel=auto or loop")


def _segments(splits: Sequence[int]) -> list[tuple[int, int, int]]:
    """(expert, start, end) for experts that received tokens."""
    out, start = [], 0
    for e, n in enumerate(splits):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


class LoopGemms:
    """Per-expert torch.mm on each segment; weights cast per expert, so at most one expert's
    low-precision copy exists at a time."""

    name = "loop"

    def __init__(self, splits: Sequence[int], device: torch.device) -> None:
        self.num_experts = len(splits)
        self.segs = _segments(splits)

    def mm(self, a_NK: torch.Tensor, w_EKM: torch.Tensor, transpose_w: bool = False,
           out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
        """out[s:t] (+)= a[s:t] @ w[e] (or @ w[e].T) for each expert segment, in a's dtype."""
        M = w_EKM.shape[1] if transpose_w else w_EKM.shape[2]
        if out is None:
            out = a_NK.new_empty(a_NK.shape[0], M)
        for e, s, t in self.segs:
            w = w_EKM[e].to(a_NK.dtype)  # cast on use (a no-op when the dtypes agree)
            w = w.t() if transpose_w else w
            if accumulate:
                out[s:t].addmm_(a_NK[s:t], w)
            else:
                torch.mm(a_NK[s:t], w, out=out[s:t])
        return out

    def zero_tail(self, out_NM: torch.Tensor) -> torch.Tensor:
        """Host splits cover every row: nothing to do."""
        return out_NM

    def weight_grad(self, a_NK: torch.Tensor, g_NM: torch.Tensor) -> torch.Tensor:
        """[E, K, M] grad_w[e] = a[s:t].T @ g[s:t] in a's dtype; idle experts get exact zeros."""
        grad = a_NK.new_empty(self.num_experts, a_NK.shape[1], g_NM.shape[1])
        seen = set()
        for e, s, t in self.segs:
            torch.mm(a_NK[s:t].t(), g_NM[s:t], out=grad[e])
            seen.add(e)
        for e in range(self.num_experts):
            if e not in seen:
                grad[e].zero_()
        return grad


class GroupedGemms:
    """One torch grouped GEMM per product over all experts.

    Cast-on-use casts the whole stacked weight once per call (not per expert): a transient
    low-precision copy of one [E, K, M] weight (E*K*M*2 bytes in bf16) lives for the length of one
    GEMM and is not saved for backward; the loop's per-expert cast peaks at 1/E of that.
    """

    name = "grouped_mm"

    def __init__(self, splits: Sequence[int] | torch.Tensor, device: torch.device) -> None:
        if isinstance(splits, torch.Tensor):
            # Rows per expert on the device (int64 [E]): the row ends and the idle experts are
            # computed there, and nothing is read back (a dropless single-GPU layer, no host sync).
            # Rows past the last end (padding) are in no group: see zero_tail.
            self.num_experts = splits.numel()
            self.offs = torch.cumsum(splits, 0).to(torch.int32)
            self.idle_E: Optional[torch.Tensor] = (splits == 0).view(-1, 1, 1)
            self.idle: list[int] = []
        else:
            self.num_experts = len(splits)
            self.idle_E = None
            self.idle = [e for e, n in enumerate(splits) if n == 0]
            # Row ends written on the host from the splits the host already holds, into a (pinned, on
            # CUDA) buffer that is copied to the device asynchronously: no device read and no blocking
            # copy, so dispatch's host_ints stays the one host sync per layer forward.
            offs = torch.empty(self.num_experts, dtype=torch.int32, pin_memory=device.type == "cuda")
            offs.numpy()[:] = np.cumsum(np.asarray(splits, dtype=np.int64))
            self.offs = offs.to(device, non_blocking=True) if device.type == "cuda" else offs
        self._op = grouped_mm_op()

    def mm(self, a_NK: torch.Tensor, w_EKM: torch.Tensor, transpose_w: bool = False,
           out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
        """out (+)= grouped a @ w[e] (or @ w[e].T), in a's dtype."""
        w = w_EKM.to(a_NK.dtype)  # cast on use: the whole stack once, freed after this GEMM
        if transpose_w:
            w = w.transpose(1, 2)
        if a_NK.shape[0] == 0:
            y = a_NK.new_zeros(0, w.shape[2])
        else:
            y = self._op(a_NK, w, offs=self.offs)
        if out is None:
            return y
        if accumulate:
            return out.add_(y)
        return out.copy_(y)

    def zero_tail(self, out_NM: torch.Tensor) -> torch.Tensor:
        """With device counts the rows may outnumber the experts' segments (a dropless plan's padding
        tail, weight 0): no group covers them, so the GEMMs leave them unwritten; zero them in place
        (a fill: whatever they held cannot turn into NaN)."""
        if self.idle_E is not None and out_NM.shape[0]:
            tail_N = torch.arange(out_NM.shape[0], device=out_NM.device) >= self.offs[-1]
            out_NM.masked_fill_(tail_N.unsqueeze(1), 0)
        return out_NM

    def weight_grad(self, a_NK: torch.Tensor, g_NM: torch.Tensor) -> torch.Tensor:
        """[E, K, M] grad_w[e] = a[s:t].T @ g[s:t] in a's dtype; idle experts get exact zeros."""
        if a_NK.shape[0] == 0:
            # torch's stride check rejects a zero-length contraction; nothing to contract anyway.
            return a_NK.new_zeros(self.num_experts, a_NK.shape[1], g_NM.shape[1])
        grad = self._op(a_NK.t(), g_NM, offs=self.offs)
        # An empty group's output block is not written by every kernel version: zero it here,
        # from the host-side splits, or with a device mask (no device read either way; a fill, not
        # a multiply, so whatever the unwritten block held cannot turn into NaN).
        for e in self.idle:
            grad[e].zero_()
        if self.idle_E is not None:
            grad.masked_fill_(self.idle_E, 0)
        return grad


def build_gemms(name: str, splits: Sequence[int] | torch.Tensor, device: torch.device) -> LoopGemms | GroupedGemms:
    """The backend object for one layer call (``name`` from choose_kernel); ``splits`` host ints,
    or for grouped_mm the rows per expert as a device tensor (int64 [E])."""
    return GroupedGemms(splits, device) if name == "grouped_mm" else LoopGemms(splits, device)
