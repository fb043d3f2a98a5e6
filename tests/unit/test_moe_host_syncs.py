"""A MoE layer forward makes at most ONE host sync (the split sizes) and its backward none; a
dropless layer on one process with grouped_mm (or fused) experts makes none at all.

On CPU a device sync cannot be observed directly, so two nets hold the rule:
- a TorchDispatchMode records every aten op that must read device data on the host to run
  (nonzero, item, boolean-mask indexing, bincount, unique, repeat_interleave without output_size,
  tensors built from Python data, ...), forward and backward;
- every intended copy to the host goes through m6.moe.dispatch.host_ints, counted here.
On CUDA, torch.cuda.set_sync_debug_mode counts the real syncs as well.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import m6.moe.all_to_all as all_to_all_module
import m6.moe.dispatch as dispatch_module
from m6.moe import MoELayer
from m6.parallel import ParallelPlan, apply_plan, build_layout, create_process_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from dist_helpers import run_distributed  # noqa: E402

aten = torch.ops.aten

# Ops that read tensor data on the host to produce their result (a device sync on CUDA).
ALWAYS_SYNCING = {
    aten.nonzero.default, aten.nonzero_static.default, aten._local_scalar_dense.default, aten.item.default,
    aten.is_nonzero.default, aten.equal.default, aten.masked_select.default, aten.bincount.default,
    aten._unique.default, aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
    aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.histc.default,
}


def _is_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class SyncRecorder(TorchDispatchMode):
    """Records the name of every host-syncing op that runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.syncing: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ALWAYS_SYNCING:
            self.syncing.append(str(func))
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and _is_bool_index(args):
            self.syncing.append(f"{func} with a boolean mask")
        elif func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and kwargs.get("output_size") is None:
            self.syncing.append(f"{func} without output_size")
        return func(*args, **kwargs)


@pytest.fixture
def host_copies(monkeypatch):
    calls = []
    real = dispatch_module.host_ints

    def counted(*tensors):
        calls.append([t.numel() for t in tensors])
        return real(*tensors)

    monkeypatch.setattr(dispatch_module, "host_ints", counted)
    return calls


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("capacity_factor", [None, 1.25])
@pytest.mark.parametrize("masked", [False, True])
def test_moe_forward_syncs_once_and_backward_never(host_copies, kernel, capacity_factor, masked):
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 8, top_k=2, capacity_factor=capacity_factor, min_capacity=1, num_prototypes=2,
                     activation="swiglu", expert_kernel=kernel)
    x = torch.randn(3, 10, 16, requires_grad=True)
    mask = torch.rand(3, 10) > 0.3 if masked else None
    # The loop slices on the host, and a capacity makes the kept count data-dependent: one copy.
    copies = 0 if kernel == "grouped_mm" and capacity_factor is None else 1
    recorder = SyncRecorder()
    with recorder:
        y, aux = layer(x, mask)
    assert recorder.syncing == [] and len(host_copies) == copies
    with recorder:
        (y.square().sum() + aux).backward()
    assert recorder.syncing == [] and len(host_copies) == copies
    assert x.grad is not None and layer.router.weight.grad is not None
    # The recorder is not blind: the pre-redesign way of picking the routed rows is caught.
    with recorder:
        torch.ones(4).nonzero()
        torch.arange(4)[torch.arange(4) > 1]
    assert len(recorder.syncing) == 2


def _expert_parallel_syncs_and_payload(rank: int, world: int) -> None:
    """EP over 2 gloo ranks, capacity and padding on, under bf16 autocast: one host copy per
    forward (after the counts exchange), none in backward; tokens cross in bf16 both ways."""
    copies, payloads = [], []
    real_host_ints, real_a2a = all_to_all_module.host_ints, dist.all_to_all_single
    all_to_all_module.host_ints = lambda *t: copies.append(len(t)) or real_host_ints(*t)

    def observed_a2a(output, input, *args, **kwargs):  # the real collective, its payload noted
        payloads.append((input.dtype, input.numel() * input.element_size()))
        return real_a2a(output, input, *args, **kwargs)

    dist.all_to_all_single = observed_a2a
    groups = create_process_groups(build_layout(world, rank, 2, 4))
    # The chunked overlap (degree 2) too: its chunk indices are built on the device, not from host lists.
    for degree, exchanges in ((1, 4), (2, 8), ("auto", 4)):
        copies.clear()
        payloads.clear()
        torch.manual_seed(0)
        reference = MoELayer(16, 32, 4, top_k=2, capacity_factor=1.25, min_capacity=1)
        layer = MoELayer(16, 32, 4, top_k=2, capacity_factor=1.25, min_capacity=1)
        layer.load_state_dict(reference.state_dict())
        apply_plan(layer, ParallelPlan(split=[layer]), groups, a2a_overlap_degree=degree)
        g = torch.Generator().manual_seed(1)
        x_all, mask_all = torch.randn(4, 10, 16, generator=g), torch.rand(4, 10, generator=g) > 0.3
        mine = slice(2 * rank, 2 * rank + 2)
        recorder = SyncRecorder()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_ref, _ = reference(x_all, mask_all)
            with recorder:
                y, aux = layer(x_all[mine].clone().requires_grad_(True), mask_all[mine])
            forward_copies = len(copies)
            with recorder:
                (y.float().square().sum() + aux).backward()
        assert recorder.syncing == [] and forward_copies == 1 and len(copies) == 1, (degree, recorder.syncing)
        torch.testing.assert_close(y, y_ref[mine], rtol=0, atol=0)  # same bf16 expert inputs as one process
        token_payloads = [dtype for dtype, _ in payloads if dtype.is_floating_point]
        # dispatch, combine, and their two backward exchanges; each in `degree` chunks
        assert token_payloads == [torch.bfloat16] * exchanges, (degree, payloads)


def test_expert_parallel_forward_syncs_once_and_sends_the_compute_dtype():
    run_distributed(_expert_parallel_syncs_and_payload, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: counts real device syncs")
def test_moe_forward_syncs_once_on_cuda():
    torch.manual_seed(0)
    layer = MoELayer(64, 128, 8, top_k=2, capacity_factor=1.25).cuda()
    x = torch.randn(4, 32, 64, device="cuda", requires_grad=True)
    mask = torch.rand(4, 32, device="cuda") > 0.2
    y, aux = layer(x, mask)  # warm-up: one-time allocations and lazy inits may sync
    (y.sum() + aux).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as forward_warnings:
            warnings.simplefilter("always")
            y, aux = layer(x, mask)
        with warnings.catch_warnings(record=True) as backward_warnings:
            warnings.simplefilter("always")
            (y.sum() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in forward_warnings if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert not [w for w in backward_warnings if "synchroniz" in str(w.message)]
