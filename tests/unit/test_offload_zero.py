"""memory.offload=zero (ZeRO-Offload's layout): 16-bit weights on the device, the 16-bit roundings
of fp32 host masters after every step; the forward and backward are a 16-bit copy of the model's
(bitwise), so it trains like memory.offload=optimizer under bf16 up to the weights' rounding;
resume is exact (the masters are saved); streamed blocks, fp16 overflow skips, the delayed update
and the host optimizers compose; the device and host bytes per parameter are what docs/memory.md
says; what is not built is refused by name."""

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
    "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0", "train.precision=bf16",
    "logging.console=false", "checkpoint.every=0", "memory.host_optimizer=torch", "train.device=cpu",
]
ZERO = ["memory.offload=zero", "memory.offload_blocks=[]"]
STEPS = 4
# bf16 keeps 8 significant bits: a stored weight is the master to within 2**-9 relative. Over 4
# steps of this model the losses of the rounded and the fp32 weights differ by < 1e-4 relative
# (measured 7e-5 at step 1, where only the rounding differs); 1e-3 leaves room and still fails on
# a missed update or a wrong gradient (a step moves the loss by ~3e-3 relative here).
ROUNDING_REL = 1e-3


def trainer(path, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"run.dir={path}", *extra]))


def router_ids(model) -> set[int]:
    return {id(layer.router.weight) for layer in model.moe_layers().values()}


def weights_are_rounded_masters(tr: Trainer) -> None:
    """Every device weight is its fp32 host master rounded to 16 bits; a router's gate stays fp32."""
    off, routers = tr.update.offload, router_ids(tr.model)
    assert routers
    for name, p in tr.model.named_parameters():
        master = off.master(p)
        assert master.dtype == torch.float32 and master.device.type == "cpu", name
        assert p.dtype == (torch.float32 if id(p) in routers else off.weight_dtype), name
        assert torch.equal(p.detach().cpu(), master.to(p.dtype)), name


def test_weights_are_16bit_roundings_of_fp32_host_masters_after_every_step(tmp_path):
    tr = trainer(tmp_path, *ZERO)
    assert tr.update.offload.weight_dtype == torch.bfloat16
    weights_are_rounded_masters(tr)
    # The masters keep the fp32 initialisation: not all of it is representable in bf16.
    masters = torch.cat([m.view(-1) for m in tr.update.offload.masters.values()])
    assert not torch.equal(masters, masters.to(torch.bfloat16).float())
    for _ in range(2):
        row = tr.train_step()
        weights_are_rounded_masters(tr)
        assert row["skipped_steps"] == 0 and math.isfinite(row["loss"])
    optimized = {id(p) for g in tr.update.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(m) for m in tr.update.offload.masters.values()}


def test_forward_and_gradients_are_a_16bit_model_copys_bitwise(tmp_path):
    """Step 1 of zero (no accumulation) computes the loss and the gradients of the plain model cast
    to bf16 (its routers' gates kept fp32), bitwise: the host gradients are those 16-bit gradients,
    widened exactly to fp32."""
    args = ("train.micro_batch_size=8",)
    zero = trainer(tmp_path / "zero", *args, *ZERO)
    plain = trainer(tmp_path / "plain", *args)
    gates = {id(p): p.detach().clone() for p in plain.model.parameters() if id(p) in router_ids(plain.model)}
    plain.model.to(torch.bfloat16)
    for p in plain.model.parameters():
        if id(p) in gates:
            p.data = gates[id(p)]
    seen = {}

    def capture(tr, key, grads):
        finish = tr.update.finish

        def wrapped():
            finish()
            seen[key] = {n: g.detach().float().clone() for n, g in grads().items()}
        tr.update.finish = wrapped

    off = zero.update.offload
    capture(zero, "zero", lambda: {n: off.master(p).grad for n, p in zero.model.named_parameters()})
    capture(plain, "plain", lambda: {n: p.grad for n, p in plain.model.named_parameters()})
    assert zero.train_step()["loss"] == plain.train_step()["loss"]
    assert seen["zero"].keys() == seen["plain"].keys()
    for name, g in seen["zero"].items():
        assert torch.equal(g, seen["plain"][name]), name


