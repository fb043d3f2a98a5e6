"""The fused expert FFN (m6.moe.fused_experts) against its float64 reference: output and every
gradient (tokens, router weights, each expert weight), over awkward routings.

On CPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by the
``fused_device`` fixture before the kernels are built), so CI tests the same kernel code a GPU
runs; ``pytest --device cuda`` runs them compiled, in bf16. Shapes are tiny: the interpreter runs
every tile as numpy calls.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m6.config import ConfigError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture
def fused_device(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """The test device, with the kernels built for it: interpreted on CPU, compiled on CUDA."""
    want_interpreter = device.type == "cpu"
    if want_interpreter:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from triton.runtime.interpreter import InterpretedFunction

    import m6.moe.triton_expert_kernels as tk

    if isinstance(tk.gather_gemm_act_kernel, InterpretedFunction) != want_interpreter:
        importlib.reload(tk)  # @triton.jit chose interpreted or compiled when the module was imported
    return device


def _routing(T: int, E: int, K: int, gen: torch.Generator, allowed: list[int] | None = None,
             skew: bool = False) -> tuple[torch.Tensor, list[int]]:
    """(token of each routed row grouped by expert [N], rows per expert) for a random top-K routing."""
    experts = allowed if allowed is not None else list(range(E))
    weights = torch.ones(len(experts), dtype=torch.float64)
    if skew:
        weights[0] = 1000.0  # almost every token's first choice
    ids = torch.tensor(experts)[torch.stack([torch.multinomial(weights, K, generator=gen) for _ in range(T)])]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order // K, torch.bincount(flat, minlength=E).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30))


def _check(device, T, D, Fd, E, activation, src, splits, routed=True, seed=0, device_counts=False):
    from m6.moe.fused_experts import fused_expert_ffn, reference_expert_ffn

    gen = torch.Generator().manual_seed(seed)
    N = sum(splits)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    probs = torch.rand(N, generator=gen, dtype=torch.float64) if routed else None
    w_in = torch.randn(E, D, Fd, generator=gen, dtype=torch.float64) * D ** -0.5
    w_out = torch.randn(E, Fd, D, generator=gen, dtype=torch.float64) * Fd ** -0.5
    w_gate = torch.randn(E, D, Fd, generator=gen, dtype=torch.float64) * D ** -0.5 if activation == "swiglu" else None
    dy = torch.randn(T, D, generator=gen, dtype=torch.float64)
    names = ["x", "probs", "w_in", "w_out", "w_gate"]
    leaves = {k: v.requires_grad_(True) for k, v in zip(names, (x, probs, w_in, w_out, w_gate)) if v is not None}
    ref = reference_expert_ffn(x, src, probs, splits, activation, w_in, w_out, w_gate, T)
    ref_grads = torch.autograd.grad(ref, list(leaves.values()), dy)

    # fp32 through the interpreter (exact products); bf16 tokens with fp32 weights (cast-on-use) on CUDA.
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tol = 1e-5 if device.type == "cpu" else 3e-2
    ours = {k: (v.detach().to(device, dtype if k == "x" else torch.float32)).requires_grad_(True)
            for k, v in leaves.items()}
    src_d = src.to(device) if routed else None
    counts = torch.tensor(splits, dtype=torch.int64, device=device) if device_counts else splits
    y = fused_expert_ffn(ours["x"], src_d, ours.get("probs"), counts, activation, ours["w_in"], ours["w_out"],
                         ours.get("w_gate"), T, torch.float32, num_rows=N if device_counts else None)
    grads = torch.autograd.grad(y, list(ours.values()), dy.to(device, y.dtype))
    errors = {"y": _rel(y.cpu(), ref)} | {f"d{k}": _rel(g.cpu(), r) for k, g, r in zip(ours, grads, ref_grads)}
    assert y.dtype == torch.float32 and y.shape == ref.shape
    for k, g in zip(ours, grads):
        assert g.dtype == ours[k].dtype and g.shape == ours[k].shape, k
    assert max(errors.values()) < tol, errors


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_routed_matches_reference_with_an_empty_expert(fused_device, activation):
    gen = torch.Generator().manual_seed(1)
    src, splits = _routing(24, 5, 2, gen, allowed=[0, 1, 3, 4])  # expert 2 gets no rows
    assert splits[2] == 0
    _check(fused_device, 24, 16, 32, 5, activation, src, splits)


def test_routed_one_token(fused_device):
    gen = torch.Generator().manual_seed(2)
    src, splits = _routing(1, 4, 2, gen)
    _check(fused_device, 1, 16, 24, 4, "swiglu", src, splits)


def test_routed_very_uneven_counts(fused_device):
    """One expert takes nearly every token (several row tiles), the others one or two rows."""
    gen = torch.Generator().manual_seed(3)
    src, splits = _routing(40, 6, 2, gen, skew=True)
    assert max(splits) >= 35 and min(splits) <= 8
    _check(fused_device, 40, 32, 16, 6, "swiglu", src, splits)


def test_routed_top_k_equals_num_experts(fused_device):
    gen = torch.Generator().manual_seed(4)
    src, splits = _routing(8, 4, 4, gen)
    assert splits == [8, 8, 8, 8]
    _check(fused_device, 8, 16, 32, 4, "swiglu", src, splits)


def test_grouped_form_and_uneven_dims(fused_device):
    """Rows already dispatched (the expert-parallel path): no gather, no router weight; d_model and
    ffn_dim not multiples of the tile size."""
    splits = [0, 13, 2, 0]
    _check(fused_device, sum(splits), 20, 12, 4, "swiglu", None, splits, routed=False)


@pytest.mark.parametrize("case", ["empty-expert", "uneven", "grouped"])
def test_tile_tables_built_on_the_device(fused_device, case):
    """Rows per expert as a device tensor (the dropless local path, no host sync): the tile tables
    are built on the device, padded to the most tiles there can be; the results equal the reference."""
    from m6.moe.fused_experts import RowTiles

    gen = torch.Generator().manual_seed(6)
    if case == "empty-expert":
        src, splits = _routing(24, 5, 2, gen, allowed=[0, 1, 3, 4])
        _check(fused_device, 24, 16, 32, 5, "swiglu", src, splits, device_counts=True)
    elif case == "uneven":
        src, splits = _routing(40, 6, 2, gen, skew=True)
        _check(fused_device, 40, 32, 16, 6, "gelu", src, splits, device_counts=True)
    else:
        splits = [0, 13, 2, 0]
        _check(fused_device, sum(splits), 20, 12, 4, "swiglu", None, splits, routed=False, device_counts=True)
    host = RowTiles(splits, 16, torch.device("cpu"))
    dev = RowTiles.from_device_counts(torch.tensor(splits), sum(splits), 16)
    assert dev.num_tiles == -(-sum(splits) // 16) + len(splits) >= host.num_tiles
    assert torch.equal(dev.tiles[:, :host.num_tiles], host.tiles) and torch.equal(dev.segs, host.segs)
    assert (dev.tiles[1:, host.num_tiles:] == sum(splits)).all()  # the padding tiles are empty


def test_no_rows_at_all(fused_device):
    _check(fused_device, 5, 16, 16, 3, "gelu", torch.zeros(0, dtype=torch.int64), [0, 0, 0])


@pytest.mark.parametrize("dispatcher", ["local", "unfused"])
def test_moe_layer_fused_equals_loop(fused_device, dispatcher):
    """The whole layer (router, capacity drops, combine): fused and loop agree on the output and on
    every gradient, the router's included; the layer says which kernel ran. ``local``: the local
    dispatcher hands the routing to the kernels (gather and combine fused); ``unfused``: a
    dispatcher that permutes and combines itself, as the expert-parallel ones do (the kernels get
    rows already grouped by expert)."""
    from m6.moe import MoELayer
    from m6.moe.dispatch import Dispatcher, LocalDispatcher

    class PermutingDispatcher(LocalDispatcher):
        def dispatch_compute_combine(self, x_TD, plan, experts, out_dtype):
            return Dispatcher.dispatch_compute_combine(self, x_TD, plan, experts, out_dtype)

    device = fused_device
    D, Fd, E = 16, 32, 4
    layers = {k: MoELayer(D, Fd, E, top_k=2, capacity_factor=0.75, activation="swiglu", expert_kernel=k,
                          init_seed=7).to(device) for k in ("loop", "fused")}
    layers["fused"].load_state_dict(layers["loop"].state_dict())
    if dispatcher == "unfused":
        layers["fused"].dispatcher = PermutingDispatcher()
    x = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(5)).to(device)
    results = {}
    for name, layer in layers.items():
        xx = x.clone().requires_grad_(True)
        dtype = torch.bfloat16 if device.type == "cuda" else None
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            y, aux = layer(xx)
        (y.float().square().sum() + aux).backward()
        results[name] = [y, xx.grad] + [p.grad for p in layer.parameters()]
        assert layer.experts.last_kernel == name
    assert float(layers["loop"].stats.dropped) > 0  # capacity dropped some assignments
    tol = 1e-5 if device.type == "cpu" else 3e-2
    for ours, ref in zip(results["fused"], results["loop"]):
        assert _rel(ours.float(), ref.double()) < tol


@pytest.mark.parametrize("masked", [False, True])
def test_dropless_fused_layer_reads_nothing_back(fused_device, monkeypatch, masked):
    """Dropless, local experts, fused kernels: the rows per expert stay on the device (padding rows
    dispatched with weight 0), so no host copy is made, forward or backward (on CUDA torch counts
    the syncs); output and gradients equal the loop's, which reads the counts and skips padding."""
    import warnings

    import m6.moe.dispatch as dispatch_module
    from m6.moe import MoELayer

    copies = []
    real = dispatch_module.host_ints
    monkeypatch.setattr(dispatch_module, "host_ints", lambda *t: copies.append(len(t)) or real(*t))
    device = fused_device
    D, Fd, E = 16, 32, 4
    layers = {k: MoELayer(D, Fd, E, top_k=2, capacity_factor=None, activation="swiglu", expert_kernel=k,
                          init_seed=7).to(device) for k in ("loop", "fused")}
    layers["fused"].load_state_dict(layers["loop"].state_dict())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 12, D, generator=gen).to(device)
    mask = (torch.rand(2, 12, generator=gen) > 0.3).to(device) if masked else None
    dtype = torch.bfloat16 if device.type == "cuda" else None
    results, syncs = {}, {}
    for name, layer in layers.items():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            layer(x, mask)[0].float().sum().backward()  # warm-up: compiles, lazy inits
        layer.zero_grad(set_to_none=True)
        copies.clear()
        xx = x.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    y, aux = layer(xx, mask)
                (y.float().square().sum() + aux).backward()
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        syncs[name] = (len(copies), len([w for w in caught if "synchroniz" in str(w.message)]))
        results[name] = [y, xx.grad] + [p.grad for p in layer.parameters()]
        assert layer.experts.last_kernel == name
    assert syncs["fused"] == (0, 0) and syncs["loop"][0] == 1, syncs
    tol = 1e-5 if device.type == "cpu" else 3e-2
    for ours, ref in zip(results["fused"], results["loop"]):
        assert _rel(ours.float(), ref.double()) < tol


