"""memory.zero_grad_landing (m6.memory.home_grads): zero's streamed blocks take their 16-bit
gradients into their 16-bit host homes. The run is bitwise the run with separate gradient buffers
(with and without accumulation, fp16's skipped steps included), resumes exactly, and holds one
16-bit buffer less per streamed parameter on the host; the delayed update and the layouts without
16-bit homes or 16-bit gradients are refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from m6.config import ConfigError, load
from m6.memory.home_grads import grads_land_in_homes
from m6.train.loop import Trainer

SMALL = [
    "model.d_model=32", "model.num_layers=3", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=256", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=8", "train.micro_batch_size=8", "train.eval_every=0", "train.precision=bf16",
    "logging.console=false", "checkpoint.every=0", "memory.host_optimizer=torch", "train.device=cpu",
]
STREAMED = ["memory.offload=zero", "memory.offload_blocks=[0,2]", "memory.host_grad_dtype=compute"]
STEPS = 6


def trainer(path, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"run.dir={path}", *STREAMED, *extra]))


def host_bytes(tr: Trainer) -> int:
    """Bytes of the offload's host tensors (masters, homes, gradient buffers), each storage once."""
    off = tr.update.offload
    tensors = [*off.masters.values(), *off.streamer.homes().values(), *off._grad_buffers.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def streamed_16bit(tr: Trainer) -> list[torch.nn.Parameter]:
    homes = tr.update.offload.streamer.homes()
    return [p for p in tr.model.parameters() if id(p) in homes and homes[id(p)].dtype == torch.bfloat16]


def test_auto_lands_in_the_homes_where_it_applies():
    def cfg(*extra):
        return load(None, [*SMALL, *extra])
    assert grads_land_in_homes(cfg(*STREAMED))
    assert not grads_land_in_homes(cfg(*STREAMED, "memory.zero_grad_landing=separate"))
    assert not grads_land_in_homes(cfg("memory.offload=zero", "memory.offload_blocks=[0,2]"))  # fp32 host gradients
    assert not grads_land_in_homes(cfg(*STREAMED, "optim.delayed_update=true"))
    assert not grads_land_in_homes(cfg("memory.offload=optimizer+params", "memory.host_grad_dtype=compute"))


@pytest.mark.parametrize("micro_batch", [8, 4], ids=["one-micro-batch", "accumulate-2"])
def test_losses_and_masters_are_bitwise_the_separate_buffers_run(tmp_path, micro_batch):
    home = trainer(tmp_path / "home", f"train.micro_batch_size={micro_batch}")
    separate = trainer(tmp_path / "separate", f"train.micro_batch_size={micro_batch}",
                       "memory.zero_grad_landing=separate")
    off = home.update.offload
    homes = off.streamer.homes()
    params = streamed_16bit(home)
    assert params and all(off._grad_buffers[id(p)] is homes[id(p)] for p in params)
    assert separate.update.offload.home_grads is None
    finish = home.update.finish
    landed = []

    def check_landing():  # the clip and the update read the gradients from the homes
        finish()
        filled = {id(t) for t in off.host_grads(off.masters_of(params))}
        landed.append(all(id(homes[id(p)]) in filled for p in params))
    home.update.finish = check_landing
    want = [separate.train_step()["loss"] for _ in range(STEPS)]
    got = [home.train_step()["loss"] for _ in range(STEPS)]
    assert got == want and all(math.isfinite(x) for x in got)
    assert landed == [True] * STEPS
    for p, q in zip(home.model.parameters(), separate.model.parameters()):
        assert torch.equal(off.master(p), separate.update.offload.master(q))
    for p in params:  # idle again: the home holds the rounding of the updated master
        assert torch.equal(homes[id(p)], off.master(p).to(torch.bfloat16))
        assert p.data.data_ptr() == homes[id(p)].data_ptr()


def test_host_bytes_drop_by_the_streamed_gradient_buffers(tmp_path):
    home = trainer(tmp_path / "home")
    separate = trainer(tmp_path / "separate", "memory.zero_grad_landing=separate")
    saved = 2 * sum(p.numel() for p in streamed_16bit(home))
    assert saved > 0 and home.update.offload.home_grads.nbytes() == saved
    assert host_bytes(separate) - host_bytes(home) == saved
    home.train_step()
    separate.train_step()
    assert host_bytes(separate) - host_bytes(home) == saved  # no buffer allocated later


def test_resume_is_exact(tmp_path):
    straight = trainer(tmp_path / "straight")
    want = [straight.train_step()["loss"] for _ in range(4)]
    first = trainer(tmp_path / "run")
    losses = [first.train_step()["loss"] for _ in range(2)]
    first.save_checkpoint(wait=True)
    resumed = trainer(tmp_path / "run", "checkpoint.resume=auto")
    assert resumed.step == 2 and resumed.update.offload.home_grads is not None
    off = resumed.update.offload
    for p in streamed_16bit(resumed):
        assert torch.equal(off.streamer.homes()[id(p)], off.master(p).to(torch.bfloat16))
    losses += [resumed.train_step()["loss"] for _ in range(2)]
    assert losses == want


def test_a_skipped_step_gives_the_homes_their_weights_back(tmp_path):
    """fp16 overflow: the gradients landed in the homes, no update recast them; the homes are cast
    again from the unchanged masters, and the run stays bitwise the separate buffers' run."""
    args = ("train.precision=fp16", "train.loss_scale_init=1099511627776")
    home = trainer(tmp_path / "home", *args)
    separate = trainer(tmp_path / "separate", *args, "memory.zero_grad_landing=separate")
    off = home.update.offload
    homes = off.streamer.homes()
    params = [p for p in home.model.parameters() if id(p) in homes and homes[id(p)].dtype == torch.float16]
    assert params
    rows = [home.train_step() for _ in range(3)]
    assert rows[0]["skipped_steps"] == 1  # 2**40 overflows
    assert [r["loss"] for r in rows] == [separate.train_step()["loss"] for _ in range(3)]
    assert not off.home_grads.holding
    for p in params:
        assert torch.equal(homes[id(p)], off.master(p).to(torch.float16))


@pytest.mark.parametrize("overrides, message", [
    (["memory.offload=zero", "memory.host_grad_dtype=compute", "memory.zero_grad_landing=home",
      "optim.delayed_update=true"], r"memory.zero_grad_landing=home with optim.delayed_update=true"),
    (["memory.offload=zero", "memory.zero_grad_landing=home"],
     r"memory.zero_grad_landing=home with memory.offload=zero, memory.host_grad_dtype=fp32"),
    (["memory.offload=optimizer+params", "memory.host_grad_dtype=compute", "memory.zero_grad_landing=home"],
     r"memory.zero_grad_landing=home with memory.offload=optimizer\+params"),
])
def test_what_cannot_land_in_the_homes_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, [*SMALL, *overrides])


def test_the_estimate_counts_the_gradient_buffers_the_runtime_allocates(tmp_path):
    """m6.memory.estimate.zero_memory (the planner's bytes): the host gradients of a streamed run
    are the runtime's own buffers (the estimate counts a router's gate at 2 B in a streamed block,
    whose runtime home is fp32 and keeps a 2 B gradient buffer of its own)."""
    from m6.memory.memory_report import estimate_memory
    from m6.model.param_groups import no_decay_ids

    for landing in ("home", "separate"):
        tr = trainer(tmp_path / landing, f"memory.zero_grad_landing={landing}")
        off = tr.update.offload
        homes = {h.untyped_storage().data_ptr() for h in off.streamer.homes().values()}
        own = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in off._grad_buffers.values()
               if b.untyped_storage().data_ptr() not in homes}
        est = estimate_memory(tr.cfg, tr.model, no_decay_ids(tr.model), 1, 1, "cpu")
        streamed_gates = sum(p.numel() for p in tr.model.parameters()
                             if id(p) in off.streamer.homes() and off.streamer.homes()[id(p)].dtype == torch.float32)
        assert abs(est.host["grads"] - sum(own.values())) <= 2 * streamed_gates, (landing, est.host["grads"])
