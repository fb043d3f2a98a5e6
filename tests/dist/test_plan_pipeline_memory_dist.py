"""The planner's per-rank pipeline memory (m6.plan.pipeline_memory) against the measured peak of a
real pipelined step on 2 gloo ranks, each schedule: every rank's high-water mark of live tensor
storages over one step (bench.plan_measure's count: storages alive at the step's start, those it
allocates, each uncounted once freed) within 6% of the rank's prediction, and the planner's worst
rank the measured worst."""

from __future__ import annotations

import os

import torch.distributed as dist
from dist_helpers import REPO, run_distributed

# 4 blocks, the MoE ones 1 and 3 (interleaved puts both on rank 1); 4 micro-batches of 2 per step.
OVERRIDES = ["model.d_model=64", "model.num_layers=4", "model.num_heads=4", "model.ffn_dim=128", "model.moe.every=2",
             "model.moe.num_experts=4", "model.moe.capacity_factor=null", "model.moe.force_balance=true",
             "data.seq_len=64", "model.max_text_len=64", "train.global_batch_size=8", "train.micro_batch_size=2",
             "parallel.pipeline_parallel_size=2", "parallel.expert_parallel_size=1"]
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zero_bubble", 2))


def _measure(rank: int, world_size: int, out: dict) -> None:
    import torch

    from bench.plan_measure import BASE_CONFIG, COMMON, DenseSamples, live_storages
    from m6.config import load
    from m6.memory.live_bytes import LiveBytes
    from m6.plan.pipeline_memory import PipelineMemory
    from m6.train.loop import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    for schedule, v in SCHEDULES:
        cfg = load(REPO / BASE_CONFIG, [*COMMON, *OVERRIDES, f"parallel.pipeline_schedule={schedule}",
                                        f"parallel.pipeline_stages_per_rank={v}", f"run.dir={out['dir']}/{schedule}"])
        m = cfg.model
        trainer = Trainer(cfg, dataset=DenseSamples(32, cfg.data.seq_len, (m.image_channels, m.image_size,
                                                                            m.image_size)))
        for _ in range(2):  # the first step also infers the stages' shapes
            trainer.train_step()
        live = LiveBytes()
        live.include(live_storages())
        with live:
            trainer.train_step()
        measured = torch.tensor([float(live.peak)] * world_size)
        measured[1 - rank] = 0.0
        dist.all_reduce(measured)  # every rank's peak, on every rank
        sized = PipelineMemory(cfg, 2, schedule, v, 1, 1, "cpu")
        predicted = [sized.rank_report(cfg, r).peak_shared for r in sized.ranks]
        for r in range(world_size):
            ratio = predicted[r] / measured[r].item()
            assert abs(ratio - 1) <= 0.06, (schedule, r, predicted[r], measured[r].item(), ratio)
        assert max(range(2), key=lambda r: predicted[r]) == int(measured.argmax()), (schedule, predicted, measured)
        worst = sized.report(cfg)
        assert any(f"pipeline rank {int(measured.argmax())} of 2" in k for k in worst.device), worst.device


def test_each_pipeline_ranks_predicted_peak_matches_its_measured_step(tmp_path):
    run_distributed(_measure, 2, {"dir": str(tmp_path)}, timeout_s=120)