def test_second_backward_is_refused(fused_device):
    from m6.moe.fused_experts import fused_expert_ffn

    device = fused_device
    x = torch.randn(6, 16, device=device, requires_grad=True)
    w = [torch.randn(2, 16, 16, device=device, requires_grad=True) * 0.1 for _ in range(3)]
    y = fused_expert_ffn(x, None, None, [4, 2], "swiglu", w[0], w[1], w[2])
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run twice"):
        y.sum().backward()


def test_fused_without_triton_is_a_config_error(monkeypatch):
    """The key and the missing package are named: at config validation and at construction."""
    from m6.config import MoEConfig
    from m6.moe.experts import GroupedExperts

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    cfg = MoEConfig(expert_kernel="fused")
    with pytest.raises(ConfigError, match=r"model\.moe\.expert_kernel=fused.*'triton'"):
        cfg.validate()
    with pytest.raises(ConfigError, match=r"model\.moe\.expert_kernel=fused.*'triton'"):
        GroupedExperts(4, 16, 16, "swiglu", expert_kernel="fused")


def test_fused_on_cpu_without_the_interpreter_is_a_config_error(monkeypatch):
    from m6.moe.experts import GroupedExperts

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    experts = GroupedExperts(2, 16, 16, "swiglu", expert_kernel="fused")
    with pytest.raises(ConfigError, match=r"model\.moe\.expert_kernel=fused"):
        experts(torch.randn(3, 16), [1, 2])


