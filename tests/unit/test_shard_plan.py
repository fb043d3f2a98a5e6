"""The memory estimate and the planner know parallel.shard: a model whose dense part does not fit
an 80 GB GPU unsharded (configs/m6-dense-7b-moe.yaml) plans to fit with shard=full, and the
estimate's sharded states are 1/N of the replicated ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from m6.config import load
from m6.memory.memory_report import estimate_memory
from m6.memory.shard_estimate import data_parallel_traffic, shard_layout
from m6.model.param_groups import no_decay_ids
from m6.plan.memory import rank_model
from m6.plan.search import search
from m6.plan.timing import GPUS, HostProfile

DENSE = Path(__file__).resolve().parents[2] / "configs" / "m6-dense-7b-moe.yaml"


def _with_shard(cfg, shard):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, shard=shard))


def test_dense_config_fits_80gb_only_sharded():
    cfg = load(DENSE)
    # One narrow slice of the search (EP 8, micro-batch 1, full recompute, no offload): the
    # smallest unsharded footprint there is; host memory plenty.
    narrow = dict(eps=[8], micro_batches=[1], recompute=("full",), offload=("none",), apply_groups=(1,), a2a=(None,),
                  tps=(1,), pps=(1,))  # the model whole on each rank (a pipeline of 4 with full recompute fits)
    hw = GPUS["h100"]
    none = search(cfg, 64, 8, hw, HostProfile(1), 4096.0, **narrow, shard=("none",))
    assert not none.feasible and none.smallest.memory.peak_device > 80 * 2**30
    full = search(cfg, 64, 8, hw, HostProfile(1), 4096.0, **narrow, shard=("full",))
    assert full.feasible and full.feasible[0].shard == "full"
    assert full.feasible[0].memory.peak_device < 80 * 2**30
    assert "parallel.shard=full" in full.feasible[0].overrides()


def test_one_node_fits_the_dense_config_only_with_sharded_cpu_offload():
    """8 H100s: shard=full alone needs ~89 GiB per GPU; with FSDP2's CPU offload the shards, their
    gradients and moments live on the host (1/8 each), and the layout fits device and host."""
    cfg = load(DENSE)
    narrow = dict(eps=[8], micro_batches=[1], recompute=("full",), apply_groups=(1,), a2a=(None,), shard=("full",))
    hw = GPUS["h100"]
    on_device = search(cfg, 8, 8, hw, HostProfile(1), 2048.0, **narrow, offload=("none",))
    assert not on_device.feasible and on_device.smallest.memory.peak_device > 80 * 2**30
    offloaded = search(cfg, 8, 8, hw, HostProfile(1), 2048.0, **narrow, offload=("optimizer+params",))
    best = offloaded.feasible[0]
    assert best.memory.peak_device < 80 * 2**30 and 8 * best.memory.peak_host < 2048 * 2**30
    assert {"parallel.shard=full", "memory.offload=optimizer+params"} <= set(best.overrides())
    # The host holds what the device run held: 16 B per shard element (fp32 shard, gradient, moments).
    states = on_device.smallest.memory.device
    for key in ("params", "grads", "optimizer state"):
        assert key not in best.memory.device
        assert best.memory.host[key] == states[key]
    assert best.time.update > 0  # the host update over the shards


# (16, 8): 4 local experts over EDP 2, whole rows each; (32, 32): experts whole (EDP 1). With
# fewer local experts than EDP ranks (64, 8: 4 over 8) FSDP2's dim-0 shards pad to one expert
# per rank, and the estimate counts that padding (docs/parallelism.md).
@pytest.mark.parametrize("world, ep", [(16, 8), (32, 32)])
def test_sharded_states_are_one_nth(world, ep):
    cfg = load(DENSE, ["train.micro_batch_size=1"])
    model = rank_model(cfg, world, ep)
    no_decay = no_decay_ids(model)
    none = estimate_memory(_with_shard(cfg, "none"), model, no_decay, world, ep)
    edp = world // ep
    layout = shard_layout(cfg, model, no_decay, world, ep)
    want = 4.0 * (layout.dense_numel / world + layout.expert_numel / edp)
    for shard in ("optimizer", "full"):
        mem = estimate_memory(_with_shard(cfg, shard), model, no_decay, world, ep)
        assert mem.device["params"] == pytest.approx(want, rel=1e-3)  # ceil-rows padding only
        assert mem.device["optimizer state"] == pytest.approx(2 * want, rel=1e-3)
        assert mem.device["params"] < none.device["params"] / edp * 1.001
        assert "gradient-sync buckets" not in mem.device
    # Traffic: optimizer gathers every unit once, full twice (but the root); both reduce-scatter
    # what none all-reduces.
    none_t, opt_t, full_t = (data_parallel_traffic(_with_shard(cfg, s), layout, world, ep, "cuda")
                             for s in ("none", "optimizer", "full"))
    assert opt_t["reduce-scatter"] == full_t["reduce-scatter"] == none_t["all-reduce"] > 0
    assert opt_t["all-gather"] < full_t["all-gather"] < 2 * opt_t["all-gather"]


def test_inspect_prints_the_setting_and_its_traffic(capsys):
    from m6.inspect import main
    assert main([str(DENSE), "--world-size", "16", "parallel.expert_parallel_size=8"]) == 0
    out = capsys.readouterr().out
    assert "parallel.shard=full" in out and "gathered parameters" in out
    traffic = next(line for line in out.splitlines() if line.startswith("data-parallel traffic"))
    assert "all-reduce 0.00 MiB" in traffic and "all-gather 0.00" not in traffic


def test_fp16_gpus_plan_sharded_layouts_gathered_in_fp16():
    """train.precision=fp16 (V100s) composes with parallel.shard: the planner considers sharded
    candidates there, and FSDP2 gathers 2-byte copies as with bf16."""
    from m6.memory.shard_estimate import gather_bytes
    cfg = load(DENSE)
    assert gather_bytes(load(DENSE, ["train.precision=fp16"]), "cuda") == 2
    assert gather_bytes(load(DENSE, ["train.precision=fp32"]), "cuda") == 4
    narrow = dict(eps=[8], micro_batches=[1], recompute=("full",), offload=("none",), apply_groups=(1,), a2a=(None,),
                  tps=(1,), pps=(1,))  # the model whole on each rank (a pipeline of 4 with full recompute fits)
    hw = GPUS["v100"]
    assert hw.precision == "fp16"
    full = search(cfg, 64, 8, hw, HostProfile(1), 4096.0, **narrow, shard=("full",))
    assert full.considered > 0 and full.smallest.shard == "full"


def test_adafactor_plans_sharded_layouts_with_factored_state():
    """optim.name=adafactor composes with parallel.shard (m6.parallel.sharded_adafactor): the
    planner considers sharded candidates, whose optimizer state is the shards' factors (a matrix's
    local rows and its whole columns), far below AdamW's two moments per shard element."""
    narrow = dict(eps=[8], micro_batches=[1], recompute=("full",), offload=("none",), apply_groups=(1,), a2a=(None,),
                  shard=("full",))
    adamw = search(load(DENSE), 64, 8, GPUS["h100"], HostProfile(1), 4096.0, **narrow).smallest
    adafactor = search(load(DENSE, ["optim.name=adafactor"]), 64, 8, GPUS["h100"], HostProfile(1), 4096.0,
                       **narrow).smallest
    assert adafactor.shard == "full"
    assert 0 < adafactor.memory.device["optimizer state"] < adamw.memory.device["optimizer state"] / 20
