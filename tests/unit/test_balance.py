"""parallel.balance on one process: the share arithmetic, memory caps, the plan's errors, and the
loader handing out uneven shares of the same global batches, resumable under any split."""

from __future__ import annotations

import pytest

from m6.config import load
from m6.config_loader import ConfigError
from m6.data.pipeline import build_training_data
from m6.data.shares import batch_shares, micro_batch_sizes, num_micro_batches
from m6.train.balance import BatchPlan, balance_line, cap_shares, plan_batch, rank_slots, rows_that_fit, split_notes


def test_shares_are_whole_samples_in_proportion():
    assert batch_shares(8, [1, 1]) == [4, 4]
    assert batch_shares(9, [2, 1]) == [6, 3]
    assert batch_shares(8, [2, 1]) == [5, 3]  # 5.33 / 2.67: the larger remainder gets the odd sample
    assert batch_shares(10, [1, 1, 1]) == [4, 3, 3]  # ties to the lower rank
    assert batch_shares(4, [100, 1]) == [3, 1]  # every rank keeps at least one sample
    for weights in ([3, 1, 2], [0.7, 0.2, 0.1, 5.0], [1] * 7):
        for gb in (7, 16, 33):
            shares = batch_shares(gb, weights)
            assert sum(shares) == gb and min(shares) >= 1
            # No share is more than one sample off its exact proportion of the samples past the first each.
            total = sum(weights)
            assert all(abs((s - 1) - (gb - len(weights)) * w / total) < 1 for s, w in zip(shares, weights))
    with pytest.raises(ValueError, match="cannot give each of 3 ranks"):
        batch_shares(2, [1, 1, 1])
    with pytest.raises(ValueError, match="finite and > 0"):
        batch_shares(8, [1, 0])


def test_micro_batches_every_rank_runs_the_same_number():
    shares = [5, 3]
    assert num_micro_batches(shares, 2) == 3 and num_micro_batches(shares, None) == 1
    assert micro_batch_sizes(5, 3) == [2, 2, 1] and micro_batch_sizes(3, 3) == [1, 1, 1]
    assert micro_batch_sizes(4, 2) == [2, 2]
    with pytest.raises(ValueError, match="cannot fill 3 micro-batches"):
        micro_batch_sizes(2, 3)


def test_a_memory_capped_rank_gets_a_smaller_share_within_its_cap():
    # Rank 1 is the fastest but holds at most 4 samples: it gets 4, the rest goes by weight.
    assert batch_shares(16, [1, 4, 1]) == [3, 10, 3]
    shares = cap_shares(16, [1, 4, 1], [16, 4, 16])
    assert shares == [6, 4, 6] and sum(shares) == 16
    # A cap that binds only after another cap moves samples: repeated until none is exceeded.
    shares = cap_shares(20, [1, 4, 2], [20, 4, 7])
    assert shares[1] <= 4 and shares[2] <= 7 and sum(shares) == 20
    with pytest.raises(ValueError, match="at most 6 samples together"):
        cap_shares(8, [1, 1], [3, 3])


def cfg_with(*overrides: str):
    return load(None, ["data.kind=synthetic", "data.num_samples=64", "data.eval_samples=0", "data.seq_len=32",
                       "model.max_text_len=32", *overrides])


