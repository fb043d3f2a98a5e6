"""Full scale without allocation: m6's real sharding (shard_model over a real DeviceMesh of a fake
process group, on ``meta``) at 480 and 512 ranks of M6-T and M6-10T, for a few ranks each; the
planner's per-rank parameter, gradient and optimizer bytes must equal the sharded model's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from m6 import config as m6config
from m6.model import M6Model
from torch.distributed.device_mesh import init_device_mesh

from m6.parallel.layout import MESH_DIMS, ProcessGroups, build_layout
from m6.parallel.plan import classify_parameters, default_plan, shard_model
from m6.plan.memory import RankMemory

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def real_shard(cfg: m6config.Config, world: int, rank: int, ep: int):
    """This rank's model as build_parallel makes it, on meta, under a fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with torch.device("meta"):
            model = M6Model(cfg.model)
        layout = build_layout(world, rank, ep, cfg.model.moe.num_experts, 8)
        # The mesh create_process_groups builds (its extra gloo checkpoint group needs real peers).
        mesh = init_device_mesh("cpu", (layout.expert_data_parallel_size, ep), mesh_dim_names=MESH_DIMS)
        groups = ProcessGroups(layout, mesh)
        plan = default_plan(model)
        shard_model(model, plan, groups)
        model.materialize(torch.device("meta"), 0)
        sharded = classify_parameters(model, plan, groups)
        assert dist.get_world_size(groups.expert) == ep
        return sharded
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,world,ep", [("m6-1t", 480, 160), ("m6-1t", 512, 512),
                                           ("m6-10t", 480, 160), ("m6-10t", 512, 512), ("m6-10t", 512, 256)])
def test_planner_bytes_equal_the_sharded_model(name, world, ep):
    cfg = m6config.load(CONFIGS / f"{name}.yaml", [f"train.global_batch_size={2 * world}", "train.micro_batch_size=1"])
    t0 = time.process_time()  # CPU time: the work done, whatever else the machine runs
    memory = RankMemory(cfg, world, ep, "cuda")
    planned = memory.report(cfg)
    offloaded = m6config.load(CONFIGS / f"{name}.yaml", [f"train.global_batch_size={4 * world}", "train.micro_batch_size=1",
                                                          "memory.offload=optimizer"])
    streamed = memory.report(offloaded)
    for rank in (0, ep - 1, world - 1):
        sharded = real_shard(cfg, world, rank, ep)
        params = [p for p in sharded.model.parameters()]
        numel = sum(p.numel() for p in params)
        first = {sharded.first_expert(n) for n in sharded.expert_params}
        assert first == {(rank % ep) * (cfg.model.moe.num_experts // ep)}
        assert planned.device["params"] == 4 * numel == sum(p.numel() * p.element_size() for p in params)
        assert planned.device["grads"] == 4 * numel
        assert planned.device["optimizer state"] == 8 * numel + 4 * len(params)
        # Offloaded with accumulation (gradient streaming): the device keeps only the gradients
        # other ranks share (every one at EP < world, the replicated ones at EP = world).
        shared = numel - (sum(p.numel() for p in sharded.expert_params.values()) if ep == world else 0)
        assert streamed.device["grads"] == 4 * shared
    assert time.process_time() - t0 < 60
