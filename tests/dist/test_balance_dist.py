"""parallel.balance on gloo (ranks with torchrun's environment): an uneven split of the same global
batch trains the same curve as the even one (EP 1 and EP 2, with and without accumulation), resumes
from even into uneven and back, and auto measures, agrees and logs (at EP 2 on a probe of each
rank's compute, its speeds laying out the experts too)."""

from __future__ import annotations

import os

import pytest
from test_train_world_sizes import SMALL, TINY, ranks, train_rows

# The test_train_world_sizes model (dropless, fp32, no dropout) for 8 steps.
STEPS = ["train.max_steps=8", "checkpoint.every=4"]
KEYS = ("loss", "lm_loss", "aux_loss_weighted", "balance_loss_unweighted", "z_loss_unweighted", "grad_norm")


def assert_same_curve(a: list[dict], b: list[dict], keys=KEYS, rtol: float = 1e-5) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b] and a
    for ra, rb in zip(a, b):
        for key in keys:
            assert ra[key] == pytest.approx(rb[key], rel=rtol, abs=1e-9), (ra["step"], key, ra[key], rb[key])


@pytest.fixture(scope="module")
def even_run(tmp_path_factory):
    """The even 2-rank run at EP ``ep`` (each made once for the module): the curve to reproduce."""
    made = {}

    def run(ep: int):
        if ep not in made:
            made[ep] = tmp_path_factory.mktemp(f"even_ep{ep}")
            ranks(made[ep], 2, *STEPS, f"parallel.expert_parallel_size={ep}")
        return made[ep]
    return run


def test_uneven_split_trains_the_even_curve(tmp_path, even_run, ep=1):
    """One micro-batch per rank: the whole global batch forms each MoE layer's global routing
    statistics whatever the split, so every loss term, aux included, is the even run's. (EP 2 is
    covered with accumulation below: two launches fewer for the suite's time.)"""
    par = f"parallel.expert_parallel_size={ep}"
    even_dir = even_run(ep)
    stdout = ranks(tmp_path / "w21", 2, *STEPS, par, "parallel.balance=[2,1]")
    even, uneven = train_rows(even_dir), train_rows(tmp_path / "w21")
    assert len(even) == 8
    assert_same_curve(uneven, even)
    assert "balance  weights [2.0, 1.0], 1 micro-batch(es) per rank | rank 0 cpu (1 thread): 5 samples; " \
           "rank 1 cpu (1 thread): 3 samples" in stdout
    assert all(r["compute_s/rank0"] > 0 and r["compute_s/rank1"] > 0 for r in uneven)
    # Resume from even into uneven (step 4 of the even run), and from uneven back into even.
    ckpt = even_dir / "checkpoints" / "step_00000004"
    ranks(tmp_path / "r_uneven", 2, *STEPS, par, "parallel.balance=[1,3]", f"checkpoint.resume={ckpt}")
    assert_same_curve(train_rows(tmp_path / "r_uneven"), even[4:])
    ckpt = tmp_path / "w21" / "checkpoints" / "step_00000004"
    ranks(tmp_path / "r_even", 2, *STEPS, par, f"checkpoint.resume={ckpt}")
    assert_same_curve(train_rows(tmp_path / "r_even"), even[4:])


def test_uneven_accumulation_at_ep2_trains_the_even_lm_curve(tmp_path):
    """train.micro_batch_size=2 with [2,1]: rank 0 runs micro-batches of 2, 2 and 1 rows, rank 1
    three of 1 (shares 5 and 3 of 8), where even runs 2 of 2 each; every all-to-all is still met. The aux
    losses are means over each micro-batch's tokens, so their value depends on how the batch is
    cut into micro-batches (as it does for any change of train.micro_batch_size): off here, the
    LM loss and gradient norm must match."""
    args = (*STEPS, "parallel.expert_parallel_size=2", "train.micro_batch_size=2", "model.moe.aux_loss_coef=0",
            "model.moe.z_loss_coef=0")
    ranks(tmp_path / "even", 2, *args)
    ranks(tmp_path / "w21", 2, *args, "parallel.balance=[2,1]")
    assert_same_curve(train_rows(tmp_path / "w21"), train_rows(tmp_path / "even"), keys=("loss", "lm_loss", "grad_norm"))


