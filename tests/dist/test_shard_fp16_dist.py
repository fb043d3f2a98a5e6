"""train.precision=fp16 under parallel.shard=full (FSDP2 gathers fp16 copies of the fp32 shards,
reduce-scatters in fp32) on real gloo processes: the loss scale's unscale folded into the sharded
clip, an overflow in any rank's shard agreed by every rank (all skip, all back off), and the same
losses, norms, skip pattern and scales as the replicated fp16 run."""

from __future__ import annotations

import math
import os

import pytest
import torch
from dist_helpers import run_distributed

from m6.config import load
from m6.parallel.fsdp import local_part
from m6.train.loop import Trainer

# As tests/dist/test_shard_dist.py's SMALL: dropless, no dropout; fp16 with a short growth interval
# so the scale both backs off and grows within a few steps.
SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=40",
         "model.image_size=16", "model.patch_size=8", "model.moe.every=1", "model.moe.num_experts=4",
         "model.moe.capacity_factor=null", "data.kind=synthetic", "data.num_samples=64", "data.eval_samples=8",
         "data.seq_len=32", "data.num_workers=0", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.eval_every=0", "logging.console=false", "logging.every=1", "checkpoint.every=0",
         "optim.warmup_steps=2", "train.grad_clip=1.0", "train.device=cpu", "train.precision=fp16",
         "train.loss_scale_growth_interval=2", "parallel.expert_parallel_size=2"]
# 2**20: the scaled loss's gradients overflow fp16 on the first steps; the scale backs off to where
# they fit, then grows (interval 2) into overflow again: skips at the start and later on.
HUGE_SCALE = 2.0 ** 20


def _env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _rows(tr: Trainer) -> list[tuple]:
    return [(h["loss"], h["grad_norm"], h["loss_scale"], h["skipped_steps"]) for h in tr.history]


def _poison_rank_1_at_step_3(tr: Trainer, rank: int) -> None:
    """An inf in rank 1's gradient of a dense weight after the sync at step 3: with shard=full in
    rank 1's shard only (rank 0 holds other rows), with shard=none in rank 1's replica only."""
    finish = tr.update.finish
    weight = next(p for p in tr.update.replicated if local_part(p).numel() > 0)

    def finish_then_poison() -> None:
        finish()
        if rank == 1 and tr.step + 1 == 3:
            local_part(weight.grad).view(-1)[0] = math.inf
    tr.update.finish = finish_then_poison


def _fp16_checks(rank: int, world: int, root: str, init_scale: float, steps: int) -> None:
    _env(rank, world)
    runs = {}
    for mode in ("none", "full"):
        tr = Trainer(load(None, [*SMALL, f"run.dir={root}/{mode}", f"train.max_steps={steps}",
                                 f"train.loss_scale_init={init_scale}", f"parallel.shard={mode}"]))
        if init_scale != HUGE_SCALE:
            _poison_rank_1_at_step_3(tr, rank)
        tr.fit()
        runs[mode] = tr
    full, none = runs["full"], runs["none"]
    block = full.model.blocks[0]
    assert block._get_fsdp_state()._mp_policy.param_dtype == torch.float16  # FSDP2 gathers fp16
    assert all(p.dtype == torch.float32 for p in full.model.parameters())  # fp32 shards stay the masters
    got, want = _rows(full), _rows(none)
    assert len(got) == len(want) == steps
    # The same skips and scales, step for step (an overflow in any rank's shard skips on all).
    assert [r[2:] for r in got] == [r[2:] for r in want], (got, want)
    assert full.counters.bad_steps == 0
    for step, ((loss, norm, _, skips), (ref_loss, ref_norm, *_)) in enumerate(zip(got, want), 1):
        # The same fp16 operands as cast-on-use; gradients summed in another order (fp16 within a
        # gathered weight's uses, fp32 over ranks): close, not equal (fp32 runs agree to 1e-5).
        assert loss == pytest.approx(ref_loss, rel=1e-3), (step, loss, ref_loss)
        if skips > (got[step - 2][3] if step > 1 else 0):
            # Skipped: the sharded norm sums every rank's shard, so it is non-finite on each (the
            # replicated run's rank 0 may have measured a finite norm of its own replica).
            assert not math.isfinite(norm), (step, norm)
        else:
            assert norm == pytest.approx(ref_norm, rel=1e-2), (step, norm, ref_norm)
    skipped = [r[3] for r in got]
    if init_scale != HUGE_SCALE:
        assert skipped == [0, 0, 1, 1, 1, 1], got  # step 3 skipped on both ranks, only it
    else:
        trained = [step for step in range(1, steps) if skipped[step] == skipped[step - 1]]
        assert skipped[0] == 1 and trained, skipped  # skipped at first, then trained
        assert skipped[-1] > skipped[trained[0]], skipped  # and skipped again after the scale grew
    if rank == 0:
        (open(f"{root}/done", "w")).close()


@pytest.mark.parametrize("init_scale, steps", [(2.0 ** 16, 6), (HUGE_SCALE, 8)])
def test_sharded_fp16_follows_replicated_fp16(tmp_path, init_scale, steps):
    run_distributed(_fp16_checks, 2, str(tmp_path), init_scale, steps, timeout_s=300)
    assert (tmp_path / "done").exists()
