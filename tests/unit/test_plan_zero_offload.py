"""The planner's ZeRO-Offload layout (memory.offload=zero) and delayed update (m6.plan.offload_layouts):
its device and host bytes, its copies and what they overlap, and the search over both."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from m6 import config as m6config
from m6.config import accumulation_steps
from m6.plan.__main__ import describe
from m6.plan.memory import RankMemory
from m6.plan.copy_back_overlap import weights_back_exposed
from m6.plan.offload_layouts import BLOCK_COPY_BACK, PLANNED_OFFLOAD, WEIGHT_STAGING, ZERO, runnable_offload_modes
from m6.plan.search import apply_choice, search
from m6.plan.timing import GPUS, HostProfile, step_time

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = ["data.kind=synthetic", "data.sources=[]", "model.moe.capacity_factor=null", "data.seq_len=40",
         "model.max_text_len=40", "model.image_size=16", "train.global_batch_size=16",
         "memory.host_optimizer=torch", "checkpoint.async_save=false"]
V100 = GPUS["v100"]  # plans in fp16: 2-byte weights and gradients
GiB = 2**30


def _cfg(*extra: str) -> m6config.Config:
    return m6config.load(CONFIGS / "tiny.yaml", [*SMALL, *extra])


def _host() -> HostProfile:
    """Host update rates as if probed on one thread (no probe runs in the test)."""
    host = HostProfile(threads=1, host_cores_per_gpu=4)
    for key in (("adamw", "torch", False), ("adamw", "torch", True), ("adamw", "torch", False, True),
                ("adamw", "torch", True, True)):
        host._step_costs[key] = (1e-6, 4e-9)
    return host


def _zero(cfg, mb: int, blocks=None, delayed=False, groups=1, offload=ZERO, host_grads="fp32"):
    return apply_choice(cfg, mb, "none", offload, groups, None, None, V100.precision, "none",
                        offload_blocks=blocks, host_grads=host_grads, delayed=delayed)


def test_zero_holds_16_bit_weights_on_the_device_and_fp32_masters_on_the_host():
    cfg = _cfg()
    rm = RankMemory(cfg, 1, 1, "cuda")
    numel, blocks = rm.facts.numel, rm.facts.block_numels
    zero = rm.report(_zero(cfg, 16, host_grads="compute"))  # one micro-batch per step: every block resident
    fp32 = rm.report(apply_choice(cfg, 16, "none", "optimizer", 1, None, None, V100.precision, "none"))
    assert zero.device["params"] == 2 * numel == fp32.device["params"] / 2
    assert zero.device["grads"] == 0  # each leaves once final, nothing accumulates
    assert zero.peak_device < fp32.peak_device
    assert zero.host["params"] == 4 * numel and zero.host["grads"] == 2 * numel
    assert zero.host["optimizer state"] == fp32.host["optimizer state"]
    # The copy back's two buffers of its largest push (one segment: outside the blocks, or a block).
    assert zero.host[WEIGHT_STAGING] == 2 * 2 * rm.facts.largest_copy_back_push(frozenset())
    assert rm.facts.largest_copy_back_push(frozenset()) == max(numel - sum(blocks), *blocks)
    assert rm.report(_zero(cfg, 16)).host["grads"] == 4 * numel  # fp32 host buffers
    # Blocks 0 and 1 streamed: their 16-bit weights live on the host, two blocks' worth on the device.
    streamed = rm.report(_zero(cfg, 16, blocks=[0, 1]))
    assert streamed.device["params"] == 2 * (numel - blocks[0] - blocks[1]) + 2 * (blocks[0] + blocks[1])
    streamed = rm.report(_zero(cfg, 16, blocks=[0, 1, 2], groups=4))
    assert streamed.device["params"] == 2 * (numel - sum(blocks[:3])) + 2 * max(blocks[0] + blocks[1],
                                                                                blocks[1] + blocks[2])
    # The streamed blocks' homes + two copy-back buffers of the largest push (one resident segment).
    push = rm.facts.largest_copy_back_push(frozenset({0, 1, 2}))
    assert push == max(numel - sum(blocks), *blocks[3:])
    assert streamed.host[WEIGHT_STAGING] == 2 * sum(blocks[:3]) + 2 * 2 * push
    # Accumulation: with 16-bit host gradients they stay on the device until the last micro-batch;
    # with fp32 host buffers the unshared ones (at world 1 all) leave in every micro-batch.
    accum = rm.report(_zero(cfg, 4, host_grads="compute"))
    assert accum.device["grads"] == 2 * numel and accum.peak_device > zero.peak_device - zero.device[
        "activations (per micro-batch)"]
    assert rm.report(_zero(cfg, 4)).device["grads"] == 0
    # Two ranks replicating everything (EP 1): the shared gradients wait on the device in 16 bits.
    assert RankMemory(cfg, 2, 1, "cuda").report(_zero(cfg, 4)).device["grads"] == 2 * numel
    # The delayed update: a second set of host gradients for the next backward.
    delayed = rm.report(_zero(cfg, 16, delayed=True))
    assert delayed.host["grads"] == 8 * numel and delayed.peak_host == rm.report(_zero(cfg, 16)).peak_host + 4 * numel
    # With 16-bit host gradients the second set is 16-bit too: 2 B per parameter more.
    half = rm.report(_zero(cfg, 16, delayed=True, host_grads="compute"))
    assert half.host["grads"] == 4 * numel
    assert half.peak_host == rm.report(_zero(cfg, 16, host_grads="compute")).peak_host + 2 * numel
    # So in m6's fp32-weight layouts (m6.memory.estimate).
    for off in ("optimizer", "optimizer+params"):
        sync, dpu = (rm.report(_zero(cfg, 16, offload=off, host_grads="compute", delayed=d)) for d in (False, True))
        assert sync.host["grads"] == 2 * numel and dpu.host["grads"] == 4 * numel, off


def test_zero_moves_half_the_bytes_and_the_step_waits_only_for_what_compute_does_not_hide():
    cfg = _cfg()
    host = _host()
    rm = RankMemory(cfg, 1, 1, "cuda")
    numel, bps = rm.facts.numel, V100.pcie_GBps * 1e9
    t = step_time(_zero(cfg, 16, groups=4, host_grads="compute"), 1, 1, 8, V100, host, model=rm.model)
    copies = {c.name: c for c in t.copies}
    assert copies["gradients out (16-bit)"].seconds == pytest.approx(2 * numel / bps)
    assert copies[BLOCK_COPY_BACK].seconds == pytest.approx(2 * numel / bps)
    back = 2 * numel / bps
    # Synchronous: back group by group beside the update, what is left beside the next forward,
    # block by block (its first piece, outside the blocks and block 0, shows).
    left = max(back / 4, back - t.update * 3 / 4)
    blocks = rm.facts.block_numels
    first = 2 * (numel - sum(blocks) + blocks[0]) / bps
    assert copies[BLOCK_COPY_BACK].exposed == pytest.approx(
        weights_back_exposed(left, first, t.compute / 3, len(blocks)))
    assert first <= copies[BLOCK_COPY_BACK].exposed < left
    grads = 2 * numel / bps
    assert copies["gradients out (16-bit)"].exposed == pytest.approx(
        max(min(grads, cfg.parallel.bucket_size_mb * 2**20 / bps), grads - 2 / 3 * t.compute))
    assert t.offload == pytest.approx(sum(c.exposed for c in t.copies))
    assert t.total == pytest.approx(t.compute + t.all_to_all + t.grad_sync + t.small_collectives + t.offload + t.update)
    assert t.update == pytest.approx(host.host_step_s(sum(1 for p in rm.model.parameters()), numel, "adamw", True,
                                                      "torch", half_weights=True))
    # The same layout with fp32 weights (optimizer+params, every block streamed) copies twice the bytes.
    fp32 = step_time(_zero(cfg, 16, groups=4, offload="optimizer", host_grads="compute"), 1, 1, 8, V100, host,
                     model=rm.model)
    fp32_back = {c.name: c for c in fp32.copies}["weights back (fp32)"]
    assert fp32_back.seconds == pytest.approx(2 * back)
    # Streamed blocks: their 16-bit weights in twice per micro-batch (forward, backward).
    blocks = rm.facts.block_numels
    s = step_time(_zero(cfg, 8, blocks=[0, 1], host_grads="compute"), 1, 1, 8, V100, host, model=rm.model)
    fetch = {c.name: c for c in s.copies}["streamed blocks' weights in (16-bit)"]
    assert fetch.seconds == pytest.approx(2 * 2 * (blocks[0] + blocks[1]) * 2 / bps)
    assert {c.name: c for c in s.copies}[BLOCK_COPY_BACK].seconds == pytest.approx(
        2 * (numel - blocks[0] - blocks[1]) / bps)
    # One link for both: what the step's compute does not cover shows, the gradients' own share
    # (their last bucket, or what outlasts the last backward) named apart from the fetches'.
    out = {c.name: c for c in s.copies}["gradients out (16-bit)"]
    own = min(out.seconds, max(cfg.parallel.bucket_size_mb * 2**20 / bps, out.seconds - 2 / 3 * s.compute / 2))
    assert out.exposed == pytest.approx(own)
    # The copy back's hidden part loads the same link.
    back = {c.name: c for c in s.copies}[BLOCK_COPY_BACK]
    left = back.seconds  # one apply group: all of it is left for the next forward
    assert out.exposed + fetch.exposed == pytest.approx(
        max(own, out.seconds + fetch.seconds + left - back.exposed - s.compute))


@pytest.mark.parametrize("offload, host_grads", [(ZERO, "fp32"), ("optimizer", "fp32"), ("optimizer+params", "fp32")])
def test_the_delayed_update_overlaps_the_next_step_and_the_first_steps_stay_synchronous(offload, host_grads):
    cfg = _cfg()
    host = _host()
    rm = RankMemory(cfg, 2, 2, "cuda")
    sync = step_time(_zero(cfg, 4, offload=offload, host_grads=host_grads), 2, 2, 8, V100, host, model=rm.model)
    t = step_time(_zero(cfg, 4, offload=offload, host_grads=host_grads, delayed=True), 2, 2, 8, V100, host,
                  model=rm.model)
    assert accumulation_steps(_zero(cfg, 4).train, 2) == 2  # 8 samples per rank in micro-batches of 4
    back = [c for c in t.copies if "back" in c.name][0]
    device = t.compute + t.all_to_all + t.grad_sync + t.small_collectives + sum(
        c.exposed for c in t.copies if c is not back)
    host_update = t.update + t.update_hidden
    assert host_update == pytest.approx(sync.update)
    assert t.synchronous_total == pytest.approx(sync.total)
    if offload == ZERO:
        # The copy back beside the next forward, block by block; the update from when the
        # copy-back thread has read the masters, beside the rest of the device phase.
        assert back.name == BLOCK_COPY_BACK and 0 < back.exposed < back.seconds
        device += back.exposed
        assert t.update == pytest.approx(max(0.0, back.seconds + host_update - device))
        assert t.total == pytest.approx(device + t.update)
    else:
        # A step: the longer of the device phase and the host update, then the whole copy back.
        assert t.total == pytest.approx(max(device, host_update) + back.seconds)
        assert back.exposed == pytest.approx(back.seconds)
        assert t.update == pytest.approx(max(0.0, host_update - device))
    # On a host whose update outlasts the device phase, that is what the step waits for.
    slow = _host()
    for key in list(slow._step_costs):
        slow._step_costs[key] = (1e-3, 1e-6)
    t = step_time(_zero(cfg, 4, offload=offload, host_grads=host_grads, delayed=True), 2, 2, 8, V100, slow,
                  model=rm.model)
    assert t.update > 0 and t.update_hidden > 0
    assert t.total < t.synchronous_total
    if offload == ZERO:
        # zero's copy-back thread casts its masters to 16 bits beside the copy (the longer paces
        # the blocks' copies); the update waits for the cast.
        casting = _host()
        casting._step_costs[("adamw", "torch", False, True)] = (1e-6, 4e-9 + 1e-3)
        t = step_time(_zero(cfg, 4, offload=offload, delayed=True), 2, 2, 8, V100, casting, model=rm.model)
        cast = casting.host_step_s(*_count(rm), "adamw", False, "torch", True) - casting.host_step_s(*_count(rm))
        back = [c for c in t.copies if "back" in c.name][0]
        assert cast > back.seconds
        blocks = rm.facts.block_numels
        first = cast * (rm.facts.numel - sum(blocks) + blocks[0]) / rm.facts.numel
        assert back.exposed == pytest.approx(weights_back_exposed(cast, first, t.compute / 2 / 3, len(blocks)))
        assert t.update + t.update_hidden == pytest.approx(casting.host_step_s(*_count(rm)))


def _count(rm: RankMemory) -> tuple[int, int]:
    return len(rm.facts.params), rm.facts.numel


def test_search_plans_zero_and_the_delayed_update_on_gpus_only():
    cfg = _cfg()
    narrow = dict(eps=[1], micro_batches=[16], recompute=("none",), a2a=(None,), shard=("none",),
                  apply_groups=(1,))
    gpu = search(cfg, 1, 8, V100, _host(), 4096.0, delayed=(False, True), offload=PLANNED_OFFLOAD, **narrow).feasible
    layouts = {(c.offload, c.delayed_update) for c in gpu}
    assert {(ZERO, False), (ZERO, True), ("optimizer", True), ("optimizer+params", True)} <= layouts
    # The delayed update with fp32 and with 16-bit host gradients, in every offloaded layout.
    assert {(c.offload, c.host_grad_dtype) for c in gpu if c.delayed_update} == {
        (off, hg) for off in ("optimizer", "optimizer+params", ZERO) for hg in ("fp32", "compute")}
    assert {c.host_grad_dtype for c in gpu if c.offload == ZERO} == {"fp32", "compute"}
    zero = next(c for c in gpu if c.offload == ZERO and c.delayed_update and c.host_grad_dtype == "fp32")
    assert {"memory.offload=zero", "memory.offload_blocks=[]", "optim.delayed_update=true",
            "memory.host_grad_dtype=fp32"} <= set(zero.overrides())
    printed = describe(zero, 1, 8, cfg.optim.delayed_update_after)
    assert "offload zero (every block resident), delayed update (one step stale from step 41)" in printed
    assert "overlaps: " in printed and "steps 1-40 update synchronously" in printed
    # A device that holds only some of the blocks' 16-bit weights streams the first ones.
    rm = RankMemory(cfg, 1, 1, "cuda")
    # (A streamed block is on the device only around its forward and backward, not at the head's
    # backward where the peak is: each block streamed saves its bytes.)
    half = rm.report(_zero(cfg, 16, blocks=[0, 1, 2])).peak_device
    assert half < rm.report(_zero(cfg, 16, blocks=[0, 1])).peak_device < rm.report(_zero(cfg, 16)).peak_device
    small = dataclasses.replace(V100, memory_gib=half / 0.9 / GiB * 1.0001)
    zero_small = [c for c in search(cfg, 1, 8, small, _host(), 4096.0, offload=(ZERO,), **narrow).feasible
                  if c.host_grad_dtype == "fp32"]
    assert zero_small and zero_small[0].offload_blocks == [0, 1, 2]
    # Not on a CPU device (no 16-bit weights apart from the host's; the update thread shares the cores)
    # nor without offload.
    # (A device too small for anything: nothing is timed, only counted.)
    cpu = search(cfg, 1, 8, dataclasses.replace(V100, peak_tflops=None, precision="fp32", memory_gib=1e-6), _host(),
                 4096.0, offload=("none", "optimizer", ZERO), delayed=(False, True), **narrow)
    assert cpu.considered == 2 and cpu.smallest.offload == "optimizer" and not cpu.smallest.delayed_update


def test_the_cli_proposes_only_the_offload_settings_train_py_accepts(capsys):
    """zero is planned on request while this checkout's config refuses it; each proposed layout loads."""
    import typing
    accepted = typing.get_args(typing.get_type_hints(m6config.MemoryConfig)["offload"])
    assert set(runnable_offload_modes()) == set(PLANNED_OFFLOAD) & set(accepted)
    from m6.plan.__main__ import main
    args = [str(CONFIGS / "tiny.yaml"), *SMALL, "--gpus", "1", "--gpu", "v100", "--gpu-memory", "16GB",
            "--host-memory", "64GB", "--top", "1", "--shard", "none"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    launch = shlex.split(printed.split("train.py --config ")[1].splitlines()[0])[1:]
    m6config.load(CONFIGS / "tiny.yaml", launch)  # a config train.py runs
    if ZERO not in accepted:
        assert "memory.offload=zero" not in printed


def test_the_host_update_probe_counts_cpu_time_not_the_wait_for_a_core(monkeypatch):
    """The per-core rate is the thread's work: a wall clock that runs on while the thread waits for
    a core (here 10 s per reading) does not enter it."""
    import m6.plan.timing as timing
    wall = iter(range(0, 10**6, 10))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(wall)))
    assert HostProfile._time_host_update(4, 2**12, "adamw", True, "torch", half_weights=True) < 1.0
