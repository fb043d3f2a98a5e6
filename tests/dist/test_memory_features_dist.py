"""Group-wise apply and CPU offload at world size 2 with the experts split (EP=2), real gloo:
every variant gives the plain run's losses and weights bitwise, the plain run matches world
size 1, and a checkpoint saved offloaded resumes exactly under another offload mode."""

from __future__ import annotations

import os

import pytest
import torch
from dist_helpers import run_distributed

from m6.config import load
from m6.train.loop import Trainer

# Dropless and fp32: the math does not depend on how the global batch is split over ranks.
SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=1", "model.moe.num_experts=4", "model.moe.capacity_factor=null",
    "data.kind=synthetic", "data.num_workers=0", "data.num_samples=256", "data.eval_samples=8",
    "data.seq_len=48", "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_every=0",
    "train.precision=fp32", "train.device=cpu", "logging.console=false", "checkpoint.every=0",
    "memory.host_optimizer=torch",  # bitwise against the plain run: the same torch AdamW on the host
]
VARIANTS = [
    ["optim.apply_groups=4"],
    ["memory.offload=optimizer"],
    ["memory.offload=optimizer+params"],
    ["memory.offload=optimizer+params", "optim.apply_groups=3"],
]
STEPS = 5


def trainer(run_dir, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"run.dir={run_dir}", *extra]))


def full_weights(tr: Trainer) -> dict[str, torch.Tensor]:
    """Layout-free weights: experts gathered over the expert-parallel group (what the checkpoint's
    global expert tensors hold)."""
    groups = tr.sharded.groups
    out = {}
    for name, t in tr.model.state_dict().items():
        if name in tr.sharded.expert_params:
            parts = [torch.empty_like(t) for _ in range(groups.layout.expert_parallel_size)]
            torch.distributed.all_gather(parts, t.contiguous(), group=groups.expert)
            t = torch.cat(parts)
        out[name] = t.clone()
    return out


def _variants(rank: int, world: int, root: str, reference: list[float]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    ep = "parallel.expert_parallel_size=2"
    plain = trainer(f"{root}/plain", ep)
    assert plain.world_size == 2 and all(p.shape[0] == 2 for p in plain.sharded.expert_params.values())  # 2 of 4 experts
    plain_losses = [plain.train_step()["loss"] for _ in range(STEPS)]
    assert plain_losses == pytest.approx(reference, rel=1e-5)  # world 2 + EP 2 == world 1
    plain_weights = full_weights(plain)
    grad_bytes = lambda params: sum(p.numel() * 4 for p in params)  # noqa: E731
    all_bytes = grad_bytes(plain.model.parameters())
    replicated_bytes = grad_bytes(plain.sharded.replicated_params.values())
    for i, extra in enumerate(VARIANTS):
        tr = trainer(f"{root}/v{i}", ep, *extra)
        steps = [tr.train_step() for _ in range(STEPS)]
        assert [m["loss"] for m in steps] == plain_losses, extra
        weights = full_weights(tr)
        for k, v in weights.items():
            assert torch.equal(v, plain_weights[k]), (extra, k)
        # Device gradient bytes at the end of backward (accumulation 2): with offload the experts'
        # (no other rank holds them at EP 2) leave in every micro-batch; the replicated ones wait
        # for their all-reduce in the last. Before gradient streaming both kept all of them.
        streamed = any(e.startswith("memory.offload") for e in extra)
        expected = replicated_bytes if streamed else all_bytes
        assert all(m["grad_mb"] * 2**20 == expected for m in steps), (extra, steps[0]["grad_mb"], expected)
    assert replicated_bytes < all_bytes  # the experts (here 2 of 4 per rank) are the difference
    # Accumulation 4 (micro-batches of 1 row): offloaded equals plain bitwise.
    plain4, offloaded4 = trainer(f"{root}/plain4", ep, "train.micro_batch_size=1"), \
        trainer(f"{root}/offloaded4", ep, "train.micro_batch_size=1", "memory.offload=optimizer+params")
    assert plain4.accum == offloaded4.accum == 4
    for _ in range(3):
        assert plain4.train_step()["loss"] == offloaded4.train_step()["loss"]
    weights4 = full_weights(offloaded4)
    for k, v in full_weights(plain4).items():
        assert torch.equal(v, weights4[k]), k
    # Saved offloaded (host masters named after their params), resumed under another mode.
    first = trainer(f"{root}/resume", ep, "memory.offload=optimizer", "optim.apply_groups=2")
    losses = [first.train_step()["loss"] for _ in range(2)]
    first.save_checkpoint(wait=True)
    resumed = trainer(f"{root}/resume", ep, "memory.offload=optimizer+params", "checkpoint.resume=auto")
    assert resumed.step == 2
    losses += [resumed.train_step()["loss"] for _ in range(STEPS - 2)]
    assert losses == plain_losses


def test_memory_features_at_world_2_with_expert_parallel(tmp_path):
    reference = trainer(tmp_path / "w1")
    losses = [reference.train_step()["loss"] for _ in range(STEPS)]
    run_distributed(_variants, 2, str(tmp_path), losses)
