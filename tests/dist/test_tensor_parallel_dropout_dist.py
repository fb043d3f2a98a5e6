"""model.dropout > 0 at tensor parallel 2 on real gloo processes (m6.parallel.tp_rng): the
replicated activations get one dropout mask per tp group, so the replicated weights (whose
gradients are never summed over the tp group) stay identical on both tp ranks, also under
sequence parallel with uneven chunks of the sequence (48 and 47 tokens: each rank's own mask on
its chunk, drawn off the shared stream); and a recompute reproduces every mask
(memory.check_checkpointing: the same gradients with and without full recompute)."""

from __future__ import annotations

import contextlib
import io
import math
import os

import pytest
import torch
from dist_helpers import run_distributed, same_on_all_ranks

from m6.config import load
from m6.parallel.tp_rng import SequenceParallelDropout, TensorParallelSelfAttention
from m6.train.loop import Trainer

RUN = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_dim=64",
    "model.max_text_len=80", "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4",
    "model.moe.capacity_factor=null", "model.moe.router_jitter=0.1", "model.dropout=0.2", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=64", "data.eval_samples=8", "data.seq_len=79",
    "train.global_batch_size=4", "train.eval_every=0", "train.device=cpu", "logging.console=false",
    "checkpoint.every=0", "parallel.tensor_parallel_size=2", "train.max_steps=4",
]


def _ranks(rank: int, world: int, root: str, extra: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        tr = Trainer(load(None, [*RUN, f"run.dir={root}", *extra]))
        rows = [tr.train_step() for _ in range(4)]
    assert all(isinstance(b.attn, TensorParallelSelfAttention) for b in tr.model.blocks)
    if tr.cfg.parallel.sequence_parallel:
        assert all(isinstance(b.dropout, SequenceParallelDropout) for b in tr.model.blocks)
    assert all(math.isfinite(r["loss"]) for r in rows)
    if tr.cfg.memory.check_checkpointing and rank == 0:  # (a mismatch raises on every rank)
        assert "checkpointing check: largest gradient difference" in out.getvalue()
    # Every replicated weight (embeddings, norms, router, experts, head), elementwise, the same on both tp ranks.
    replicated = torch.cat([p.detach().double().flatten() for p in tr.update.replicated + tr.update.experts])
    assert same_on_all_ranks(replicated.tolist())
    assert same_on_all_ranks([r["loss"] for r in rows])


@pytest.mark.parametrize("extra", [[], ["parallel.sequence_parallel=true"],
                                   ["parallel.sequence_parallel=true", "memory.activation_checkpointing=full",
                                    "memory.check_checkpointing=true"]], ids=["tp", "sp", "sp-recompute"])
def test_tp2_dropout_one_mask_per_tp_group(tmp_path, extra):
    run_distributed(_ranks, 2, str(tmp_path), extra, timeout_s=120)