@pytest.mark.parametrize("host_grads", ["fp32", "compute"])
def test_zero_trains_like_optimizer_offload_up_to_the_weights_rounding(tmp_path, host_grads):
    offload = trainer(tmp_path / "optimizer", "memory.offload=optimizer")
    zero = trainer(tmp_path / "zero", *ZERO, f"memory.host_grad_dtype={host_grads}")
    want = [offload.train_step()["loss"] for _ in range(STEPS)]
    got = [zero.train_step()["loss"] for _ in range(STEPS)]
    assert got == pytest.approx(want, rel=ROUNDING_REL)
    assert got != want  # the forward really reads the 16-bit weights
    # The masters follow the fp32 run's weights to the rounding's effect on the gradients.
    for p, q in zip(offload.model.parameters(), zero.model.parameters()):
        torch.testing.assert_close(zero.update.offload.master(q), offload.update.offload.master(p),
                                   rtol=0, atol=5e-3 * offload.cfg.optim.lr / 3e-3 * STEPS)


def test_resume_is_exact_and_checkpoints_hold_the_fp32_masters(tmp_path):
    straight = trainer(tmp_path / "straight", *ZERO)
    want = [straight.train_step()["loss"] for _ in range(STEPS)]
    first = trainer(tmp_path / "run", *ZERO)
    losses = [first.train_step()["loss"] for _ in range(2)]
    saved = {n: first.update.offload.master(p).clone() for n, p in first.model.named_parameters()}
    first.save_checkpoint(wait=True)
    resumed = trainer(tmp_path / "run", *ZERO, "checkpoint.resume=auto")
    assert resumed.step == 2
    for n, p in resumed.model.named_parameters():
        assert torch.equal(resumed.update.offload.master(p), saved[n]), n  # fp32, not the bf16 weights
    weights_are_rounded_masters(resumed)
    losses += [resumed.train_step()["loss"] for _ in range(STEPS - 2)]
    assert losses == want
    # The checkpoint is an fp32 one: memory.offload=optimizer resumes from it with the same masters,
    # and zero resumes from optimizer's (its masters are the saved fp32 weights, its weights their roundings).
    other = trainer(tmp_path / "run", "memory.offload=optimizer", "checkpoint.resume=auto")
    for n, p in other.model.named_parameters():
        assert torch.equal(other.update.offload.master(p), saved[n]), n
    other.train_step()
    other.save_checkpoint(wait=True)
    back = trainer(tmp_path / "run", *ZERO, "checkpoint.resume=auto")
    assert back.step == 3
    for (n, p), q in zip(back.model.named_parameters(), other.model.parameters()):
        assert torch.equal(back.update.offload.master(p), q.detach()), n
    weights_are_rounded_masters(back)


def test_streamed_blocks_are_16bit_homes_and_change_nothing(tmp_path):
    resident = trainer(tmp_path / "resident", *ZERO)
    streamed = trainer(tmp_path / "streamed", "memory.offload=zero", "memory.offload_blocks=[0,2]")
    off = streamed.update.offload
    homes = off.streamer.homes()
    block0 = [p for p in streamed.model.blocks[0].parameters()]
    assert block0 and all(id(p) in homes and homes[id(p)].dtype == torch.bfloat16 for p in block0)
    assert all(off.master(p).data_ptr() != homes[id(p)].data_ptr() for p in block0)  # masters apart
    assert not any(id(p) in homes for p in streamed.model.blocks[1].parameters())
    want = [resident.train_step()["loss"] for _ in range(3)]
    assert [streamed.train_step()["loss"] for _ in range(3)] == want
    for p in block0:  # idle: the param is its home, the rounding of the updated master
        assert p.data.data_ptr() == homes[id(p)].data_ptr()
        assert torch.equal(homes[id(p)], off.master(p).to(torch.bfloat16))
    weights_are_rounded_masters(streamed)


