"""m6.memory.adamw_copy: AdamW over fp32 masters that writes their bf16 copies, by m6's Triton kernel
(interpreted on CPU: tests/conftest.py sets TRITON_INTERPRET=1 on --device cpu; compiled with
--device cuda) and by torch's AdamW + one foreach copy. The kernel's moments are torch's bitwise on
CPU, its masters within an fp32 ulp or two (torch's CPU sqrt is not correctly rounded, the kernel's
is), every copy exactly its master rounded to bf16; the state loads into torch's AdamW; and a run
that updates with the kernel trains as cast-on-use does."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from m6.config import load
from m6.memory.adamw_copy import AdamWWithCopy
from m6.train.loop import Trainer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

SHAPES = [(1,), (37,), (3, 1000), (2049,), (4, 8, 33)]


@pytest.fixture
def kernel_device(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """The test device with the kernel built for it: interpreted on CPU, compiled on CUDA."""
    want_interpreter = device.type == "cpu"
    if want_interpreter:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from triton.runtime.interpreter import InterpretedFunction

    import m6.memory.triton_adamw_copy as kernels
    if isinstance(kernels._adamw_copy_kernel, InterpretedFunction) != want_interpreter:
        importlib.reload(kernels)
    return device


def build(kernel: str, device: torch.device, with_copy: list[bool]):
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in SHAPES]
    copies = {id(m): torch.empty_like(m, dtype=torch.bfloat16) for m, keep in zip(masters, with_copy) if keep}
    groups = [{"params": masters[:3], "weight_decay": 0.1}, {"params": masters[3:], "weight_decay": 0.0}]
    return masters, copies, AdamWWithCopy(groups, copies, kernel, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)


def test_kernel_equals_torch_adamw_and_cast(kernel_device):
    with_copy = [True, True, False, True, True]  # one master without a copy: updated only
    ref_masters, ref_copies, ref = build("torch", kernel_device, with_copy)
    masters, copies, fused = build("triton", kernel_device, with_copy)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        for a, b in zip(ref_masters, masters):
            grad = torch.randn(a.shape, generator=gen).to(kernel_device) * (10.0 if step == 3 else 1.0)
            a.grad, b.grad = grad.clone(), grad.clone()
        for group in (ref.param_groups + fused.param_groups):
            group["lr"] = 3e-3 * (step + 1)  # a schedule: the kernel reads the group's rate each step
        ref.step()
        fused.step()
        for a, b in zip(ref_masters, masters):
            sa, sb = ref.state[a], fused.state[b]
            assert float(sa["step"]) == float(sb["step"]) == step + 1
            if kernel_device.type == "cpu":  # torch's CUDA kernels round differently from its CPU ones
                assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
            # a few ulps of the update itself (lr up to 0.018): where p nearly cancels, relative error grows
            torch.testing.assert_close(b, a, rtol=3e-7, atol=1e-8)
            if id(b) in copies:
                assert torch.equal(copies[id(b)], b.detach().to(torch.bfloat16))  # nearest, ties to even
                assert torch.equal(ref_copies[id(a)], a.detach().to(torch.bfloat16))
    assert fused.describe().startswith("update: m6's Triton AdamW")


def test_kernel_state_loads_into_torch_adamw(kernel_device):
    masters, copies, fused = build("triton", kernel_device, [True] * len(SHAPES))
    for m in masters:
        m.grad = torch.ones_like(m)
    fused.step()
    plain = torch.optim.AdamW([{"params": masters[:3], "weight_decay": 0.1},
                               {"params": masters[3:], "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95), foreach=True)
    plain.load_state_dict(fused.state_dict())
    plain.step()  # continues from the kernel's moments and step count
    assert all(float(plain.state[m]["step"]) == 2 for m in masters)


def test_run_with_the_kernel_trains_like_cast_on_use(tmp_path, kernel_device, monkeypatch):
    """The whole update path (groups, schedule, clip, accumulation) with the kernel writing the copies."""
    import m6.train.update as update
    monkeypatch.setattr(update, "choose_adamw_copy_kernel", lambda device, implementation, dtype=None: "triton")
    base = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64",
            "model.max_text_len=32", "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4",
            "data.kind=synthetic", "data.num_workers=0", "data.num_samples=64", "data.eval_samples=8",
            "data.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
            "train.max_steps=4", "train.precision=bf16", "logging.console=false", "checkpoint.enabled=false",
            f"train.device={kernel_device.type}", "optim.apply_groups=2"]
    use = Trainer(load(None, [*base, f"run.dir={tmp_path / 'use'}"]))
    step = Trainer(load(None, [*base, f"run.dir={tmp_path / 'step'}", "train.weight_copy=per_step"]))
    assert "Triton AdamW" in step._facts().precision
    for a, b in zip(use.fit(), step.fit()):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2)
    masters = step.update.masters
    for p in masters.params:
        assert torch.equal(p.detach(), masters.master(p).to(torch.bfloat16))
