"""train.precision=fp16 at world size 2, expert-parallel 2, real gloo: an overflow on ONE rank
(an inf in a replicated gradient after its all-reduce, so only that rank's own norm sees it; then
in an expert gradient, which no other rank holds) makes every rank skip the step and back off the
scale together; replicated weights stay identical; the scale resumes from the checkpoint on both."""

from __future__ import annotations

import contextlib
import io
import math
import os

import torch
from dist_helpers import run_distributed, same_on_all_ranks

from m6.config import load
from m6.train.loop import Trainer

RUN = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=64", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=4", "train.eval_every=0", "train.precision=fp16", "train.device=cpu",
    "logging.console=false", "checkpoint.every=0", "parallel.expert_parallel_size=2",
    "train.loss_scale_growth_interval=2", "train.max_steps=6",
]


def _ranks(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    with contextlib.redirect_stdout(io.StringIO()):
        tr = Trainer(load(None, [*RUN, f"run.dir={root}"]))
    assert tr.sharded.groups.layout.expert_parallel_size == 2
    finish = tr.update.finish
    expert = next(p for p in tr.update.experts)

    def finish_then_poison_on_rank_1() -> None:
        finish()
        if rank == 1 and tr.step + 1 == 2:
            tr.update.replicated[0].grad.view(-1)[0] = math.inf  # after the sync: rank 0's copy stays finite
        if rank == 1 and tr.step + 1 == 3:
            expert.grad.view(-1)[0] = math.nan
    tr.update.finish = finish_then_poison_on_rank_1

    rows = [tr.train_step()]
    replicated_before = [p.detach().clone() for p in tr.update.replicated]
    expert_before = expert.detach().clone()
    rows += [tr.train_step() for _ in range(2)]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 2], rows
    assert [r["loss_scale"] for r in rows] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14]  # backed off on every rank
    assert tr.counters.bad_steps == 0
    for p, before in zip(tr.update.replicated, replicated_before):
        assert torch.equal(p.detach(), before)  # no rank updated
    assert torch.equal(expert.detach(), expert_before)
    rows += [tr.train_step() for _ in range(2)]  # finite again: 2 steps grow the scale
    assert rows[-1]["loss_scale"] == 2.0 ** 15 and rows[-1]["skipped_steps"] == 2
    assert same_on_all_ranks([r["loss_scale"] for r in rows] + [p.detach().sum().item() for p in tr.update.replicated])

    tr.save_checkpoint(wait=True)
    straight = tr.train_step()
    with contextlib.redirect_stdout(io.StringIO()):
        resumed = Trainer(load(None, [*RUN, f"run.dir={root}"]))
    assert resumed.step == 5
    assert resumed.update.loss_scale.state_dict() == {"scale": 2.0 ** 15, "growth_tracker": 0, "overflow_steps": 2}
    again = resumed.train_step()
    assert again["loss"] == straight["loss"] and again["loss_scale"] == straight["loss_scale"] == 2.0 ** 15


def test_fp16_overflow_on_one_rank_skips_on_all(tmp_path):
    run_distributed(_ranks, 2, str(tmp_path), timeout_s=120)


def test_fp16_host_grads_overflow_like_fp32_host_grads(tmp_path):
    """fp16 with 16-bit host gradients at world 2 and a high initial scale: the gradient reaching
    the host is an fp32 sum over the ranks, finite where each rank's fp16 backward was; stored
    in fp16 as it is it would turn inf and skip steps the fp32 host gradients apply (the scale then
    settles about world-size times lower). The scale's search is the fp32 host gradients'."""
    from test_train_world_sizes import ranks, train_rows

    args = ("train.precision=fp16", "memory.offload=optimizer", "memory.host_optimizer=torch",
            f"train.loss_scale_init={2.0 ** 20}", "train.loss_scale_growth_interval=2", "train.max_steps=10",
            "checkpoint.every=0")
    ranks(tmp_path / "fp32", 2, *args)
    ranks(tmp_path / "half", 2, *args, "memory.host_grad_dtype=compute")
    wide, half = train_rows(tmp_path / "fp32"), train_rows(tmp_path / "half")
    assert len(half) == 10 and 0 < wide[-1]["overflow_steps"] < 10
    for key in ("loss_scale", "overflow_steps"):
        assert [r[key] for r in half] == [r[key] for r in wide], key