@pytest.mark.parametrize("host_grads", ["fp32", "compute"])
def test_fp16_overflow_in_the_device_backward_is_skipped(tmp_path, host_grads):
    """A loss scale of 2**40 overflows the fp16 gradients the device makes: the step is skipped
    (masters and weights untouched) and the scale backs off until the steps go through (fp32
    host gradient buffers, or fp16 ones)."""
    tr = trainer(tmp_path, "memory.offload=zero", "memory.offload_blocks=[1]", "train.precision=fp16",
                 "train.loss_scale_init=1099511627776", f"memory.host_grad_dtype={host_grads}")
    assert {p.dtype for p in tr.model.parameters() if id(p) not in router_ids(tr.model)} == {torch.float16}
    masters = {n: tr.update.offload.master(p).clone() for n, p in tr.model.named_parameters()}
    row = tr.train_step()
    assert row["skipped_steps"] == 1 and not math.isfinite(row["grad_norm"]) and row["loss_scale"] == 2.0 ** 39
    for n, p in tr.model.named_parameters():
        assert torch.equal(tr.update.offload.master(p), masters[n]), n
    weights_are_rounded_masters(tr)
    for _ in range(40):
        row = tr.train_step()
        if row["skipped_steps"] < tr.step:
            break
    assert row["skipped_steps"] < tr.step and math.isfinite(row["grad_norm"])
    weights_are_rounded_masters(tr)
    assert any(not torch.equal(tr.update.offload.master(p), masters[n]) for n, p in tr.model.named_parameters())


def test_delayed_update_composes_with_zero(tmp_path):
    args = ("optim.delayed_update=true", "optim.delayed_update_after=1")
    delayed = trainer(tmp_path / "zero", *ZERO, *args)
    reference = trainer(tmp_path / "optimizer", "memory.offload=optimizer", *args)
    got = [delayed.train_step()["loss"] for _ in range(STEPS)]
    want = [reference.train_step()["loss"] for _ in range(STEPS)]
    assert got == pytest.approx(want, rel=ROUNDING_REL)
    delayed.update.wait()
    delayed.update.delayed.catch_up()
    weights_are_rounded_masters(delayed)


@pytest.mark.parametrize("host_grads", ["fp32", "compute"])
def test_delayed_update_with_zero_resumes_exactly(tmp_path, host_grads):
    """The checkpoint holds the fp32 masters and the next forward's 16-bit device weights (one
    update behind): a resumed delayed zero run continues the uninterrupted one bitwise, with fp32
    and with 16-bit host gradients."""
    args = (*ZERO, "optim.delayed_update=true", "optim.delayed_update_after=1", f"memory.host_grad_dtype={host_grads}")
    straight = trainer(tmp_path / "straight", *args)
    want = [straight.train_step()["loss"] for _ in range(STEPS + 1)]
    first = trainer(tmp_path / "run", *args)
    losses = [first.train_step()["loss"] for _ in range(3)]
    first.save_checkpoint(wait=True)
    resumed = trainer(tmp_path / "run", *args, "checkpoint.resume=auto")
    assert resumed.step == 3
    assert losses + [resumed.train_step()["loss"] for _ in range(STEPS - 2)] == want


def test_host_optimizers_compose_with_zero(tmp_path):
    """DeepSpeed's CPU Adam (where its op builds) and m6's C++ Adafactor run zero's host update."""
    from m6.memory.host_adafactor import probe_adafactor_op
    from m6.memory.host_optimizer import probe_cpu_adam

    ran = 0
    for choice, extra, probe in (("deepspeed", [], probe_cpu_adam), ("auto", ["optim.name=adafactor"], probe_adafactor_op)):
        if probe(lambda line: None) is not None:
            continue
        tr = trainer(tmp_path / choice, *ZERO, f"memory.host_optimizer={choice}", *extra)
        assert tr.update.host_optimizer in ("deepspeed", "cpp")
        torch_run = trainer(tmp_path / f"{choice}-torch", *ZERO, *extra)
        got = [tr.train_step()["loss"] for _ in range(3)]
        assert got == pytest.approx([torch_run.train_step()["loss"] for _ in range(3)], rel=1e-4)
        weights_are_rounded_masters(tr)
        ran += 1
    if not ran:
        pytest.skip("neither DeepSpeed's CPU Adam nor m6's C++ Adafactor builds here")


