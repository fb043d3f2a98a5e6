"""Sharded checkpoints with real gloo ranks: every rank writes only its share, a checkpoint saved at
one layout loads at another with weights and Adam moments intact, resume is bitwise exact at the
same world size (each rank's RNG streams are its own), and ranks that disagree on what to resume
stop with an error naming the rank, its host and the path."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed

from m6.config import load
from m6.checkpoint import CheckpointError
from m6.checkpoint.sharded_io import read_metadata
from m6.train.loop import Trainer

SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=1", "model.moe.num_experts=8", "model.moe.capacity_factor=null",
    "model.dropout=0.1", "data.kind=synthetic", "data.num_workers=0", "data.num_samples=256",
    "data.eval_samples=8", "data.seq_len=48", "train.global_batch_size=8", "train.micro_batch_size=2",
    "train.eval_every=0", "train.precision=fp32", "train.device=cpu", "logging.console=false",
    "checkpoint.every=0",
]


def trainer(run_dir, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"run.dir={run_dir}", *extra]))


def _env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def global_state(tr: Trainer) -> dict[str, torch.Tensor]:
    """Weights and Adam moments with the experts gathered over the expert-parallel group."""
    groups, opt = tr.sharded.groups, tr.update.optimizer
    out = {}
    for name, p in tr.model.named_parameters():  # no offload: the optimizer updates the params themselves
        tensors = {name: p.detach(), **{f"{name}/{k}": v for k, v in opt.state[p].items() if v.dim() > 0}}
        for key, t in tensors.items():
            if name in tr.sharded.expert_params and groups.expert is not None:
                parts = [torch.empty_like(t) for _ in range(groups.layout.expert_parallel_size)]
                dist.all_gather(parts, t.contiguous(), group=groups.expert)
                t = torch.cat(parts)
            out[key] = t.clone()
    return out


def _save_and_resume(rank: int, world: int, root: str) -> None:
    _env(rank, world)
    ep = f"parallel.expert_parallel_size={world}"
    straight = trainer(f"{root}/straight", ep)
    losses = [straight.train_step()["loss"] for _ in range(6)]
    first = trainer(f"{root}/run", ep)
    assert [first.train_step()["loss"] for _ in range(3)] == losses[:3]
    path = first.save_checkpoint(wait=True)
    if rank == 0:
        torch.save(global_state(first), f"{root}/saved_w{world}.pt")
    else:
        global_state(first)
    resumed = trainer(f"{root}/run", ep)  # checkpoint.resume=auto (the default)
    assert resumed.step == 3
    # Bitwise: the same weights, moments, data position and every rank's own RNG (dropout) streams.
    assert [resumed.train_step()["loss"] for _ in range(3)] == losses[3:]

    # Each rank wrote one data file holding its own experts' rows; every tensor is stored once:
    # its chunks tile it exactly (replicated tensors are one chunk, written by one rank).
    metadata = read_metadata(path)
    assert {info.relative_path for info in metadata.storage_data.values()} == {
        f"__{r}_0.distcp" for r in range(world)}
    rows_per_rank = 8 // world
    for index, info in metadata.storage_data.items():
        if ".experts." in index.fqn and len(index.offset) == 3:
            assert info.relative_path == f"__{index.offset[0] // rows_per_rank}_0.distcp", index
    for key, md in metadata.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            assert sum(c.sizes.numel() for c in md.chunks) == md.size.numel(), key
    if rank == 0:
        assert len(Path(path, ".metadata").read_bytes()) > 0

    # Ranks that disagree (here: rank 1 looks at another run dir) stop before reading anything.
    mine = f"{root}/run" if rank != 1 else f"{root}/elsewhere"
    with pytest.raises(CheckpointError) as info:
        trainer(mine, ep)
    message = str(info.value)
    assert f"rank 1 (host {socket.gethostname()}) sees no checkpoint" in message
    assert "rank 0" in message and "step_00000003" in message and "shares" in message


def _load_at(rank: int, world: int, root: str, saved_world: int) -> None:
    _env(rank, world)
    resumed = trainer(f"{root}/run", f"parallel.expert_parallel_size={world}",
                      f"checkpoint.resume={root}/run/checkpoints/step_00000003")
    assert resumed.step == 3
    got = global_state(resumed)
    if rank == 0:
        want = torch.load(f"{root}/saved_w{saved_world}.pt", weights_only=True)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_save_resumes_bitwise_and_ranks_agree(tmp_path, world):
    run_distributed(_save_and_resume, world, str(tmp_path))


def test_checkpoint_reshards_across_layouts(tmp_path):
    """Saved at world 4 / EP 4, read at world 2 / EP 2 and at world 1: the same global weights and
    Adam moments, every expert under its global id."""
    run_distributed(_save_and_resume, 4, str(tmp_path))
    run_distributed(_load_at, 2, str(tmp_path), 4)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    single = trainer(f"{tmp_path}/run", f"checkpoint.resume={tmp_path}/run/checkpoints/step_00000003")
    want = torch.load(f"{tmp_path}/saved_w4.pt", weights_only=True)
    got = global_state(single)
    for k in want:
        assert torch.equal(got[k], want[k]), k