def _balance_line(stdout: str) -> tuple[list[float], list[int], str]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("balance  auto"))
    speeds = [float(part.split(", ")[1].split(" samples/s")[0]) for part in line.split("|")[1].split(";")]
    shares = [int(part.split(": ")[1].split(" samples")[0]) for part in line.split("|")[1].split(";")]
    return speeds, shares, line


def test_auto_measures_agrees_and_keeps_the_curve(tmp_path, even_run):
    """auto at EP 1: each rank's speed timed alone, the shares from them, the even curve."""
    stdout = ranks(tmp_path / "auto", 2, *STEPS, "parallel.expert_parallel_size=1", "parallel.balance=auto")
    assert_same_curve(train_rows(tmp_path / "auto"), train_rows(even_run(1)))
    speeds, shares, _ = _balance_line(stdout)
    assert len(speeds) == 2 and all(s > 0 for s in speeds) and sum(shares) == 8 and min(shares) >= 1
    assert all(r["compute_s/rank1"] > 0 for r in train_rows(tmp_path / "auto"))


def test_auto_at_ep2_lays_the_experts_out_from_the_probed_speeds(tmp_path):
    """auto at EP 2: each rank timed alone on a probe of its compute (the all-to-all looped back),
    the speeds size both the batch shares and the expert ranges, and the LM curve is the even
    run's (aux losses off, as for [2,1] above: they depend on the micro-batch cut)."""
    args = (*STEPS, "parallel.expert_parallel_size=2", "train.micro_batch_size=2", "model.moe.aux_loss_coef=0",
            "model.moe.z_loss_coef=0")
    ranks(tmp_path / "even", 2, *args)
    stdout = ranks(tmp_path / "auto", 2, *args, "parallel.balance=auto")
    assert_same_curve(train_rows(tmp_path / "auto"), train_rows(tmp_path / "even"), keys=("loss", "lm_loss", "grad_norm"))
    speeds, shares, line = _balance_line(stdout)
    assert len(speeds) == 2 and all(s > 0 for s in speeds) and sum(shares) == 8
    experts = [part.split("experts ")[1].strip() for part in line.split("|")[1].split(";")]
    # Contiguous ranges covering the 4 experts, one per rank ("a-b", or "a" for one expert).
    bounds = [(int(e.split("-")[0]), int(e.split("-")[-1])) for e in experts]
    assert bounds[0][0] == 0 and bounds[1][0] == bounds[0][1] + 1 and bounds[1][1] == 3, line


def _probe_one_rank_slowed(rank: int, world: int, procs: str) -> None:
    """auto's probe on the test bed: rank 1 runs its timed passes inside a cgroup at 3% of a core
    (below what any process gets on a busy machine, so the quota, not the load, slows it)."""
    from contextlib import nullcontext
    from pathlib import Path

    import torch

    from m6.config import load
    from m6.data.pipeline import build_training_data
    from m6.model import M6Model
    from m6.train.balance import gather_objects, measure_speed, plan_batch
    from m6.train.loss import forward_loss_sums

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    cfg = load(TINY, [*SMALL, "parallel.balance=auto"])
    with torch.device("meta"):
        model = M6Model(cfg.model)
    model.materialize(torch.device("cpu"), 0)
    batch = build_training_data(cfg, rank, world).loader.sample_batch(4).batch

    def forward_backward() -> None:
        lm_sum, aux = forward_loss_sums(model, batch, nullcontext())
        (lm_sum / max(batch.num_target_tokens, 1) + aux).backward()

    if rank == 1:
        Path(procs).write_text(str(os.getpid()))
    speed = measure_speed(forward_backward, 4, torch.device("cpu"))
    if rank == 1:
        (Path(procs).parents[1] / "cgroup.procs").write_text(str(os.getpid()))  # back to the root group
    speeds = gather_objects(speed, world)
    plan = plan_batch(cfg, world, speeds)
    assert speeds[1] < 0.6 * speeds[0], speeds
    assert plan.shares[0] > plan.shares[1] and sum(plan.shares) == 8, (speeds, plan.shares)