def test_bytes_per_parameter_on_the_device_and_the_host(tmp_path):
    """Device: 2 B/param weights (4 for the routers' gates), gradients 2 B/param at most (16-bit,
    gone by the end of a backward at world 1). Host: fp32 masters 4, AdamW moments 8, gradients 4
    (fp32) or 2 (compute), plus the staging buffers of the copy back (2 B per 16-bit weight here,
    bounded by the chunk)."""
    for host_grads, grad_bytes in (("fp32", 4), ("compute", 2)):
        tr = trainer(tmp_path / host_grads, *ZERO, f"memory.host_grad_dtype={host_grads}",
                     "train.micro_batch_size=8")
        params = list(tr.model.parameters())
        n = sum(p.numel() for p in params)
        gates = sum(p.numel() for p in params if id(p) in router_ids(tr.model))
        nbytes = lambda ts: sum(t.untyped_storage().nbytes() for t in ts)  # noqa: E731
        off = tr.update.offload
        assert 0 < gates < 0.01 * n and nbytes(params) == 2 * n + 2 * gates
        row = tr.train_step()
        assert row["grad_mb"] * 2**20 <= 2 * n  # the most 16-bit gradient bytes held at a backward's end
        assert nbytes(off.masters.values()) == 4 * n
        assert nbytes(off._grad_buffers.values()) == grad_bytes * n
        state = [v for s in tr.update.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        assert nbytes(state) == 8 * n
        # Two buffers of the largest push (the copy back's segments: outside the blocks, each block).
        in_blocks = [[p for p in block.parameters() if p.dtype == torch.bfloat16] for block in tr.model.blocks]
        inside = {id(p) for block in in_blocks for p in block}
        outside = [p for p in params if id(p) not in inside and p.dtype == torch.bfloat16]
        largest = max(sum(p.numel() for p in segment) for segment in [outside, *in_blocks])
        assert off._half_push.staging_bytes() == 2 * 2 * largest


def test_staging_is_double_buffered_and_bounded_by_the_chunk():
    """Chunks smaller than the model: the tensors go through two alternating buffers, in pieces,
    and every device weight is the master's rounding."""
    from m6.memory.half_weight_push import HalfWeightPush

    push = HalfWeightPush(torch.bfloat16, torch.device("cpu"), None, chunk_numel=7)
    masters = [torch.randn(s) for s in ((3, 4), (5,), (2, 2, 2))]
    dsts = [torch.empty(m.shape, dtype=torch.bfloat16) for m in masters]
    for _ in range(2):
        push.push(list(zip(dsts, masters)))
        for d, m in zip(dsts, masters):
            assert torch.equal(d, m.to(torch.bfloat16))
        masters = [m * 3 for m in masters]
    assert push.max_staged_numel == 7 and all(b is not None for b in push._buffers)
    assert push.staging_bytes() == 2 * 7 * 2
    # Pushes that fit one chunk alternate between two buffers of the largest push's size.
    small = HalfWeightPush(torch.bfloat16, torch.device("cpu"), None, chunk_numel=64)
    small.push(list(zip(dsts[1:2], masters[1:2])))
    assert small._buffers[1] is None and small.staging_bytes() == 2 * 5
    for _ in range(2):
        small.push(list(zip(dsts, masters)))
        for d, m in zip(dsts, masters):
            assert torch.equal(d, m.to(torch.bfloat16))
    assert [b.numel() for b in small._buffers] == [25, 25] and small.staging_bytes() == 2 * 2 * 25


@pytest.mark.parametrize("overrides, message", [
    (["train.precision=fp32"], r"memory.offload=zero with train.precision=fp32"),
    (["parallel.shard=full"], r"memory.offload=zero with parallel.shard=full: zero keeps the 16-bit weights resident"),
    (["parallel.shard=optimizer", "memory.offload_blocks=all"],
     r"parallel.shard=optimizer and memory.offload_blocks=all: the partitioned zero keeps every weight resident"),
    (["parallel.shard=optimizer", "memory.offload_blocks=[]", "optim.name=adafactor"],
     r"parallel.shard=optimizer and optim.name=adafactor"),
    (["parallel.shard=optimizer", "memory.offload_blocks=[]", "parallel.pipeline_parallel_size=2"],
     r"parallel.shard=optimizer and parallel.pipeline_parallel_size=2: not built together; the pipeline takes"),
    (["parallel.tensor_parallel_size=2"], r"parallel.tensor_parallel_size=2 with memory.offload=zero"),
    (["model.share_layers=3", "model.moe.every=1", "memory.offload_blocks=all"], r"model.share_layers > 1 with memory.offload=zero"),
])
def test_what_zero_does_not_build_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, [*SMALL, "memory.offload=zero", *overrides])


def test_fp32_on_a_cpu_device_from_precision_auto_is_refused_at_start(tmp_path):
    with pytest.raises(ConfigError, match=r"memory.offload=zero with train.precision=auto, which is fp32 on cpu"):
        trainer(tmp_path, *ZERO, "train.precision=auto")
