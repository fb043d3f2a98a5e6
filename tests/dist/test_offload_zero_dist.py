"""memory.offload=zero at world size 2, real gloo: with the experts replicated (EP 1) and split
(EP 2, also with a block streamed in 16-bit) the ranks agree (replicated masters bitwise equal,
16-bit weights their roundings) and give a 1-rank zero run's losses up to the 16-bit gradient
all-reduce's rounding; an fp16 overflow in one rank's expert gradient only makes both skip the
step and back the loss scale off together."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed

from m6.config import load
from m6.train.loop import Trainer

# Dropless: the math does not depend on how the global batch is split over ranks.
SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=32",
    "model.image_size=16", "model.moe.every=1", "model.moe.num_experts=4", "model.moe.capacity_factor=null",
    "data.kind=synthetic", "data.num_workers=0", "data.num_samples=128", "data.eval_samples=0",
    "data.seq_len=32", "train.global_batch_size=8", "train.eval_every=0", "train.precision=bf16",
    "train.device=cpu", "logging.console=false", "checkpoint.every=0", "memory.offload=zero",
    "memory.offload_blocks=[]", "memory.host_optimizer=torch", "optim.warmup_steps=2",
]
STEPS = 4
TIMEOUT_S = 90
# World 2 all-reduces bf16 gradients (each rank's half of the batch rounded to bf16, then their
# sum rounded again) where world 1 rounds the whole batch's once: one more bf16 rounding
# (2**-9 relative) in every gradient, a few 1e-4 of the loss after 4 steps.
TOLERANCE = 2e-3


def trainer(run_dir, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"run.dir={run_dir}", *extra]))


def ranks_agree(tr: Trainer) -> None:
    off = tr.update.offload
    for name, p in tr.sharded.replicated_params.items():
        mine = off.master(p).detach().clone()
        other = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(other, mine)
        assert torch.equal(other[0], other[1]), name
    routers = {id(layer.router.weight) for layer in tr.model.moe_layers().values()}
    for name, p in tr.model.named_parameters():
        assert (p.dtype == torch.float32) == (id(p) in routers), name  # 16-bit weights, fp32 gates
        assert torch.equal(p.detach(), off.master(p).to(p.dtype)), name


def _ranks(rank: int, world: int, root: str, reference: list[float]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    for ep, extra in ((1, ()), (2, ()), (2, ("memory.offload_blocks=[1]",))):
        tr = trainer(f"{root}/ep{ep}-{len(extra)}", f"parallel.expert_parallel_size={ep}", *extra)
        assert tr.world_size == 2
        losses = []
        for _ in range(STEPS):
            losses.append(tr.train_step()["loss"])
            ranks_agree(tr)
        assert losses == pytest.approx(reference, rel=TOLERANCE), (ep, extra, losses, reference)
        gathered = [None, None]
        dist.all_gather_object(gathered, losses)
        assert gathered[0] == gathered[1]
    # fp16: an overflow in an expert gradient on rank 1 only (no other rank holds it).
    tr = trainer(f"{root}/skip", "parallel.expert_parallel_size=2", "train.precision=fp16")
    tr.train_step()
    scale = tr.update.loss_scale.scale
    finish = tr.update.finish

    def finish_then_poison() -> None:
        finish()
        if rank == 1:
            off = tr.update.offload
            off.master(next(iter(tr.sharded.expert_params.values()))).grad.view(-1)[0] = float("inf")

    tr.update.finish = finish_then_poison
    before = {n: tr.update.offload.master(p).clone() for n, p in tr.model.named_parameters()}
    tr.train_step()
    assert tr.counters.skipped_steps == 1 and tr.update.loss_scale.scale == scale / 2
    for n, p in tr.model.named_parameters():
        assert torch.equal(tr.update.offload.master(p), before[n]), n
    ranks_agree(tr)
    tr.update.finish = finish
    tr.train_step()
    assert tr.counters.skipped_steps == 1
    ranks_agree(tr)


def test_two_ranks_agree_and_match_one_rank(tmp_path):
    reference = trainer(tmp_path / "w1")
    losses = [reference.train_step()["loss"] for _ in range(STEPS)]
    run_distributed(_ranks, 2, str(tmp_path), losses, timeout_s=TIMEOUT_S)
