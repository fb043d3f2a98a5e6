"""The delayed parameter update (optim.delayed_update, m6.memory.delayed_update): the forward of
step t+1 sees exactly the weights from before step t's update, the first delayed_update_after steps
are synchronous, the update really runs in the background thread, a checkpoint resumes exactly,
and the config refuses what it is not built for. With fp32 host gradients and with 16-bit ones
(memory.host_grad_dtype=compute, bf16 and fp16: their buffers, fp16's divisors and the clip's
multiplier double-buffered like the fp32 gradients)."""

from __future__ import annotations

import threading

import pytest
import torch

from m6.config import ConfigError, load
from m6.memory.memory_report import estimate_memory
from m6.train.loop import Trainer
from m6.train.optim import no_decay_ids

SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=32",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=128", "data.eval_samples=0", "data.seq_len=32",
    "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0", "train.precision=fp32",
    "train.device=cpu", "logging.console=false", "checkpoint.every=0", "memory.offload=optimizer",
    "memory.host_optimizer=torch", "optim.warmup_steps=2",
    "optim.apply_groups=2",  # the background update steps group by group (the optimizer's groups narrowed)
]
AFTER = 2
STEPS = 6
# 16-bit host gradients under each 16-bit compute dtype (fp16: with its power-of-two divisors).
HALF = {"bf16": ("train.precision=bf16", "memory.host_grad_dtype=compute"),
        "fp16": ("train.precision=fp16", "memory.host_grad_dtype=compute")}
HOST_GRADS = {"fp32": (), **HALF}


def trainer(path, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"run.dir={path}", *extra]))


def delayed(path, *extra: str) -> Trainer:
    return trainer(path, "optim.delayed_update=true", f"optim.delayed_update_after={AFTER}", *extra)


def masters(tr: Trainer) -> list[torch.Tensor]:
    off = tr.update.offload
    return [off.master(p).detach().clone() for p in off.params]


def device_weights(tr: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in tr.update.offload.params]


def manual_reference(path, steps: int, *extra: str) -> tuple[list[float], list[list[torch.Tensor]], list[torch.Tensor]]:
    """The delayed update made by hand on a synchronous offloaded run: before step s's forward the
    device weights are set to the masters after step s-2's update (after step s-1's for the first
    AFTER + 1 steps, where nothing is pending yet); the host update itself is the synchronous one.
    Returns the losses, the weights each forward used, and the final masters."""
    tr = trainer(path, *extra)
    after = [masters(tr)]  # after[s]: the masters once step s's update is done (0: the initial weights)
    losses, used = [], []
    for s in range(1, steps + 1):
        stale = after[s - 2] if s >= AFTER + 2 else after[s - 1]
        with torch.no_grad():
            for p, w in zip(tr.update.offload.params, stale):
                p.copy_(w)
        used.append(device_weights(tr))
        losses.append(tr.train_step()["loss"])
        after.append(masters(tr))
    return losses, used, after[-1]


def watched_run(tr: Trainer, steps: int) -> tuple[list[float], list[list[torch.Tensor]], set[str]]:
    """Losses, the weights every step's forwards used (all its micro-batches the same), and the
    threads the optimizer stepped on."""
    seen: list[list[torch.Tensor]] = []
    threads: set[str] = set()
    hook = tr.model.register_forward_pre_hook(lambda module, args: seen.append(device_weights(tr)))
    tr.update.optimizer.register_step_pre_hook(lambda *a: threads.add(threading.current_thread().name))
    losses, used = [], []
    for _ in range(steps):
        seen.clear()
        losses.append(tr.train_step()["loss"])
        assert len(seen) == 2  # two micro-batches
        for a, b in zip(*seen):
            assert torch.equal(a, b)
        used.append(seen[0])
    hook.remove()
    return losses, used, threads


@pytest.mark.parametrize("host_grads", list(HOST_GRADS))
def test_step_t_plus_1_sees_the_weights_from_before_step_ts_update(tmp_path, host_grads):
    """Bitwise against the hand-made reference (CPU, torch's AdamW on the host; fp32 host
    gradients, or 16-bit ones under bf16 and fp16): every forward's weights, every loss, the final
    masters; the first AFTER steps equal the synchronous run, the update of a delayed step runs on
    the background thread."""
    extra = HOST_GRADS[host_grads]
    want_losses, want_used, want_masters = manual_reference(tmp_path / "reference", STEPS, *extra)
    sync_losses = [l for l in (lambda tr: [tr.train_step()["loss"] for _ in range(STEPS)])(
        trainer(tmp_path / "sync", *extra))]
    tr = delayed(tmp_path / "delayed", *extra)
    if extra:
        assert {b.dtype for b in tr.update.offload._grad_buffers.values()} == {torch.bfloat16 if host_grads == "bf16" else torch.float16}
    losses, used, threads = watched_run(tr, STEPS)
    for s, (got, want) in enumerate(zip(used, want_used), start=1):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {s}'s forward weights"
    assert losses == want_losses
    tr.update.wait()
    assert all(torch.equal(a, b) for a, b in zip(masters(tr), want_masters))
    # Synchronous up to step AFTER + 1 (whose forward follows the synchronous update of step AFTER),
    # one step stale from AFTER + 2 on: the curve departs there.
    assert losses[:AFTER + 1] == sync_losses[:AFTER + 1]
    assert losses[AFTER + 1] != sync_losses[AFTER + 1]
    assert any(name.startswith("m6-delayed-update") for name in threads)
    assert threading.main_thread().name in threads  # the synchronous first steps