def test_plan_follows_the_config_and_names_the_key_when_it_cannot():
    even = plan_batch(cfg_with("train.global_batch_size=8", "train.micro_batch_size=2"), 2)
    assert (even.mode, even.shares, even.num_micro, even.micro_rows(1)) == ("even", [4, 4], 2, [2, 2])
    plan = plan_batch(cfg_with("train.global_batch_size=8", "train.micro_batch_size=2", "parallel.balance=[2,1]"), 2)
    assert (plan.shares, plan.num_micro, plan.micro_rows(0), plan.micro_rows(1)) == ([5, 3], 3, [2, 2, 1], [1, 1, 1])
    assert plan.max_micro_batch == 2
    # An uneven global batch is fine with weights (it is not with even).
    assert plan_batch(cfg_with("train.global_batch_size=9", "parallel.balance=[2,1]"), 2).shares == [6, 3]
    with pytest.raises(ConfigError, match="divisible"):
        plan_batch(cfg_with("train.global_batch_size=9"), 2)
    with pytest.raises(ConfigError, match=r"parallel.balance has 2 weights, the job has 3 ranks"):
        plan_batch(cfg_with("parallel.balance=[2,1]"), 3)
    with pytest.raises(ConfigError, match=r"gives rank 1 2 samples \(shares \[6, 2\]\), fewer than the 6 micro-batches"):
        plan_batch(cfg_with("train.global_batch_size=8", "train.micro_batch_size=1", "parallel.balance=[10,1]"), 2)
    auto = plan_batch(cfg_with("train.global_batch_size=12", "parallel.balance=auto"), 2, speeds=[30.0, 10.0])
    assert (auto.mode, auto.shares, auto.speeds) == ("auto", [9, 3], [30.0, 10.0])
    capped = plan_batch(cfg_with("train.global_batch_size=12", "parallel.balance=auto"), 2, speeds=[30.0, 10.0],
                        caps=[7, 12])
    assert capped.shares == [7, 5]
    for bad in ("parallel.balance=[1,0]", "parallel.balance=[]", "parallel.balance=fast"):
        with pytest.raises(ConfigError, match="parallel.balance"):
            cfg_with(bad)


def test_banner_line_and_rank_slots():
    plan = BatchPlan("auto", [30.0, 10.0], [9, 3], 1, [30.0, 10.0])
    line = balance_line(plan, ["cuda (NVIDIA H100)", "cuda (Tesla V100)"])
    assert line == ("balance  auto (measured speeds), 1 micro-batch(es) per rank | rank 0 cuda (NVIDIA H100), "
                    "30 samples/s: 9 samples; rank 1 cuda (Tesla V100), 10 samples/s: 3 samples")
    assert rank_slots(2.5, 1, 3) == [0.0, 2.5, 0.0] and rank_slots(2.5, 0, 1) == []
    local = cfg_with("parallel.balance=[2,1]", "model.moe.aux_loss_scope=local")
    (note,) = split_notes(local, plan)
    assert "aux_loss_scope=local" in note and "[9, 3]" in note
    assert split_notes(cfg_with("parallel.balance=[2,1]"), plan) == []
    assert split_notes(local, BatchPlan("even", [1.0, 1.0], [6, 6], 1)) == []


def steps_of(cfg, rank: int, world: int, steps: int, shares=None, state=None):
    """(sample keys per micro-batch per step, loader state after) of one rank's loader."""
    loader = build_training_data(cfg, rank, world).loader
    if shares is not None:
        loader.set_shares(*shares)
    if state is not None:
        loader.load_state_dict(state)
    seen = [[[key for _, key in b.origins] for b in loader.next_step()[0]] for _ in range(steps)]
    out = loader.state_dict()
    loader.close()
    return seen, out


def global_batches(per_rank: list[list[list[list[str]]]]) -> list[list[str]]:
    """Each step's samples, rank after rank, micro-batch after micro-batch."""
    return [[k for rank in per_rank for mb in rank[step] for k in mb] for step in range(len(per_rank[0]))]


def test_loader_hands_out_uneven_shares_of_the_same_global_batches_and_resumes_under_any_split():
    cfg = cfg_with("train.global_batch_size=8", "train.micro_batch_size=2", "parallel.balance=[2,1]")
    even_cfg = cfg_with("train.global_batch_size=8", "train.micro_batch_size=2")
    one, _ = steps_of(cfg_with("train.global_batch_size=8"), 0, 1, 6)
    uneven = [steps_of(cfg, r, 2, 6, ([5, 3], 3))[0] for r in range(2)]
    assert [len(mb) for mb in uneven[0][0]] == [2, 2, 1] and [len(mb) for mb in uneven[1][0]] == [1, 1, 1]
    assert global_batches(uneven) == global_batches([one])  # same samples, same order, 48 of 64 (no repeats)
    assert len(set(global_batches([one])[0] + global_batches([one])[3])) == 16
    # Resume: 2 steps even at world 2, then 4 steps uneven ([2,1]), then at world 3 with [1,1,2].
    first = [steps_of(even_cfg, r, 2, 2) for r in range(2)]
    state = first[0][1]
    assert first[1][1] == state  # the saved position is global: every rank saves the same
    middle = [steps_of(cfg, r, 2, 2, ([5, 3], 3), state) for r in range(2)]
    w3 = cfg_with("train.global_batch_size=8", "parallel.balance=[1,1,2]")
    last = [steps_of(w3, r, 3, 2, ([2, 2, 4], 1), middle[0][1]) for r in range(3)]
    resumed = (global_batches([s for s, _ in first]) + global_batches([s for s, _ in middle])
               + global_batches([s for s, _ in last]))
    assert resumed == global_batches([one])
    with pytest.raises(ValueError, match="do not split a global batch of 8"):
        build_training_data(cfg, 0, 2).loader.set_shares([4, 3], 1)
    with pytest.raises(ValueError, match="cannot fill 4 micro-batches"):
        build_training_data(cfg, 1, 2).loader.set_shares([5, 3], 4)


