"""Checkpoint tools across layouts with real gloo ranks: checkpoint.init_from at expert-parallel
size 2 gives each rank its own rows of a checkpoint saved by one process (and upcycles a dense FFN
into its local experts), and export consolidates a checkpoint saved at EP=2 into global tensors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_helpers import run_distributed

from m6.checkpoint import checkpoint_info, export_safetensors
from m6.config import load
from m6.checkpoint import read_checkpoint
from m6.train.loop import Trainer

safetensors_torch = pytest.importorskip("safetensors.torch")

SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=1", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=256", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_every=0", "train.precision=fp32",
    "train.device=cpu", "train.max_steps=2", "logging.console=false", "checkpoint.async_save=false",
]


def trainer(run_dir, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"run.dir={run_dir}", *extra]))


def saved_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(run_dir / "checkpoints" / "step_00000002")["model"]


def _init_at_ep2(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    root_dir = Path(root)
    ep = "parallel.expert_parallel_size=2"
    moe = trainer(root_dir / "moe_ep2", ep, f"checkpoint.init_from={root_dir / 'moe'}")
    saved, weights = saved_model(root_dir / "moe"), moe.model.state_dict()
    assert moe.step == 0
    for name, t in weights.items():
        if name in moe.sharded.expert_params:
            first = moe.sharded.first_expert(name)
            assert t.shape[0] == 2 and torch.equal(t, saved[name][first:first + 2]), (rank, name)
        else:
            assert torch.equal(t, saved[name]), (rank, name)
    up = trainer(root_dir / "up_ep2", ep, "model.moe.top_k=1", f"checkpoint.init_from={root_dir / 'dense'}")
    dense = saved_model(root_dir / "dense")
    for i in range(2):
        w_in = up.model.state_dict()[f"blocks.{i}.ffn.experts.w_in"]
        assert w_in.shape[0] == 2 and all(torch.equal(w, dense[f"blocks.{i}.ffn.fc_in.weight"].t()) for w in w_in)
    moe.fit()  # saves at EP=2: each expert tensor in two chunks


def test_init_from_and_export_across_layouts(tmp_path):
    trainer(tmp_path / "moe").fit()
    trainer(tmp_path / "dense", "model.moe.every=0").fit()
    run_distributed(_init_at_ep2, 2, str(tmp_path))

    info = checkpoint_info(tmp_path / "moe_ep2")
    assert (info["world_size"], info["expert_parallel_size"], info["num_data_files"]) == (2, 2, 2)
    export_safetensors(tmp_path / "moe_ep2", tmp_path / "m.safetensors")
    exported, saved = safetensors_torch.load_file(str(tmp_path / "m.safetensors")), saved_model(tmp_path / "moe_ep2")
    assert exported["blocks.0.ffn.experts.w_in"].shape == (4, 32, 64)
    assert set(exported) == set(saved) and all(torch.equal(exported[k], saved[k]) for k in saved)