@pytest.mark.parametrize("host_optimizer, host_grads", [("torch", "fp32"), ("deepspeed", "fp32"), ("torch", "fp16")])
def test_resume_is_exact_with_an_update_in_flight_at_the_save(tmp_path, host_optimizer, host_grads):
    """Saved at step 4 (two delayed steps in: the device one update behind the masters), resumed:
    the same losses and final masters as the uninterrupted run, bitwise, with torch's AdamW and
    DeepSpeed's CPU Adam on the worker thread, and with 16-bit (fp16) host gradients; the
    checkpoint's weights are the masters (a synchronous resume continues from them) and the next
    forward's are kept apart."""
    opt = f"memory.host_optimizer={host_optimizer}"
    half = HOST_GRADS[host_grads]
    straight = delayed(tmp_path / "straight", f"train.max_steps={STEPS}", opt, *half)
    want = [h["loss"] for h in straight.fit()]
    first = delayed(tmp_path / "b", f"train.max_steps={STEPS}", opt, *half)
    head = [h["loss"] for h in first.fit(stop_at=4)]
    behind = device_weights(first)
    assert not all(torch.equal(a, b) for a, b in zip(behind, masters(first)))
    resumed = delayed(tmp_path / "b", f"train.max_steps={STEPS}", "checkpoint.resume=auto", opt, *half)
    assert resumed.step == 4
    assert all(torch.equal(a, b) for a, b in zip(device_weights(resumed), behind))
    assert all(torch.equal(a, b) for a, b in zip(masters(resumed), masters(first)))
    tail = [h["loss"] for h in resumed.fit()]
    assert head + tail == want
    assert all(torch.equal(a, b) for a, b in zip(masters(resumed), masters(straight)))
    # A synchronous resume of the delayed checkpoint starts from its weights, the masters after step 4.
    sync = trainer(tmp_path / "sync", f"train.max_steps={STEPS}", opt, *half,
                   f"checkpoint.resume={tmp_path / 'b' / 'checkpoints' / 'step_00000004'}")
    assert sync.step == 4
    assert all(torch.equal(a, b) for a, b in zip(device_weights(sync), masters(first)))


def test_streamed_blocks_train_like_resident_ones(tmp_path):
    """memory.offload=optimizer+params: the blocks' host homes (what the next forward fetches) are
    apart from their masters (what the background update writes), so the run is bitwise the
    optimizer-only delayed run; the estimate counts the homes; resume is exact."""
    steps = 5
    want = delayed(tmp_path / "optimizer", f"train.max_steps={steps}")
    want_losses = [want.train_step()["loss"] for _ in range(steps)]
    want.update.wait()
    tr = delayed(tmp_path / "params", "memory.offload=optimizer+params", f"train.max_steps={steps}")
    off = tr.update.offload
    streamed = [p for layer in off.streamer.layers for p in layer.params]
    assert streamed and all(off.master(p) is not home for layer in off.streamer.layers
                            for p, home in zip(layer.params, layer.homes))
    losses = [tr.train_step()["loss"] for _ in range(3)]
    tr.save_checkpoint(wait=True)
    losses += [tr.train_step()["loss"] for _ in range(steps - 3)]
    assert losses == want_losses
    tr.update.wait()
    assert all(torch.equal(a, b) for a, b in zip(masters(tr), masters(want)))
    homes = sum(h.nbytes for layer in off.streamer.layers for h in layer.homes)
    report = estimate_memory(tr.cfg, tr.model, no_decay_ids(tr.model))
    assert report.host["params"] == sum(off.master(p).nbytes for p in off.params) + homes
    resumed = delayed(tmp_path / "params", "memory.offload=optimizer+params", f"train.max_steps={steps}",
                      "checkpoint.resume=auto")
    assert resumed.step == 3
    assert [resumed.train_step()["loss"] for _ in range(steps - 3)] == want_losses[3:]


