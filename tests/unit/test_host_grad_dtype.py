"""memory.host_grad_dtype=compute: offloaded gradients kept on the host in the compute dtype (bf16
or fp16, half the host bytes of fp32), the norm taken from them, the unscale and clip applied as
the update reads each group back in fp32. Trains like fp32 host gradients (bf16 and fp16, with a
forced overflow skipped), with accumulation, resumes, and refuses what it cannot do (no offload)."""

from __future__ import annotations

import math

import pytest
import torch

from m6.config import ConfigError, load
from m6.train.loop import Trainer

SMALL = [
    "model.d_model=32", "model.num_layers=3", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=256", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=8", "train.micro_batch_size=8", "train.eval_every=0",
    "logging.console=false", "checkpoint.every=0", "memory.host_optimizer=torch",
    "memory.offload=optimizer+params", "train.grad_clip=0.05", "optim.apply_groups=2",
]
STEPS = 5


def trainer(path, device: torch.device, *extra: str) -> Trainer:
    """``device``: pytest --device (tests/conftest.py)."""
    return Trainer(load(None, [*SMALL, f"train.device={device.type}", f"run.dir={path}", *extra]))


def host_grad_buffers(tr: Trainer) -> list[torch.Tensor]:
    return list(tr.update.offload._grad_buffers.values())


def watch_update_grads(tr: Trainer) -> list[float]:
    """Squared norms of the gradients the optimizer steps with, summed per step over the apply
    groups (AdamW is blind to a gradient's scale: the losses alone would not show a missed unscale)."""
    seen: list[float] = []

    def pre_step(optimizer, args, kwargs) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen[-1] += float(sum(g.double().square().sum() for g in grads))
    tr.update.optimizer.register_step_pre_hook(pre_step)
    step = tr.train_step

    def train_step():
        seen.append(0.0)
        return step()
    tr.train_step = train_step
    return seen


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_compute_dtype_host_grads_train_like_fp32_host_grads(tmp_path, device, precision):
    wide = trainer(tmp_path / "fp32", device, f"train.precision={precision}")
    half = trainer(tmp_path / "half", device, f"train.precision={precision}", "memory.host_grad_dtype=compute")
    want = torch.bfloat16 if precision == "bf16" else torch.float16
    assert {b.dtype for b in host_grad_buffers(half)} == {want}
    assert sum(b.nbytes for b in host_grad_buffers(half)) * 2 == sum(b.nbytes for b in host_grad_buffers(wide))
    stepped = {"fp32": watch_update_grads(wide), "half": watch_update_grads(half)}
    rows = {name: [tr.train_step() for _ in range(STEPS)] for name, tr in (("fp32", wide), ("half", half))}
    # The update steps with the unscaled, clipped gradient (norm grad_clip), in fp32 as from fp32 buffers.
    for name in rows:
        assert [math.sqrt(v) for v in stepped[name]] == pytest.approx([0.05] * STEPS, rel=1e-4), name
    assert rows["half"][0]["loss"] == rows["fp32"][0]["loss"]  # same weights, same forward
    # The norm is taken from 16-bit gradients; each clips (grad_clip 0.05 is far under the norms).
    norms = [r["grad_norm"] for r in rows["half"]]
    assert norms == pytest.approx([r["grad_norm"] for r in rows["fp32"]], rel=1e-2) and min(norms) > 0.05
    assert [r["loss"] for r in rows["half"]] == pytest.approx([r["loss"] for r in rows["fp32"]], rel=1e-3)
    # The update left no fp32 gradient behind on the host masters; the buffers are pinned on CUDA.
    assert all(m.grad is None for m in half.update.offload.masters.values())
    assert all(b.is_pinned() == (device.type == "cuda") for b in host_grad_buffers(half))


def test_fp16_overflow_in_a_16bit_host_gradient_skips_the_step_and_resumes(tmp_path, device):
    args = ("train.precision=fp16", "memory.host_grad_dtype=compute", "train.max_steps=10")
    tr = trainer(tmp_path, device, *args)
    tr.train_step()
    finish = tr.update.finish

    def finish_then_poison() -> None:
        finish()
        tr.update.offload.host_grads(tr.update.replicated)[0].view(-1)[0] = math.inf
    tr.update.finish = finish_then_poison
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    row = tr.train_step()
    assert not math.isfinite(row["grad_norm"]) and row["skipped_steps"] == 1 and row["loss_scale"] == 2.0 ** 15
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    tr.update.finish = finish
    tr.train_step()
    tr.save_checkpoint(wait=True)
    straight = tr.train_step()["loss"]
    resumed = trainer(tmp_path, device, *args)
    # Bitwise on the CPU; on CUDA the MoE combine's index_add adds with atomics (docs/gpu.md).
    assert resumed.step == 3 and resumed.train_step()["loss"] == (
        straight if device.type == "cpu" else pytest.approx(straight, rel=1e-5))


