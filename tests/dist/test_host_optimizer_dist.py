"""memory.host_optimizer at world size 2, real gloo: when DeepSpeed's op fails on one rank only,
every rank makes the same choice (replicated weights must get the same update everywhere): auto
-> torch's AdamW on both ranks, with one line on rank 0 naming the failing rank; deepspeed -> the
config error on both ranks instead of one rank erroring while the other waits."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
from dist_helpers import run_distributed

from m6.config import ConfigError, load
from m6.memory import host_optimizer
from m6.train.loop import Trainer

RUN = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=64", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=4", "train.eval_every=0", "train.precision=fp32", "train.device=cpu",
    "logging.console=false", "checkpoint.every=0", "memory.offload=optimizer",
]


def _fail_on_rank_1(rank: int) -> None:
    """Rank 1's loader fails as a build without a compiler does; rank 0 loads the real op."""
    if rank == 1:
        def no_compiler(log):
            raise RuntimeError("Error building extension 'cpu_adam': [1/3] c++ -c x.cpp\n/bin/sh: 1: c++: not found")
        host_optimizer.load_cpu_adam = no_compiler


def _ranks(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    _fail_on_rank_1(rank)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tr = Trainer(load(None, [*RUN, f"run.dir={root}/auto", "memory.host_optimizer=auto"]))
    assert tr.update.host_optimizer == "torch"
    said = [line for line in out.getvalue().splitlines() if line.startswith("memory.host_optimizer=auto")]
    if rank == 0:
        assert len(said) == 1 and "on rank 1 (rank 1: host " in said[0] and "c++: not found" in said[0], said
    else:
        assert not said  # rank 0 speaks for the job
    tr.train_step()  # both ranks update with torch's AdamW: the step's collectives match
    with pytest.raises(ConfigError, match=r"memory.host_optimizer=deepspeed: .* on rank 1 .*c\+\+: not found"):
        Trainer(load(None, [*RUN, f"run.dir={root}/deepspeed", "memory.host_optimizer=deepspeed"]))


def test_every_rank_chooses_the_same_host_optimizer(tmp_path):
    """Can take over 30 s: rank 0 builds DeepSpeed's cpu_adam op when the build cache is empty
    (~1-2 min on 2 cores, once per cache; later runs load it in seconds), which is the path under
    test (the other rank must wait for that build and agree with its outcome); a generous bound."""
    run_distributed(_ranks, 2, str(tmp_path), timeout_s=300)