def test_memory_estimate_caps_the_rows_of_a_rank_with_less_memory():
    """Two ranks, the faster one with less memory: the estimate's rows per micro-batch cap its
    share, the slower rank takes the rest, and neither runs more rows than its memory holds."""
    from m6.model import build_meta_model
    from m6.memory.memory_report import estimate_memory
    from m6.model.param_groups import no_decay_ids
    import dataclasses

    cfg = cfg_with("train.global_batch_size=48", "train.micro_batch_size=16", "parallel.balance=auto")
    model = build_meta_model(cfg.model)

    def peak(rows: int) -> float:  # two micro-batches, as a rank that accumulates
        train = dataclasses.replace(cfg.train, global_batch_size=rows * 2 * 2, micro_batch_size=rows)
        return estimate_memory(dataclasses.replace(cfg, train=train), model, no_decay_ids(model), 2, 1).peak_device

    assert peak(11) > peak(10)  # past 9 rows the activations set the peak (below, the update does)
    caps = [rows_that_fit(cfg, model, 2, 1, limit, accumulates=True) for limit in (peak(10), peak(16))]
    assert caps[0] == 10 and caps[1] >= 16
    assert rows_that_fit(cfg, model, 2, 1, peak(1) / 2, accumulates=True) == 0
    uncapped = plan_batch(cfg, 2, speeds=[3.0, 1.0])
    assert uncapped.shares == [36, 12] and uncapped.micro_rows(0) == [12, 12, 12]  # past rank 0's 10
    plan = plan_batch(cfg, 2, speeds=[3.0, 1.0], caps=caps)
    assert plan.shares == [30, 18] and plan.num_micro == 3
    assert max(plan.micro_rows(0)) == 10 and max(plan.micro_rows(1)) <= 16
    with pytest.raises(ConfigError, match="not even one sample per micro-batch fits in the memory of rank 1"):
        plan_batch(cfg, 2, speeds=[3.0, 1.0], caps=[8, 0])
    with pytest.raises(ConfigError, match="hold at most 24 samples together"):
        plan_batch(cfg, 2, speeds=[3.0, 1.0], caps=[4, 4])


def test_auto_caps_a_ranks_rows_at_the_experts_its_speed_gives_it():
    """At EP 2 with speeds [3, 1] rank 0 holds 6 of 8 experts, not the even probe's 4: its memory
    cap is counted on those 6 (lower than the even probe's), and under parallel.shard, where the
    experts stay even, on the even layout."""
    from pathlib import Path

    from m6.parallel.launch import DistEnv
    from m6.parallel.speed_probe import rank_layout_model
    from m6.train.balance import rows_that_fit_layout

    gpu_2b = str(Path(__file__).resolve().parents[2] / "configs" / "m6-gpu-2b.yaml")
    env, limit, speeds = DistEnv(0, 2, 0, 2, "nccl"), 40 * 2**30, [3.0, 1.0]
    for shard in ("none", "full"):
        cfg = load(gpu_2b, ["parallel.balance=auto", "parallel.expert_parallel_size=2", "train.micro_batch_size=null",
                            "train.global_batch_size=16", f"parallel.shard={shard}"])
        even = rank_layout_model(cfg, env, 2)
        even_cap = rows_that_fit(cfg, even, 2, 2, limit)
        cap = rows_that_fit_layout(cfg, env, 2, speeds, limit)
        if shard == "none":
            uneven = rank_layout_model(cfg, env, 2, speeds)
            assert sum(p.numel() for p in uneven.parameters()) > sum(p.numel() for p in even.parameters())
            assert cap == rows_that_fit(cfg, uneven, 2, 2, limit) < even_cap, (cap, even_cap)
        else:
            assert cap == even_cap