def test_the_memory_estimate_counts_16bit_host_grads_and_their_fp32_reads(tmp_path, device):
    from m6.memory.memory_report import estimate_memory
    from m6.train.optim import no_decay_ids

    reports = {}
    for dtype in ("fp32", "compute"):
        tr = trainer(tmp_path / dtype, device, "train.precision=bf16", f"memory.host_grad_dtype={dtype}")
        tr.train_step()
        reports[dtype] = estimate_memory(tr.cfg, tr.model, no_decay_ids(tr.model))
        assert reports[dtype].host["grads"] == sum(b.nbytes for b in host_grad_buffers(tr))
    largest_group = max(sum(m.numel() for m in group) for group in tr.update.apply.groups)
    extra = reports["compute"].host["optimizer step temporaries"] - reports["fp32"].host["optimizer step temporaries"]
    assert extra == 4 * largest_group  # one apply group's gradients read back in fp32


def test_accumulation_with_16bit_host_grads_sums_on_the_device_and_trains_like_fp32(tmp_path, device):
    """Two micro-batches per step: the 16-bit host gradients add up on the device in fp32 and leave
    once, in the last backward (a 16-bit sum on the host would round every add); the estimate
    counts them on the device until then."""
    from m6.memory.memory_report import estimate_memory
    from m6.train.optim import no_decay_ids

    args = ("train.precision=bf16", "train.micro_batch_size=4", "train.max_steps=3")
    wide = trainer(tmp_path / "fp32", device, *args)
    half = trainer(tmp_path / "half", device, *args, "memory.host_grad_dtype=compute")
    assert half.accum == 2
    rows = {name: [tr.train_step() for _ in range(3)] for name, tr in (("fp32", wide), ("half", half))}
    assert rows["half"][0]["loss"] == rows["fp32"][0]["loss"]
    assert [r["grad_norm"] for r in rows["half"]] == pytest.approx([r["grad_norm"] for r in rows["fp32"]], rel=1e-2)
    assert [r["loss"] for r in rows["half"]] == pytest.approx([r["loss"] for r in rows["fp32"]], rel=1e-3)
    assert rows["half"][-1]["skipped_steps"] == 0
    numel = sum(p.numel() for p in half.model.parameters())
    estimate = {name: estimate_memory(tr.cfg, tr.model, no_decay_ids(tr.model)).device["grads"]
                for name, tr in (("fp32", wide), ("half", half))}
    assert estimate == {"fp32": 0.0, "half": 4.0 * numel}  # one process: fp32 ones stream out every backward


def test_compute_dtype_host_grads_without_offload_is_a_config_error():
    with pytest.raises(ConfigError, match=r"memory.host_grad_dtype=compute only applies with memory.offload"):
        load(None, [*SMALL, "memory.offload=none", "memory.host_grad_dtype=compute", "memory.host_optimizer=auto"])
    with pytest.raises(ConfigError, match=r"parallel.shard=full with memory.host_grad_dtype=compute"):
        load(None, [*SMALL, "parallel.shard=full", "memory.host_grad_dtype=compute"])


def test_a_gradient_finite_in_fp32_stays_finite_in_an_fp16_host_buffer(device):
    """An fp32 gradient sum beyond fp16's range (here -3e5; 65504 is fp16's largest) is stored
    divided by the smallest power of two that fits it: its norm and the fp32 gradient the update
    reads are the fp32 sum's (to fp16 rounding), not inf; one within range is stored exactly."""
    from m6.memory.offload import HostOffload
    from m6.parallel.grad_sync import global_grad_norm

    big, small = torch.nn.Parameter(torch.zeros(4, device=device)), torch.nn.Parameter(torch.zeros(3, device=device))
    off = HostOffload([big, small], device, grad_dtype=torch.float16)
    grads = [torch.tensor([1e5, -3e5, 1.0, 0.0], device=device), torch.tensor([0.5, 2.0, 6e4], device=device)]
    big.grad, small.grad = (g.clone() for g in grads)
    off.grads_final([big, small])
    off.finish_backward()
    masters = off.masters_of([big, small])
    assert off.host_grad_factors(masters) == [8.0, 1.0]
    assert torch.equal(off.host_grads(masters)[1], grads[1].cpu().half())
    norm = global_grad_norm(off.host_grads(masters), [], None, device, off.host_grad_factors(masters))
    assert norm == pytest.approx(float(torch.cat(grads).double().norm()), rel=1e-3)
    off.materialize_grads(masters)
    for m, g in zip(masters, grads):
        assert m.grad.dtype == torch.float32 and torch.allclose(m.grad, g.cpu(), rtol=1e-3)
