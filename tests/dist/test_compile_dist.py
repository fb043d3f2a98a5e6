"""train.compile=blocks on real gloo processes: expert parallelism (the MoE layers eager, their
all-to-all between compiled regions) and FSDP2 (each block compiled before fully_shard, its
gathers around the compiled regions), with recompute, train as the eager replicated run does."""

from __future__ import annotations

import json
import os

import pytest
from dist_helpers import run_distributed

from m6.config import load
from m6.parallel.compile import compiled_frames
from m6.train.loop import Trainer

# Dropless, fp32, no dropout (inductor's random numbers are not eager's); block 0 dense, block 1 MoE.
SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=40",
         "model.image_size=16", "model.patch_size=8", "model.moe.every=2", "model.moe.num_experts=4",
         "model.moe.capacity_factor=null", "model.dropout=0.0", "data.kind=synthetic", "data.num_samples=64",
         "data.eval_samples=0", "data.seq_len=32", "data.num_workers=0", "train.global_batch_size=8",
         "train.micro_batch_size=2", "train.device=cpu", "logging.console=false", "logging.every=1",
         "checkpoint.enabled=false", "train.max_steps=3", "parallel.expert_parallel_size=2"]


def _runs(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    curves, frames = {}, {}
    for name, extra in (("eager", []), ("compiled", ["train.compile=blocks"]),
                        ("compiled-full-recompute", ["train.compile=blocks", "parallel.shard=full",
                                                     "memory.activation_checkpointing=full"])):
        tr = Trainer(load(None, [*SMALL, f"run.dir={root}/{name}", *extra]))
        compiled_before = compiled_frames()
        curves[name] = [(h["loss"], h["grad_norm"]) for h in tr.fit()]
        frames[name] = compiled_frames() - compiled_before
    # Compiled the first time (attention, FFN norm, dense MLP); FSDP2's class swap of the blocks
    # fails the type guards, so the sharded run compiles its block-level regions again: not eager.
    assert frames["eager"] == 0 and frames["compiled"] == 3 and frames["compiled-full-recompute"] >= 1, frames
    for name, curve in curves.items():
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(curve, curves["eager"]), 1):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (name, step, loss, ref_loss)
            assert norm == pytest.approx(ref_norm, rel=1e-5), (name, step, norm, ref_norm)
    if rank == 0:
        with open(f"{root}/curves.json", "w") as f:
            json.dump(curves, f)


def test_compiled_blocks_with_expert_parallelism_and_fsdp2_equal_eager(tmp_path):
    """World 2, expert-parallel 2: eager, compiled, and compiled with parallel.shard=full and
    recompute of every part give the same losses and gradient norms over 3 steps. Over 30 s (24-65 s
    measured on the shared 2-core machine, inductor's cache warm): each rank compiles its regions."""
    run_distributed(_runs, 2, str(tmp_path), timeout_s=300)
    assert (tmp_path / "curves.json").exists()  # rank 0 got to the end