def test_fused_under_deterministic_algorithms_is_a_config_error(fused_device):
    """Atomic adds are not bitwise reproducible: train.deterministic refuses an explicit fused."""
    from m6.moe.experts import GroupedExperts

    experts = GroupedExperts(2, 16, 16, "swiglu", expert_kernel="fused").to(fused_device)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(ConfigError, match=r"model\.moe\.expert_kernel=fused.*train\.deterministic"):
            experts(torch.randn(3, 16, device=fused_device), [1, 2])
    finally:
        torch.use_deterministic_algorithms(before)


def test_auto_keeps_todays_paths_on_cpu(fused_device):
    """auto never picks the Triton kernels off CUDA (the interpreter is a test mode, not a path)."""
    from m6.moe.expert_gemm import fine_grained, planned_kernel
    from m6.moe.experts import GroupedExperts

    if fused_device.type != "cpu":
        pytest.skip("CPU rule")
    experts = GroupedExperts(32, 16, 16, "swiglu", expert_kernel="auto")
    assert fine_grained(32, 16)
    experts(torch.randn(4, 16), [1] * 4 + [0] * 28)
    assert experts.last_kernel == "loop"
    assert not fine_grained(8, 8192) and not fine_grained(64, 4096) and fine_grained(128, 768)
    assert planned_kernel("auto", fused_device, torch.float32, 128, 2048, 768) == "auto -> loop"
    assert planned_kernel("fused", fused_device, torch.float32, 128, 2048, 768) == "fused"


