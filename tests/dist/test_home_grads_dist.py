"""memory.zero_grad_landing at world size 2, real gloo: with a block streamed (expert parallel 2,
so the block's replicated gradients land in their homes after their bucket's all-reduce and its
experts' as their backward writes them), 16-bit host gradients and two micro-batches, the run whose
gradients land in the homes gives the losses and masters of the run with separate buffers,
bitwise, on both ranks."""

from __future__ import annotations

import os

import torch
from dist_helpers import run_distributed

from m6.config import load
from m6.train.loop import Trainer

SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=32",
    "model.image_size=16", "model.moe.every=1", "model.moe.num_experts=4", "model.moe.capacity_factor=null",
    "data.kind=synthetic", "data.num_workers=0", "data.num_samples=128", "data.eval_samples=0",
    "data.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_every=0",
    "train.precision=bf16", "train.device=cpu", "logging.console=false", "checkpoint.every=0",
    "memory.offload=zero", "memory.offload_blocks=[1]", "memory.host_grad_dtype=compute",
    "memory.host_optimizer=torch", "parallel.expert_parallel_size=2",
]
STEPS = 3
TIMEOUT_S = 90


def _ranks(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    runs = {landing: Trainer(load(None, [*SMALL, f"run.dir={root}/{landing}", f"memory.zero_grad_landing={landing}"]))
            for landing in ("home", "separate")}
    home, separate = runs["home"], runs["separate"]
    assert home.world_size == 2 and home.accum == 2
    off = home.update.offload
    landed = [p for p in home.model.blocks[1].parameters() if off._grad_buffers[id(p)] is off.streamer.homes()[id(p)]]
    replicated = {id(p) for p in home.sharded.replicated_params.values()}
    assert any(id(p) in replicated for p in landed) and any(id(p) not in replicated for p in landed)
    want = [separate.train_step()["loss"] for _ in range(STEPS)]
    got = [home.train_step()["loss"] for _ in range(STEPS)]
    assert got == want, (rank, got, want)
    for p, q in zip(home.model.parameters(), separate.model.parameters()):
        assert torch.equal(off.master(p), separate.update.offload.master(q))


def test_gradients_in_the_homes_are_the_separate_buffers_run_at_world_2(tmp_path):
    run_distributed(_ranks, 2, str(tmp_path), timeout_s=TIMEOUT_S)
