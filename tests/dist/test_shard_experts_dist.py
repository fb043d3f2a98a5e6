"""Expert replicas sharded over the expert-data-parallel dim (parallel.shard=full where EP cannot
take every rank): at world 4 = EDP 2 x EP 2 each rank holds half of its EP rank's experts'
parameters and AdamW moments (FSDP2 over `edp`), and training follows the replicated run and
world 1."""

from __future__ import annotations

import json
import os

import pytest
from dist_helpers import run_distributed
from torch.distributed.tensor import DTensor, Shard

from m6.config import load
from m6.parallel.fsdp import local_part
from m6.train.loop import Trainer

# tests/dist/test_shard_dist.py's model: dropless, fp32, no dropout. 4 experts, EP 2: 2 per EP
# rank, one on each of its 2 EDP ranks (whole rows: no padding, exactly half).
SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=40",
         "model.image_size=16", "model.patch_size=8", "model.moe.every=1", "model.moe.num_experts=4",
         "model.moe.capacity_factor=null", "data.kind=synthetic", "data.num_samples=64", "data.eval_samples=8",
         "data.seq_len=32", "data.num_workers=0", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.eval_every=0", "logging.console=false", "logging.every=1", "checkpoint.every=0",
         "optim.warmup_steps=2", "train.grad_clip=1.0", "train.device=cpu"]
STEPS = 4


def _curve(tr: Trainer) -> list[tuple[float, float]]:
    return [(h["loss"], h["grad_norm"]) for h in tr.history]


def _ranks(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    none = Trainer(load(None, [*SMALL, f"run.dir={root}/w4none", f"train.max_steps={STEPS}",
                               "parallel.expert_parallel_size=2"]))
    none.fit()
    tr = Trainer(load(None, [*SMALL, f"run.dir={root}/w4", f"train.max_steps={STEPS}", "parallel.shard=full",
                             "parallel.expert_parallel_size=2"]))
    layout = tr.sharded.groups.layout
    assert (layout.expert_parallel_size, world // layout.expert_parallel_size) == (2, 2)
    tr.fit()
    experts = tr.sharded.expert_params
    assert experts
    for name, p in experts.items():
        # This EP rank's 2 experts, sharded over the 2-rank EDP group: one expert's rows here.
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh.mesh_dim_names == ("edp",)
        assert p.shape[0] == 2 and local_part(p).shape[0] == 1, name
        assert local_part(p).numel() * 2 == p.numel()
        moments = tr.update.optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert local_part(moments[key]).numel() * 2 == p.numel(), (name, key)
    if rank == 0:
        with open(f"{root}/curve.json", "w") as f:
            json.dump(_curve(tr), f)
        with open(f"{root}/none.json", "w") as f:
            json.dump(_curve(none), f)


def test_expert_replicas_hold_half_each_and_train_as_world_1(tmp_path):
    """~30 s on 2 shared cores: 4 gloo ranks train twice (replicated and sharded), 4 steps each."""
    one = Trainer(load(None, [*SMALL, f"run.dir={tmp_path}/w1", f"train.max_steps={STEPS}"]))
    one.fit()
    run_distributed(_ranks, 4, str(tmp_path), timeout_s=300)
    got = json.loads((tmp_path / "curve.json").read_text())
    none = json.loads((tmp_path / "none.json").read_text())
    assert len(got) == len(none) == STEPS
    # Sharding the expert replicas is exact: the replicated run at the same layout to fp32 rounding.
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, none), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-6) and norm == pytest.approx(ref_norm, rel=1e-6), step
    # World 1: the same to 1e-5 over the first 2 steps. After them world 4 departs from world 1 by
    # more, sharded or not alike (1.0e-5 at step 3, 1.5e-4 in the norm at step 4, measured); likely
    # AdamW's elementwise normalisation turning the other order of the sums over 4 ranks into
    # whole-size updates of the elements whose gradients are at rounding level (not isolated).
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got[:2], _curve(one)[:2]), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5), step
