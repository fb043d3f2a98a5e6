"""The planner's ZeRO-Offload with partitioned host states (memory.offload=zero +
parallel.shard=optimizer, m6.plan.zero_partition_step): reduce-scatters beside backward, each
rank's 1/n chunk over PCIe each way, the weights' all-gathers beside the next forward, the host
update over the chunks; and the search that proposes it with the keys the runtime needs."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest

from m6 import config as m6config
from m6.plan.__main__ import describe, main
from m6.plan.copy_back_overlap import weights_back_exposed
from m6.plan.memory import RankMemory
from m6.plan.offload_layouts import PLANNED_OFFLOAD, ZERO
from m6.plan.search import apply_choice, search
from m6.plan.timing import GPUS, HostProfile, step_time
from m6.plan.zero_partition_step import CHUNKS_BACK, GATHERS, partitioned_offload_step, pipelined_s

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = ["data.kind=synthetic", "data.sources=[]", "model.moe.capacity_factor=null", "data.seq_len=40",
         "model.max_text_len=40", "model.image_size=16", "train.global_batch_size=16",
         "memory.host_optimizer=torch", "checkpoint.async_save=false"]
V100 = GPUS["v100"]  # fp16: 2-byte weights and gradients; 8 per node: the 4 ranks share NVLink
WORLD, EP = 4, 2


def _cfg(*extra: str) -> m6config.Config:
    return m6config.load(CONFIGS / "tiny.yaml", [*SMALL, *extra])


def _host() -> HostProfile:
    """Host update rates as if probed on one thread (no probe runs in the test)."""
    host = HostProfile(threads=1, host_cores_per_gpu=4)
    for key in (("adamw", "torch", False), ("adamw", "torch", True), ("adamw", "torch", False, True),
                ("adamw", "torch", True, True)):
        host._step_costs[key] = (1e-6, 4e-9)
    return host


def _layout(cfg, shard: str, delayed=False, groups=1, host_grads="compute"):
    return apply_choice(cfg, 4, "none", ZERO, groups, None, None, V100.precision, shard, host_grads=host_grads,
                        delayed=delayed)


def _numels(rm: RankMemory) -> tuple[int, int, int]:
    """(dense elements, expert elements, this rank's chunk elements) from the parameters' shapes."""
    dense = sum(p.numel() for p in rm.facts.replicated)
    experts = sum(p.numel() for p in rm.facts.experts)
    chunk = sum(1 if p.dim() == 0 else math.ceil(p.shape[0] / (WORLD // EP if id(p) in rm.facts.expert_ids
                                                               else WORLD)) * (p.numel() // p.shape[0])
                for p in rm.facts.params)
    return dense, experts, chunk


def _ring(nbytes: float, n: int) -> float:
    """A ring reduce-scatter's or all-gather's bandwidth time over NVLink: (n-1)/n of the bytes."""
    return (n - 1) / n * nbytes / (V100.intra_node_GBps * 1e9)


def test_reduce_scatter_is_half_the_all_reduce_and_the_chunks_cross_pcie_each_way():
    cfg, host = _cfg(), _host()
    rm = RankMemory(cfg, WORLD, EP, "cuda")
    dense, experts, chunk = _numels(rm)
    bps, blocks = V100.pcie_GBps * 1e9, rm.facts.block_numels
    whole = step_time(_layout(cfg, "none"), WORLD, EP, 8, V100, host, model=rm.model)
    t = step_time(_layout(cfg, "optimizer", groups=4), WORLD, EP, 8, V100, host, model=rm.model)
    assert t.compute == whole.compute
    # One bucket per group here (the tiny model's gradients fit one): a latency each.
    lat = V100.latency_s
    assert t.grad_sync + t.grad_sync_hidden == pytest.approx(_ring(2 * dense, 4) + _ring(2 * experts, 2) + 2 * lat)
    assert whole.grad_sync + whole.grad_sync_hidden == pytest.approx(
        2 * _ring(2 * dense, 4) + 2 * _ring(2 * experts, 2) + 2 * lat)
    copies = {c.name: c for c in t.copies}
    assert copies["gradients out (the rank's reduced chunks, 16-bit)"].seconds == pytest.approx(2 * chunk / bps)
    assert copies[CHUNKS_BACK].seconds == pytest.approx(2 * chunk / bps)
    gathers = _ring(2 * dense, 4) + _ring(2 * experts, 2) + 2 * lat * (len(blocks) + 1)
    assert copies[GATHERS].seconds == pytest.approx(gathers)
    # The host update steps the chunks only.
    assert t.update == pytest.approx(host.host_step_s(len(rm.facts.params), chunk, "adamw", True, "torch"))
    # Synchronous: the chunks back group by group beside the update, what is left then the gathers
    # beside the next forward, copies and gathers pipelined segment by segment.
    back = 2 * chunk / bps
    cast = host.host_step_s(len(rm.facts.params), chunk, "adamw", True, "torch", half_weights=True) - t.update
    chain = max(back, cast)
    left = max(chain / 4, chain - t.update * 3 / 4)
    first = (dense + experts - sum(blocks) + blocks[0]) / (dense + experts)
    exposed = weights_back_exposed(pipelined_s(left, gathers, len(blocks) + 1), first * (left + gathers),
                                   t.compute / 3, len(blocks))
    assert copies[CHUNKS_BACK].exposed + copies[GATHERS].exposed == pytest.approx(exposed)
    assert t.offload == pytest.approx(sum(c.exposed for c in t.copies))
    assert t.total == pytest.approx(t.compute + t.all_to_all + t.grad_sync + t.small_collectives + t.offload + t.update)
    # Against unsharded zero: 1/n of the PCIe bytes each way and of the host update's parameters.
    whole_copies = {c.name: c for c in whole.copies}
    assert copies[CHUNKS_BACK].seconds < whole_copies["weights back (16-bit) beside the next forward, block by block"
                                                      ].seconds / 1.5
    assert t.update < whole.update


def test_the_delayed_update_composes_and_the_overlaps_line_names_the_gathers():
    cfg, host = _cfg(), _host()
    rm = RankMemory(cfg, WORLD, EP, "cuda")
    sync = step_time(_layout(cfg, "optimizer"), WORLD, EP, 8, V100, host, model=rm.model)
    t = step_time(_layout(cfg, "optimizer", delayed=True), WORLD, EP, 8, V100, host, model=rm.model)
    copies = {c.name: c for c in t.copies}
    device = t.compute + t.all_to_all + t.grad_sync + t.small_collectives + sum(c.exposed for c in t.copies)
    host_update = t.update + t.update_hidden
    chain = copies[CHUNKS_BACK].seconds  # the cast is cheaper than the copy at these rates
    assert t.update == pytest.approx(max(0.0, chain + host_update - device))
    assert t.total == pytest.approx(device + t.update)
    assert t.synchronous_total == pytest.approx(sync.total)
    cand = next(c for c in search(cfg, WORLD, 8, V100, host, 4096.0, eps=[EP], micro_batches=[4],
                                  recompute=("none",), a2a=(None,), shard=("optimizer",), apply_groups=(1,),
                                  offload=(ZERO,), delayed=(True,)).feasible)
    printed = describe(cand, WORLD, 8, cfg.optim.delayed_update_after)
    assert "grad sync (reduce-scatter)" in printed and GATHERS in printed and CHUNKS_BACK in printed
    assert "steps 1-40 update synchronously" in printed


def test_search_proposes_zero_partitioned_with_the_keys_the_runtime_needs(capsys):
    cfg = _cfg()
    narrow = dict(eps=[EP], micro_batches=[4], recompute=("none", "auto"), a2a=(None,), apply_groups=(1,))
    found = search(cfg, WORLD, 8, V100, _host(), 4096.0, shard=("none", "optimizer", "full"), offload=PLANNED_OFFLOAD,
                   delayed=(False, True), **narrow).feasible
    part = [c for c in found if c.offload == ZERO and c.shard == "optimizer"]
    assert {(c.delayed_update, c.host_grad_dtype) for c in part} == {
        (d, hg) for d in (False, True) for hg in ("fp32", "compute")}
    # With auto recompute too (its weights stay resident: nothing for the auto plan to tell apart).
    auto = search(cfg, WORLD, 8, V100, _host(), 4096.0, shard=("optimizer",), offload=(ZERO,),
                  **{**narrow, "recompute": ("auto",)}).feasible
    assert auto and {(c.offload, c.shard, c.recompute) for c in auto} == {(ZERO, "optimizer", "auto")}
    assert all(c.offload_blocks == [] for c in part)
    assert not [c for c in found if c.offload == ZERO and c.shard == "full"]
    for c in part:
        overrides = c.overrides()
        assert {"memory.offload=zero", "parallel.shard=optimizer", "memory.offload_blocks=[]",
                f"memory.host_grad_dtype={c.host_grad_dtype}"} <= set(overrides)
        m6config.load(CONFIGS / "tiny.yaml", [*SMALL, *overrides])  # a config the runtime accepts
    # Its partitioned host bytes fit where unsharded zero's do not.
    rm = RankMemory(cfg, WORLD, EP, "cuda")
    whole = rm.report(_layout(cfg, "none")).peak_host
    part_host = rm.report(_layout(cfg, "optimizer")).peak_host
    assert part_host < whole
    host_gib = (part_host + whole) / 2 * 4 / 2**30  # 4 ranks per node
    tight = search(cfg, WORLD, 8, V100, _host(), host_gib, shard=("none", "optimizer"), offload=(ZERO,),
                   **narrow).feasible
    assert tight and {c.shard for c in tight} == {"optimizer"}
    # Not with Adafactor (the partitioned states are AdamW's).
    ada = search(_cfg("optim.name=adafactor"), WORLD, 8, V100, _host(), 4096.0, shard=("optimizer",), offload=(ZERO,),
                 **narrow)
    assert not [c for c in ada.feasible if c.offload == ZERO]
    # The CLI's launch command loads (--offload-modes all --shard any).
    args = [str(CONFIGS / "tiny.yaml"), *SMALL, "--gpus", "4", "--gpu", "v100", "--gpu-memory", "16GB",
            "--host-memory", f"{host_gib:.6f}GB", "--top", "1", "--shard", "any", "--offload-modes", "all"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    launch = shlex.split(printed.split("train.py --config ")[1].splitlines()[0])[1:]
    m6config.load(CONFIGS / "tiny.yaml", launch)


def test_an_expert_data_parallel_group_of_few_ranks_still_crosses_nodes():
    """EP 8 on 16 ranks, 8 per node: an EDP group (ranks r and r + 8) is 2 ranks, one on each node,
    so its gradient sync runs at the inter-node bandwidth, not NVLink's (it did before: the group
    was judged by its size alone)."""
    cfg, host = _cfg("train.global_batch_size=32"), _host()
    rm = RankMemory(cfg, 16, 8, "cuda")
    dense = sum(p.numel() for p in rm.facts.replicated)
    experts = sum(p.numel() for p in rm.facts.experts)
    lat = V100.latency_s
    for gpus_per_node, bw in ((8, V100.inter_node_GBps), (16, V100.intra_node_GBps)):
        for shard, ring in (("none", 2), ("optimizer", 1)):
            t = step_time(apply_choice(cfg, 2, "none", ZERO, 1, None, None, V100.precision, shard), 16, 8,
                          gpus_per_node, V100, host, model=rm.model)
            expected = ring * (15 / 16 * 2 * dense + 1 / 2 * 2 * experts) / (bw * 1e9) + 2 * lat
            assert t.grad_sync + t.grad_sync_hidden == pytest.approx(expected)



def test_with_accumulation_the_reduced_chunks_leave_in_the_last_backward():
    """fp32 host gradients at 2 micro-batches: the reduced chunks leave in the last backward only
    (2/3 of one micro-batch's compute), not beside every micro-batch's backward as the unreduced
    ones do (a group of one rank: nothing to wait for)."""
    cfg = apply_choice(_cfg(), 2, "none", ZERO, 4, None, None, V100.precision, "optimizer")
    step = dict(world_size=WORLD, compute_s=3.0, device_other_s=0.0, update_s=100.0, cast_s=0.0, gather_s=0.0,
                copy_Bps=1.6e6, c=2, bucket_chunk_bytes=1.0, first_share=0.1, num_resident_blocks=4, delayed=False)
    reduced = partitioned_offload_step(cfg, 1_000_000, 0, **step)
    out = next(c for c in reduced.copies if c.name.startswith("gradients out"))
    assert out.seconds == pytest.approx(2.5)  # 4 B per chunk element over the link
    assert out.exposed == pytest.approx(2.5 - 2 / 3 * 3.0 / 2)  # the last backward's window: 1 s
    unreduced = partitioned_offload_step(cfg, 1_000_000, 1_000_000, **step)
    out = next(c for c in unreduced.copies if c.name.startswith("gradients out"))
    assert out.seconds == pytest.approx(5.0)  # every micro-batch's
    assert out.exposed == pytest.approx(5.0 - 2 / 3 * 3.0)  # beside every backward
