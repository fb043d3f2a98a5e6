"""The planner's per-rank peak memory against a real world-2 run (gloo, EP 2, full-length
samples): predicted within 10% of the measured peak of live tensor bytes over one step, on every
rank (the cheap, deterministic half of bench.plan_validation; step time is the bench's)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed

from bench.plan_measure import COMMON, DenseSamples, live_storage_bytes, probe_collectives
from m6.config import load
from m6.memory.live_bytes import LiveBytes
from m6.plan.memory import RankMemory

SMALL = ["model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=128", "model.moe.every=1",
         "model.moe.num_experts=4", "model.moe.capacity_factor=null", "model.max_text_len=64", "model.image_size=16",
         "data.seq_len=64", "train.global_batch_size=8", "parallel.expert_parallel_size=2",
         "model.moe.force_balance=true"]  # the planner's balanced-routing assumption
# Each plan in fresh processes: a Trainer dropped in a process once left part of its memory alive
# (the gradient sync's hook cycle, fixed in 8738bae), which would count in the next plan's measured
# peak. Full recompute too: its first-step profiling once kept a whole forward alive for the run.
PLANS = [[], ["train.micro_batch_size=2", "memory.offload=optimizer"], ["memory.activation_checkpointing=full"],
         ["parallel.shard=full"], ["parallel.shard=optimizer", "parallel.expert_parallel_size=1"]]


def _measure(rank: int, world: int, root: str, extra: list[str]) -> None:
    from m6.train.loop import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    cfg = load("configs/tiny.yaml", [*COMMON, *SMALL, *extra, f"run.dir={root}/run"])
    m = cfg.model
    tr = Trainer(cfg, dataset=DenseSamples(64, cfg.data.seq_len, (m.image_channels, m.image_size, m.image_size)))
    tr.train_step()  # the recompute plan and the optimizer state are made in the first step
    start = live_storage_bytes()
    with LiveBytes() as live:
        metrics = tr.train_step()
    measured = start + live.peak
    report = RankMemory(cfg, world, 2, "cpu").report(cfg)
    predicted = report.peak_shared
    assert predicted == pytest.approx(measured, rel=0.10), (extra, rank, predicted, measured)
    if tr.update.offload is not None:
        # Device and host apart. Device gradients at the end of a backward (gradient streaming,
        # accumulation 2): the replicated ones only, the experts streamed in every micro-batch.
        assert report.device["grads"] == pytest.approx(metrics["grad_mb"] * 2**20, rel=0.10), (rank, report.device)
        off, params = tr.update.offload, list(tr.model.parameters())
        nbytes = lambda ts: sum(t.untyped_storage().nbytes() for t in ts)  # noqa: E731
        state = [v for st in tr.update.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        host = nbytes(off.masters_of(params)) + nbytes(off._grad_buffers.values()) + nbytes(state)
        planned = sum(report.host[k] for k in ("params", "grads", "optimizer state"))
        assert planned == pytest.approx(host, rel=0.10), (rank, planned, host)


@pytest.mark.parametrize("extra", PLANS, ids=["plain", "offload-accumulation", "full-recompute", "shard-full",
                                              "shard-optimizer-ep1"])
def test_predicted_peak_matches_world2_run(tmp_path, extra) -> None:
    run_distributed(_measure, 2, str(tmp_path), extra, timeout_s=120)


def _probe(rank: int, world: int) -> None:
    sizes = [16384, 262144]
    out = probe_collectives(sizes, reps=3)
    assert out["statistic"] == "mean" and out["world_size"] == world
    ops = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter")
    for op in ops:
        assert sorted(int(n) for n in out[op]) == sizes, (op, out[op])  # [rows, 64] fp32 rows split evenly
        assert all(t > 0 for t in out[op].values())
        assert sorted(out["median"][op]) == sorted(out[op])
    # The slowest rank's figures: every rank holds the same ones.
    mine = torch.tensor([out[op][str(n)] for op in ops for n in sizes], dtype=torch.float64)
    lowest = mine.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    assert torch.equal(mine, lowest)


def test_link_probe_runs_m6s_exchange_at_world2() -> None:
    """The bench's link probe (its all-to-all is m6's own, uneven-split API; FSDP2's all-gather and
    reduce-scatter beside it) at world 2."""
    run_distributed(_probe, 2, timeout_s=60)


def _sharded_profile(rank: int, world: int, mode: str) -> None:
    """One profiling process with its one-rank group (what m6.plan's profile gives it): the rank
    model comes wrapped in the run's FSDP2 units, and a timed step (clip + AdamW on DTensors) runs."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from m6.plan.timing import _densest_inputs, _profile_model, _time_rank_steps

    cfg = load("configs/tiny.yaml", [*COMMON, *SMALL, f"parallel.shard={mode}"])
    model = _profile_model(cfg, 2, 2, frozenset(), fsdp_units=True)  # rank 0 of world 2 at EP 2: its two experts
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(units) == len(model.blocks) + len(model.moe_layers()) + 1  # blocks, experts, root
    assert all(isinstance(p, DTensor) for p in model.parameters())
    block = model.blocks[0]._get_fsdp_state()._fsdp_param_group
    assert block.post_forward_mesh_info is not None if mode == "full" else block.post_forward_mesh_info is None
    compute, update = _time_rank_steps(model, _densest_inputs(cfg, 2), runs=2)
    assert compute > 0 and update > 0


@pytest.mark.parametrize("mode", ["full", "optimizer"])
def test_the_sharded_profile_times_fsdp2s_units(mode) -> None:
    run_distributed(_sharded_profile, 1, mode, timeout_s=120)
