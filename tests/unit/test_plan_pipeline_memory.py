"""The planner's pipeline memory (m6.plan.pipeline_memory, m6.parallel.pipeline_order): each rank's
actions in torch's own order, each rank sized with the blocks and ends it really holds, the
plan's peak the worst rank's (named), and torch's per-micro-batch buffers counted. Its peaks
against measured pipelined steps: tests/dist/test_plan_pipeline_memory_dist.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from m6.config import load
from m6.plan.pipeline_memory import PipelineMemory
from m6.parallel.pipeline_order import rank_actions

KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
# 4 blocks, MoE 1 and 3; 8 micro-batches of 2 at pp 2 x dp 1.
SMALL = ["model.d_model=64", "model.num_layers=4", "model.num_heads=4", "model.ffn_dim=128", "model.moe.every=2",
         "model.moe.num_experts=8", "model.moe.capacity_factor=null", "data.seq_len=32", "model.max_text_len=32",
         "train.global_batch_size=16", "train.micro_batch_size=2", "data.eval_samples=0"]


def torch_order(schedule_class, rank: int, **attrs) -> list[tuple[str, int, int]]:
    """torch's own per-rank action list (the generator its schedule's __init__ calls), on the
    attributes it reads."""
    ops = schedule_class._calculate_single_rank_operations(SimpleNamespace(**attrs), rank)
    return [(KIND[a.computation_type.name], a.stage_index, a.microbatch_index) for a in ops if a is not None]


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (3, 6), (4, 4), (4, 8), (4, 12), (3, 9)])
def test_rank_actions_are_torchs_order(pp, m):
    for rank in range(pp):
        for v in (2, 3):
            per_round = m // max(1, m // pp)
            assert rank_actions("interleaved", pp, v, m, rank) == torch_order(
                ScheduleInterleaved1F1B, rank, n_local_stages=v, microbatches_per_round=per_round, pp_group_size=pp,
                _n_microbatches=m), (pp, m, v, rank)
        assert rank_actions("zero_bubble", pp, 2, m, rank) == torch_order(
            ScheduleZBVZeroBubble, rank, pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp), (pp, m, rank)
        # Schedule1F1B (no generator in torch): min(m, pp - rank) forwards, then B and F in turn.
        one = rank_actions("1f1b", pp, 1, m, rank)
        warmup = min(m, pp - rank)
        assert [k for k, _, _ in one[:warmup]] == ["F"] * warmup and one[warmup][0] == "B"
        assert sorted(one) == sorted([("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)])


def _blocks_and_ends(sized: PipelineMemory, rank: int) -> tuple[set[int], set[str]]:
    names = [n for n, _ in sized.ranks[rank].facts.model.named_parameters()]
    blocks = {int(n.split(".")[1]) for n in names if n.startswith("blocks.")}
    return blocks, {n.split(".")[0] for n in names if not n.startswith("blocks.")}


def test_each_rank_holds_its_schedules_stages():
    cfg = load("configs/tiny.yaml", SMALL)
    one = PipelineMemory(cfg, 2, "1f1b", 1, 1, 1, "cpu")
    assert _blocks_and_ends(one, 0) == ({0, 1}, {"text_embed", "patch_embed", "modality"})
    assert _blocks_and_ends(one, 1) == ({2, 3}, {"final_norm", "text_embed"})  # the tied head's copy
    # Interleaved: stages r, r + p: rank 1 holds both MoE blocks (and is the worst rank).
    inter = PipelineMemory(cfg, 2, "interleaved", 2, 1, 1, "cpu")
    assert _blocks_and_ends(inter, 0)[0] == {0, 2} and _blocks_and_ends(inter, 1)[0] == {1, 3}
    worst = inter.report(cfg)
    assert worst.peak_shared == inter.rank_report(cfg, inter.ranks[1]).peak_shared
    assert any(k.startswith("pipeline rank 1 of 2 (stages 1, 3)") for k in worst.device)
    # ZB-V: rank 0 holds stages 0 and 3, so the embeddings and the head (one token table).
    zbv = PipelineMemory(cfg, 2, "zero_bubble", 2, 1, 1, "cpu")
    assert _blocks_and_ends(zbv, 0) == ({0, 3}, {"text_embed", "patch_embed", "modality", "final_norm"})
    assert _blocks_and_ends(zbv, 1) == ({1, 2}, set())
    # parallel.pipeline_stages where it names pp x v stages: rank 0 holds block 0 alone.
    cut = load("configs/tiny.yaml", [*SMALL, "parallel.pipeline_parallel_size=2", "parallel.pipeline_stages=[0,1]"])
    assert _blocks_and_ends(PipelineMemory(cut, 2, "1f1b", 1, 1, 1, "cpu"), 0)[0] == {0}
    assert _blocks_and_ends(PipelineMemory(cut, 2, "1f1b", 1, 1, 1, "cpu"), 1)[0] == {1, 2, 3}


def test_receive_buffers_are_one_per_micro_batch_per_stage_boundary():
    cfg = load("configs/tiny.yaml", SMALL)
    X = 2 * (16 + 32) * 64 * 4  # one micro-batch's [B, S, D] fp32 residual stream
    inter = PipelineMemory(cfg, 2, "interleaved", 2, 1, 1, "cpu")
    for rank, boundaries in ((0, 3), (1, 3)):  # stage 0: its output's gradient; 1, 2: both; 3: its input
        rep = inter.rank_report(cfg, inter.ranks[rank])
        assert next(v for k, v in rep.device.items() if k.endswith("receive buffers (inputs, output gradients)")) \
            == 8 * boundaries * X
    # More micro-batches in flight on the first rank at 1f1b: its activations held at the peak are
    # pp = 2 micro-batches' of its stage.
    one = PipelineMemory(cfg, 2, "1f1b", 1, 1, 1, "cpu")
    first = one.rank_report(cfg, one.ranks[0])
    held = next(v for k, v in first.device.items() if k.endswith("activations and sends held at the peak"))
    assert held == pytest.approx(2 * first.device["activations (per micro-batch)"])
