"""The MoE combine and the expert-parallel reordering (m6.moe.dispatch: combine_tokens, ungroup, and
sum_rows, the node-aware dispatcher's sums) keep only what their backward reads, with gradients
bitwise those of the plain autograd graph.

The reference below is that plain graph (``zeros.index_add(idx, y * w)``, ``index_copy``), whose
autograd keeps the weighted [N, D] rows in fp32 and ungroup's [N, D] source. A real forward and
backward of a tiny MoE model runs once with each: the losses and every parameter gradient must be
bitwise equal, and the saved-tensor meter must count exactly those [N, D] tensors fewer.
tests/dist/test_combine_saved_dist.py does the same under expert parallelism on 2 gloo ranks.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from m6 import config as m6config
from m6.model import M6Model
from m6.model.cast_on_use import set_cast_on_use
from m6.moe.dispatch import KeptAssignments
from tests.unit.test_activation_formula import metered_forward
from tests.unit.test_plan_memory import CONFIGS, SMALL

NARROW = ["model.d_model=32", "model.ffn_dim=64", "model.num_heads=2", "model.num_layers=2"]
# Every module that calls combine_tokens, ungroup or sum_rows by name.
MODULES = ["m6.moe.dispatch", "m6.moe.all_to_all", "m6.moe.chunked_all_to_all", "m6.moe.loopback",
           "m6.moe.node_aware_all_to_all"]


class ReferenceOps:
    """The plain autograd combine and ungroup, recording the [N, D] tensors their autograd keeps
    that the Functions do not: the weighted rows (accumulation dtype), ungroup's source."""

    def __init__(self) -> None:
        self.extra_bytes = 0
        self.calls: dict[str, int] = {}

    def _called(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

    def combine_tokens(self, y_ND: torch.Tensor, kept: KeptAssignments, out_dtype: torch.dtype) -> torch.Tensor:
        self._called("combine_tokens")
        acc_dtype = torch.promote_types(y_ND.dtype, kept.weights_N.dtype)
        weighted_ND = y_ND * kept.weights_N.to(acc_dtype).unsqueeze(-1)
        self.extra_bytes += weighted_ND.numel() * weighted_ND.element_size()
        out_TD = weighted_ND.new_zeros(kept.num_tokens, y_ND.shape[-1])
        return out_TD.index_add(0, kept.token_idx_N, weighted_ND).to(out_dtype)

    def ungroup(self, y_MD: torch.Tensor, order_M: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
        self._called("ungroup")
        self.extra_bytes += y_MD.numel() * y_MD.element_size()
        return torch.empty_like(y_MD).index_copy(0, order_M, y_MD).to(wire_dtype)

    def sum_rows(self, y_ND: torch.Tensor, idx_N: torch.Tensor, num_rows: int, acc_dtype: torch.dtype,
                 out_dtype: torch.dtype, weights_N: torch.Tensor | None = None) -> torch.Tensor:
        """The node-aware dispatcher's relay and source sums as they were: y cast to the
        accumulation dtype (kept by the multiply or by index_add), then weighted (kept by index_add)."""
        self._called("sum_rows")
        y_acc = y_ND.to(acc_dtype)
        self.extra_bytes += y_acc.numel() * y_acc.element_size()
        if weights_N is None:
            rows = y_acc
        else:
            rows = y_acc * weights_N.to(acc_dtype).unsqueeze(-1)
            self.extra_bytes += rows.numel() * rows.element_size()
            self.extra_bytes -= y_ND.numel() * y_ND.element_size()  # y itself, which sum_rows keeps
        return rows.new_zeros(num_rows, y_ND.shape[-1]).index_add(0, idx_N, rows).to(out_dtype)

    @contextlib.contextmanager
    def installed(self):
        """These ops in place of m6's in every module that calls them."""
        import importlib

        saved = []
        for name in MODULES:
            module = importlib.import_module(name)
            for op in ("combine_tokens", "ungroup", "sum_rows"):
                if hasattr(module, op):
                    saved.append((module, op, getattr(module, op)))
                    setattr(module, op, getattr(self, op))
        try:
            yield self
        finally:
            for module, op, fn in saved:
                setattr(module, op, fn)


def forward_backward(model: M6Model, cfg: m6config.Config, dtype: torch.dtype | None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(loss, every parameter gradient, bytes kept for backward) of one step, run as the training
    loop runs a precision: fp32 plain, below fp32 cast-on-use under an uncached autocast."""
    set_cast_on_use(model, dtype is not None)
    loss, held = metered_forward(model, cfg, 3, dtype)
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, held


def assert_bitwise(a: tuple, b: tuple, label: str) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b), (label, loss_a.item(), loss_b.item())
    assert grads_a.keys() == grads_b.keys(), label
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), (label, name)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_combine_keeps_less_with_bitwise_the_same_gradients(kernel, precision):
    cfg = m6config.load(CONFIGS / "tiny.yaml", SMALL + NARROW + [f"model.moe.expert_kernel={kernel}"])
    dtype = None if precision == "fp32" else torch.bfloat16
    runs = []
    reference = ReferenceOps()
    for ops in (contextlib.nullcontext(), reference.installed()):
        torch.manual_seed(0)
        model = M6Model(cfg.model)
        with ops:
            runs.append(forward_backward(model, cfg, dtype))
    (loss, grads, held), (ref_loss, ref_grads, ref_held) = runs
    assert grads, "no gradients"
    assert_bitwise((loss, grads), (ref_loss, ref_grads), f"{kernel} {precision}")
    # One weighted fp32 [N, D] per MoE layer fewer: N*D*4 bytes each, in any precision.
    assert reference.calls == {"combine_tokens": 1}, reference.calls  # one MoE layer
    assert ref_held - held == reference.extra_bytes, (ref_held, held, reference.extra_bytes)
