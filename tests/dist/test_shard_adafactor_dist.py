"""optim.name=adafactor under parallel.shard=full (m6.parallel.sharded_adafactor: torch's Adafactor
on FSDP2's dim-0 shards, with the statistics that span shards summed over the shard group) on
real gloo processes: the curve of torch's Adafactor on whole tensors, an exact resume, and a
checkpoint that reshards to one unsharded process."""

from __future__ import annotations

import json
import os

import pytest
from dist_helpers import run_distributed
from torch.distributed.tensor import DTensor, Replicate, Shard

from m6.config import load
from m6.memory.memory_report import estimate_memory
from m6.model.param_groups import no_decay_ids
from m6.parallel.fsdp import local_part
from m6.plan.memory import rank_model
from m6.parallel.sharded_adafactor import ShardedAdafactor
from m6.train.loop import Trainer

# tests/dist/test_shard_dist.py's model (dropless, fp32, no dropout) with Adafactor. EP 1: every
# expert tensor [E, rows, cols] is sharded on E over both ranks (its factors local, its norms not);
# the dense matrices are sharded on their rows (the column factor summed over the ranks).
SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=40",
         "model.image_size=16", "model.patch_size=8", "model.moe.every=1", "model.moe.num_experts=4",
         "model.moe.capacity_factor=null", "data.kind=synthetic", "data.num_samples=64", "data.eval_samples=8",
         "data.seq_len=32", "data.num_workers=0", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.eval_every=0", "logging.console=false", "logging.every=1", "checkpoint.every=0",
         "optim.warmup_steps=2", "train.grad_clip=1.0", "optim.name=adafactor", "train.device=cpu"]
STEPS = 4


def _curve(tr: Trainer) -> list[tuple[float, float]]:
    return [(h["loss"], h["grad_norm"]) for h in tr.history]


def _ranks(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    curves = {}
    for mode in ("none", "full"):
        tr = Trainer(load(None, [*SMALL, f"run.dir={root}/{mode}", f"train.max_steps={STEPS}",
                                 f"parallel.shard={mode}"]))
        tr.fit()
        curves[mode] = _curve(tr)
    assert isinstance(tr.update.optimizer, ShardedAdafactor)
    matrix = next(p for p in tr.model.parameters() if p.dim() == 2)
    state = tr.update.optimizer.state[matrix]
    assert isinstance(state["row_var"], DTensor) and state["row_var"].placements == (Shard(0),)
    assert state["col_var"].placements == (Replicate(),) and state["col_var"].shape[-1] == matrix.shape[-1]
    # Sharded equals torch's Adafactor on whole tensors at the same world size to fp32 rounding.
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(curves["full"], curves["none"]), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-6) and norm == pytest.approx(ref_norm, rel=1e-6), step
    # The estimate's optimizer state (m6.memory.shard_estimate) is what this rank holds, within
    # FSDP2's padding (the estimate counts padded rows; the last rank's shard has fewer).
    model = rank_model(tr.cfg, world, 1, rank)
    estimate = estimate_memory(tr.cfg, model, no_decay_ids(model), world, 1, "cpu")
    held = sum(local_part(t).numel() * 4 for s in tr.update.optimizer.state.values() for t in s.values())
    assert 0.95 * estimate.device["optimizer state"] <= held <= estimate.device["optimizer state"], (held, estimate)
    # A resume mid-run continues the sharded curve bitwise (the factored state round-trips).
    args = [*SMALL, f"run.dir={root}/resumed", f"train.max_steps={STEPS}", "parallel.shard=full", "checkpoint.keep=2"]
    first = Trainer(load(None, args))
    first.fit(stop_at=STEPS // 2)
    first.save_checkpoint(wait=True)
    resumed = Trainer(load(None, args))
    assert resumed.step == STEPS // 2
    resumed.fit()
    assert _curve(resumed) == curves["full"][STEPS // 2:]
    if rank == 0:
        with open(f"{root}/curves.json", "w") as f:
            json.dump(curves, f)


def test_sharded_adafactor_equals_unsharded(tmp_path):
    """~30 s on 2 shared cores: 2 gloo ranks train 4 runs (unsharded, sharded, a resumed pair),
    then 2 world-1 runs (the reference, the resharded resume)."""
    run_distributed(_ranks, 2, str(tmp_path), timeout_s=300)
    curves = json.loads((tmp_path / "curves.json").read_text())
    one = Trainer(load(None, [*SMALL, f"run.dir={tmp_path}/world1", f"train.max_steps={STEPS}"]))
    one.fit()
    # Against world 1: the sums over ranks in another order (measured 1.2e-5 at step 2 for torch's
    # own Adafactor at world 2 unsharded as for the sharded one: Adafactor's update divides by the
    # root of small second moments, which amplifies the fp32 rounding of the world-2 gradient).
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(curves["full"], _curve(one)), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=3e-5), step
    # The sharded checkpoint (factors as DTensors: a matrix's column factor replicated) reshards to
    # one unsharded process and continues the sharded curve (to world 1's rounding, as above).
    middle = tmp_path / "resumed" / "checkpoints" / f"step_{STEPS // 2:08d}"
    unsharded = Trainer(load(None, [*SMALL, f"run.dir={tmp_path}/unsharded", f"train.max_steps={STEPS}",
                                    f"checkpoint.resume={middle}"]))
    assert unsharded.step == STEPS // 2
    unsharded.fit()
    for (loss, norm), (ref_loss, ref_norm) in zip(_curve(unsharded), curves["full"][STEPS // 2:]):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=3e-5)
