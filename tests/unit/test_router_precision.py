"""model.moe.router_dtype: the router GEMM's precision (fp32 | tf32 | bf16 | auto), its logits fp32 in
every case, the TF32 setting held in forward AND backward (and restored), and the planner timing
the router GEMMs at their precision's rate."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from m6 import config as m6config
from m6.config_loader import ConfigError
from m6.model.flops import forward_flop_rates
from m6.moe.router import TopKRouter, router_gemm_precision
from m6.plan.memory import rank_model
from m6.plan.timing import GPUS, HostProfile, step_time

aten = torch.ops.aten


class MatmulPrecisions(TorchDispatchMode):
    """Records torch's CUDA fp32 matmul setting at every matmul the code runs (on the CPU the
    setting has no effect, so the record is what a GPU would obey)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten.mm.default, aten.addmm.default, aten.bmm.default):
            self.seen.append((torch.backends.cuda.matmul.fp32_precision, args[0].dtype))
        return func(*args, **(kwargs or {}))


def _route(router_dtype: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    router = TopKRouter(16, 8, top_k=2, router_dtype=router_dtype).to(dtype)
    x = torch.randn(12, 16, dtype=dtype, requires_grad=True)
    with MatmulPrecisions() as record:
        routing = router(x)
        (routing.weights_TK.sum() + routing.logits_TE.square().sum()).backward()
    return router, x, routing, record.seen


def test_auto_is_tf32_on_cuda_and_fp32_elsewhere():
    assert router_gemm_precision("auto", "cuda") == "tf32"
    assert router_gemm_precision("auto", "cpu") == "fp32"
    assert router_gemm_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="router_dtype"):
        TopKRouter(16, 8, router_dtype="fp8")


def test_config_key_accepts_the_precisions_and_names_itself_when_wrong():
    for value in ("auto", "fp32", "tf32", "bf16"):
        cfg = m6config.load("configs/tiny.yaml", [f"model.moe.router_dtype={value}"])
        assert cfg.model.moe.router_dtype == value
    with pytest.raises(ConfigError, match="model.moe.router_dtype"):
        m6config.load("configs/tiny.yaml", ["model.moe.router_dtype=fp16"])


def test_tf32_holds_in_forward_and_backward_and_is_restored():
    before = torch.backends.cuda.matmul.fp32_precision
    _, _, routing, seen = _route("tf32")
    # One forward GEMM and the backward's two (input and weight gradients), all on TF32.
    assert [p for p, _ in seen] == ["tf32"] * 3
    assert torch.backends.cuda.matmul.fp32_precision == before
    assert routing.logits_TE.dtype == torch.float32


def test_fp32_runs_no_matmul_on_tf32_and_equals_tf32_on_a_cpu():
    router, x, routing, seen = _route("fp32")
    assert [p for p, _ in seen] == [torch.backends.cuda.matmul.fp32_precision] * 3 != ["tf32"] * 3
    _, x_tf32, routing_tf32, _ = _route("tf32")
    # A CPU has no TF32: the same numbers, so the choice changes nothing here but the GPU setting.
    assert torch.equal(routing.logits_TE, routing_tf32.logits_TE)
    assert torch.equal(x.grad, x_tf32.grad)


def test_bf16_gemm_gives_fp32_logits_of_bf16_products_and_fp32_weight_gradients():
    router, x, routing, seen = _route("bf16")
    assert [d for _, d in seen] == [torch.bfloat16] * 3  # forward and both backward GEMMs in bf16
    expected = (x.detach().bfloat16() @ router.weight.detach().bfloat16().t()).float()
    assert routing.logits_TE.dtype == torch.float32
    assert torch.equal(routing.logits_TE.detach(), expected)
    exact = x.detach() @ router.weight.detach().t()
    assert not torch.equal(routing.logits_TE.detach(), exact)  # it did round
    assert router.weight.dtype == router.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("router_dtype", ["tf32", "bf16"])
def test_float64_reference_stays_exact(router_dtype):
    _, x, routing, seen = _route(router_dtype, torch.float64)
    router64, x64, exact, _ = _route("fp32", torch.float64)
    assert torch.equal(routing.logits_TE, exact.logits_TE)
    assert all(d == torch.float64 for _, d in seen)


def test_router_flops_are_their_own_share_and_the_planner_times_them_at_their_precision():
    cfg = m6config.load("configs/m6-base-moe.yaml", [])
    model = rank_model(cfg, 8, 8)
    rates = forward_flop_rates(model)
    moe = model.moe_layers().values()
    assert rates.router_per_position == sum(2 * layer.router.weight.numel() for layer in moe) > 0
    host = HostProfile(threads=1)

    def compute_s(gpu: str, router_dtype: str) -> float:
        c = m6config.load("configs/m6-base-moe.yaml", [f"model.moe.router_dtype={router_dtype}"])
        return step_time(c, 8, 8, 8, GPUS[gpu], host, model=model).compute

    h100 = {d: compute_s("h100", d) for d in ("fp32", "tf32", "bf16")}
    assert h100["fp32"] > h100["tf32"] > h100["bf16"]
    # The extra time over bf16 goes as (bf16 peak / router peak - 1): 989.4 / 67.0 fp32, / 494.7 tf32.
    assert (h100["fp32"] - h100["bf16"]) / (h100["tf32"] - h100["bf16"]) == pytest.approx(
        (989.4 / 67.0 - 1) / (989.4 / 494.7 - 1))
    # A V100 has no TF32 unit: an fp32 or tf32 router costs the same (its fp32 rate).
    assert compute_s("v100", "tf32") == pytest.approx(compute_s("v100", "fp32"))