@pytest.mark.parametrize("host_grads", ["fp32", "fp16"])
def test_a_skipped_step_launches_nothing_and_the_next_catches_up(tmp_path, host_grads):
    """A non-finite step (agreed before the launch) updates nothing; the pending update of the step
    before it still reaches the device before the step after. fp16 with 16-bit host gradients: the
    overflow is in a 16-bit host buffer (the update in flight reads the other set), the loss scale
    backs off."""
    tr = delayed(tmp_path, "optim.delayed_update_after=0", *HOST_GRADS[host_grads])
    initial = masters(tr)
    tr.train_step()
    assert tr.update.delayed.in_flight
    scale = tr.update.loss_scale.scale if tr.update.loss_scale else None
    finish = tr.update.finish

    def finish_then_poison() -> None:
        finish()
        off = tr.update.offload
        g = off.host_grads(off.masters_of(off.params[:1]))[0]
        g.view(-1)[0] = float("nan")

    tr.update.finish = finish_then_poison
    metrics = tr.train_step()
    assert tr.counters.skipped_steps == 1 and not tr.update.delayed.in_flight
    if scale is not None:
        assert tr.update.loss_scale.scale == scale / 2
    after_step_1 = masters(tr)  # step 2 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(initial, after_step_1))
    assert all(torch.equal(a, b) for a, b in zip(device_weights(tr), after_step_1))
    assert metrics["grad_norm"] != metrics["grad_norm"]  # nan
    tr.update.finish = finish
    tr.train_step()
    assert tr.update.delayed.in_flight


@pytest.mark.parametrize("host_grads", ["fp32", "bf16"])
def test_the_memory_estimate_counts_both_host_gradient_sets(tmp_path, host_grads):
    """Double buffering: the estimate's host gradients are the bytes of both buffer sets, twice
    a synchronous run's (4 B per parameter more with fp32 host gradients, 2 B with 16-bit ones)."""
    reports = {}
    for name, extra in (("sync", []), ("delayed", ["optim.delayed_update=true", "optim.delayed_update_after=0"])):
        tr = trainer(tmp_path / name, *extra, *HOST_GRADS[host_grads])
        tr.train_step()
        reports[name] = estimate_memory(tr.cfg, tr.model, no_decay_ids(tr.model)).host["grads"]
        off = tr.update.offload
        sets = [off._grad_buffers, *([off._spare_grad_buffers] if off._spare_grad_buffers is not None else [])]
        assert reports[name] == sum(b.nbytes for buffers in sets for b in buffers.values()), name
    assert reports["delayed"] == 2 * reports["sync"]
    numel = sum(p.numel() for p in tr.update.offload.params)
    assert reports["delayed"] - reports["sync"] == (2 if host_grads == "bf16" else 4) * numel


@pytest.mark.parametrize("extra, needle", [
    (["memory.offload=none"], "memory.offload=none"),
    (["memory.offload=optimizer+params", "parallel.shard=full"], "parallel.shard=full"),
])
def test_the_config_refuses_what_the_delayed_update_is_not_built_for(tmp_path, extra, needle):
    with pytest.raises(ConfigError, match="optim.delayed_update=true") as e:
        load(None, [*SMALL, f"run.dir={tmp_path}", "optim.delayed_update=true", *extra])
    assert needle in str(e.value)


def test_delayed_update_after_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="optim.delayed_update_after must be >= 0"):
        load(None, [*SMALL, "optim.delayed_update=true", "optim.delayed_update_after=-1"])
    with pytest.raises(ConfigError, match="only applies with optim.delayed_update=true"):
        load(None, [*SMALL, "optim.delayed_update_after=5"])


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params", "zero"])
def test_the_config_accepts_16bit_host_gradients_with_every_offload(tmp_path, offload):
    cfg = load(None, [*SMALL, f"run.dir={tmp_path}", "optim.delayed_update=true", f"memory.offload={offload}",
                      *HALF["bf16"]])
    assert cfg.optim.delayed_update and cfg.memory.host_grad_dtype == "compute"


def test_the_update_in_flight_reads_its_own_fp16_divisors_while_the_next_backward_writes_others():
    """fp16 host gradients: a gradient past fp16's range reaches the host divided by a power of two
    (HostOffload.host_grad_factors). The update handed that step's set reads the divisor written
    with it, though the next backward has meanwhile streamed a small gradient whose divisor is 1
    (with one set of divisor scalars the update would read 1 and step 2**k times too short)."""
    from m6.memory.grouped_apply import GroupedApply
    from m6.memory.offload import HostOffload

    weight = torch.nn.Parameter(torch.zeros(4))
    off = HostOffload([weight], torch.device("cpu"), grad_dtype=torch.float16)
    off.defer_grads = True
    master = off.master(weight)
    apply = GroupedApply(torch.optim.SGD([master], lr=1.0), [master], [], 1)
    big = torch.full((4,), 2.0**20)  # past fp16's largest finite value, 65504: divided by 2**5
    weight.grad = big.clone()
    off.finish_backward()
    assert off.host_grad_factors([master]) == [32.0]
    off.hand_over_grads()
    weight.grad = torch.full((4,), 1.0)  # the next step's backward, while the update is in flight
    off.finish_backward()
    assert off.host_grad_factors([master]) == [1.0]
    off.background_step(apply)
    off.release_update_grads()
    assert torch.equal(master, -big)  # SGD, lr 1: the handed-over gradient, its divisor undone
    assert master.grad is None and off.host_grads([master])[0].eq(1.0).all()