def test_auto_gives_a_rank_slowed_by_a_cpu_quota_a_smaller_share():
    from bench.balance import BenchSkipped, SlowGroup
    from dist_helpers import run_distributed

    try:
        with SlowGroup(3) as group:
            run_distributed(_probe_one_rank_slowed, 2, str(group.procs), timeout_s=120)
    except BenchSkipped as e:
        pytest.skip(str(e))


# The test_shard_dist model, one micro-batch per rank (a slow rank's small share needs no accumulation).
SHARD_SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64",
               "model.max_text_len=40", "model.image_size=16", "model.patch_size=8", "model.moe.every=1",
               "model.moe.num_experts=4", "model.moe.capacity_factor=null", "data.kind=synthetic",
               "data.num_samples=64", "data.eval_samples=8", "data.seq_len=32", "data.num_workers=0",
               "train.global_batch_size=8", "train.eval_every=0", "logging.console=false", "checkpoint.every=0",
               "train.max_steps=2", "parallel.shard=full", "parallel.balance=auto"]


def _auto_under_shard_with_rank1_slowed(rank: int, world: int, root: str) -> None:
    """Rank 1's every model forward starts with a 0.3 s sleep: the probe, FSDP2's model, either."""
    import time

    from m6.config import load
    from m6.model import M6Model
    from m6.train.loop import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if rank == 1:
        forward = M6Model.forward

        def slow_forward(self, *args, **kwargs):
            time.sleep(0.3)
            return forward(self, *args, **kwargs)
        M6Model.forward = slow_forward
    for ep in (1, 2):
        tr = Trainer(load(None, [*SHARD_SMALL, f"run.dir={root}/ep{ep}", f"parallel.expert_parallel_size={ep}"]))
        speeds, shares = tr.batch_plan.speeds, tr.batch_plan.shares
        # Each rank timed alone, not at the speed FSDP2's all-gathers tie it to (the slowest rank's).
        assert speeds[1] < 0.6 * speeds[0], (ep, speeds)
        assert shares[0] > shares[1] and sum(shares) == 8, (ep, speeds, shares)
        if ep == 2:  # under shard the experts stay even whatever the speeds: the run starts on every run
            assert tr.sharded.groups.layout.expert_ranges_by_rank() == ["0-1", "2-3"], speeds
        tr.fit()
        assert len(tr.history) == 2 and all(h["loss"] > 0 for h in tr.history)


def test_auto_under_shard_measures_each_rank_alone_and_keeps_the_experts_even(tmp_path):
    """parallel.shard=full with balance=auto at EP 1 and EP 2, rank 1 slowed: the speeds are the
    probe's (no all-gather inside the timed passes), the shares follow them, and at EP 2 the
    experts stay even (sharding refuses uneven ones; a layout must not depend on a timing)."""
    from dist_helpers import run_distributed

    run_distributed(_auto_under_shard_with_rank1_slowed, 2, str(tmp_path), timeout_s=120)


def test_uneven_accumulation_with_16bit_host_grads_trains_like_fp32_host_grads(tmp_path):
    """EP 2, bf16, offload with 16-bit host gradients, [3,1]: at micro-batch 4 rank 0 runs two
    micro-batches (shares 6 and 2 of 8) and the curve is the fp32 host gradients' to 16-bit
    rounding; a global batch of 7 in one micro-batch (shares 5 and 2: 2 processes do not divide
    it, which balance allows) trains too."""
    args = ("train.max_steps=3", "checkpoint.every=0", "parallel.expert_parallel_size=2", "train.precision=bf16",
            "memory.offload=optimizer", "memory.host_optimizer=torch", "parallel.balance=[3,1]")
    half = (*args, "memory.host_grad_dtype=compute")
    stdout = ranks(tmp_path / "half", 2, *half, "train.micro_batch_size=4")
    assert "2 micro-batch(es) per rank" in stdout
    ranks(tmp_path / "fp32", 2, *args, "train.micro_batch_size=4")
    rows, wide = train_rows(tmp_path / "half"), train_rows(tmp_path / "fp32")
    assert len(rows) == 3 and rows[0]["loss"] == wide[0]["loss"]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in wide], rel=1e-3)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in wide], rel=1e-2)
    stdout = ranks(tmp_path / "b7", 2, *half, "train.global_batch_size=7")
    assert "1 micro-batch(es) per rank" in stdout and "5 samples" in stdout
    assert len(train_rows(tmp_path / "b7")) == 3
