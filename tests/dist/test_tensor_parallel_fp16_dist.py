"""train.precision=fp16 at tensor parallel 2 on real gloo processes: the loss scale's overflow check
agrees across the tp group (and with parallel.shard=full at world 4, across all ranks). An inf in
tp rank 1's own shard of a split weight's gradient (which
rank 0 does not hold), and then in rank 1's copy of a replicated gradient, makes both ranks skip
the step and back off the scale together; no weight moves on a skipped step and the replicated
weights stay identical on the two ranks. Without a forced overflow, a scale of 2**20 overflows
fp16 on its own: tp 2 skips the same steps with the same scales as the run without tp at the same
data-parallel split (one process; with parallel.shard=full on top, world 2 against world 4)."""

from __future__ import annotations

import contextlib
import io
import math
import os

import pytest
import torch
from dist_helpers import run_distributed, same_on_all_ranks
from test_tensor_parallel_dist import ARCHS, NO_CHECKPOINTS, run

from m6.config import load
from m6.parallel.fsdp import local_part
from m6.train.loop import Trainer

RUN = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_dim=64",
    "model.max_text_len=48", "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4",
    "model.moe.capacity_factor=null", "data.kind=synthetic", "data.num_workers=0", "data.num_samples=64",
    "data.eval_samples=8", "data.seq_len=48", "train.global_batch_size=4", "train.eval_every=0",
    "train.precision=fp16", "train.device=cpu", "logging.console=false", "checkpoint.every=0",
    "parallel.tensor_parallel_size=2", "train.loss_scale_growth_interval=2", "train.max_steps=5",
]


def _ranks(rank: int, world: int, root: str, extra: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    with contextlib.redirect_stdout(io.StringIO()):
        tr = Trainer(load(None, [*RUN, f"run.dir={root}", *extra]))
    assert tr.sharded.groups.layout.tensor_parallel_size == 2 and tr.update.split
    finish = tr.update.finish
    # A tp shard (rank 0 holds other rows or columns of it; sharded, a DTensor whose FSDP2 rows on
    # rank 1 no other rank holds), and a replicated weight rank 1 holds some of.
    split = next(p for p in tr.update.split if local_part(p).numel() > 0)
    replicated = next(p for p in tr.update.replicated if local_part(p).numel() > 0)

    def finish_then_poison_on_rank_1() -> None:
        finish()
        if rank == 1 and tr.step + 1 == 2:
            local_part(split.grad).view(-1)[0] = math.inf
        if rank == 1 and tr.step + 1 == 3:
            local_part(replicated.grad).view(-1)[0] = math.nan  # rank 0's copy stays finite
    tr.update.finish = finish_then_poison_on_rank_1

    rows = [tr.train_step()]
    params = tr.update.split + tr.update.replicated
    before = [p.detach().clone() for p in params]
    rows += [tr.train_step() for _ in range(2)]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 2], rows
    assert [r["loss_scale"] for r in rows] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14]  # backed off on both ranks
    assert tr.counters.bad_steps == 0
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)  # neither tp rank updated its shards or its replicated copies
    rows += [tr.train_step() for _ in range(2)]  # finite again: 2 steps grow the scale
    assert rows[-1]["loss_scale"] == 2.0 ** 15 and rows[-1]["skipped_steps"] == 2
    assert same_on_all_ranks([r["loss_scale"] for r in rows] + [r["skipped_steps"] for r in rows])
    if tr.cfg.parallel.shard == "none":  # the replicated weights: whole on every rank, the same
        assert same_on_all_ranks([p.detach().double().sum().item() for p in tr.update.replicated])


@pytest.mark.parametrize("world, extra", [(2, []), (4, ["parallel.expert_parallel_size=1", "parallel.shard=full"])],
                         ids=["tp2", "tp2-shard-full"])
def test_fp16_overflow_on_one_tp_rank_skips_on_all(tmp_path, world, extra):
    run_distributed(_ranks, world, str(tmp_path), extra, timeout_s=120)


# tp 2 against the run at the same data-parallel split without tp: where fp16 overflows depends on
# each rank's share of the batch (world 2 data-parallel skips other steps than one process), not on tp.
SHARD_FULL = ["parallel.expert_parallel_size=1", "parallel.shard=full"]


@pytest.mark.parametrize("world, extra", [(2, []), (4, SHARD_FULL)], ids=["tp2", "tp2-shard-full"])
def test_fp16_tp2_skips_the_steps_its_data_parallel_run_skips(tmp_path, world, extra):
    """Loss scale 2**20: the first steps overflow fp16 and back off, growth (interval 2) overflows
    again later. tp 2 (at world 2: against one process; at world 4 with shard full: against shard
    full at world 2, FSDP2 gathering fp16 copies in both) skips the same steps with the same scales;
    the losses and finite norms follow to 1e-3 (the partial sums of a split Linear meet in fp16)."""
    args = (*ARCHS["gqa-swiglu"], NO_CHECKPOINTS, "train.precision=fp16", f"train.loss_scale_init={2.0 ** 20}",
            "train.loss_scale_growth_interval=2", "train.max_steps=8")
    reference = run(tmp_path / "dp", world // 2, *args, *extra)
    tp = run(tmp_path / "tp2", world, *args, "parallel.tensor_parallel_size=2", *extra)
    assert [r["skipped_steps"] for r in tp] == [r["skipped_steps"] for r in reference]
    assert [r["loss_scale"] for r in tp] == [r["loss_scale"] for r in reference]
    assert 0 < reference[-1]["skipped_steps"] < 8, "the test must see both skipped and applied steps"
    for a, b in zip(tp, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (a["step"], a["loss"], b["loss"])
        if math.isfinite(b["grad_norm"]):
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), (a["step"], a["grad_norm"], b["grad_norm"])