def compile_for_hopper() -> None:
    """Lower each kernel, in the variants a SwiGLU layer launches, to sm_90 code (no GPU needed)
    and check it uses wgmma. Ints and pointers are marked 16-divisible, as the launcher's
    specialisation marks d_model/ffn_dim multiples of 16 and torch's aligned storage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import m6.moe.triton_expert_kernels as tk

    pointer_types = {"*bf16": ("x_ptr", "h_ptr", "g_ptr", "a_ptr", "aw_ptr", "a1_ptr", "a2_ptr", "w_ptr", "dy_ptr",
                               "b1_ptr", "b2_ptr"),
                     "*fp32": ("w1_ptr", "w2_ptr", "scale_ptr", "dscale_ptr", "out_ptr", "out1_ptr", "out2_ptr"),
                     "*i64": ("src_ptr", "dst_ptr", "a_src_ptr", "b_src_ptr"), "*i32": ("tiles_ptr", "segs_ptr")}
    types = {name: t for t, names in pointer_types.items() for name in names}
    blocks = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)
    cases = [(tk.gather_gemm_act_kernel, dict(GATHER=True, ACT=tk.SWIGLU, EVEN_K=True, PRECISION="tf32", **blocks)),
             (tk.grouped_gemm_scatter_kernel, dict(TWO=True, SCALE=False, SCATTER=True, EVEN_K=True, PRECISION="tf32",
                                                   **blocks)),
             (tk.gather_gemm_act_backward_kernel, dict(GATHER=True, ACT=tk.SWIGLU, SCALE=True, EVEN_K=True,
                                                       PRECISION="tf32", **blocks)),
             (tk.grouped_weight_grad_kernel, dict(GATHER_A=True, GATHER_B=False, TWO=True, PRECISION="tf32",
                                                  BLOCK_K=128, BLOCK_N=128, BLOCK_R=64))]
    for kernel, consts in cases:
        names = kernel.arg_names
        signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if n not in consts and n not in ("num_tiles", "E")}
        src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
        assert "wgmma.mma_async" in compiled.asm["ptx"], kernel.fn.__name__


def test_kernels_compile_for_hopper(device):
    """The compiled path, not only the interpreter's, lowers to Hopper code. In a fresh process:
    running the interpreter patches triton.language in this one. On a GPU the tests above compile
    the kernels for real."""
    if device.type == "cuda":
        pytest.skip("the CUDA run compiles the kernels for its own GPU")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", "from tests.unit.test_fused_experts import compile_for_hopper as c; c()"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
