"""parallel.shard with memory.offload=optimizer+params (FSDP2's CPUOffloadPolicy) on CUDA, one
rank over NCCL: the same losses and gradient norms as the unsharded and the sharded-on-device runs,
the shards, their gradients and the optimizer state really on the host (pinned), the device's
resident bytes far below the sharded-on-device run's, and a checkpoint that resumes with offload
and reshards to shard=none. CUDA only (``pytest --device cuda``): the policy copies shards to an
accelerator for compute; on a CPU device the shards stay in host memory and the host optimizer
updates them (tests/dist/test_shard_dist.py).

The checks run in a child process: a Trainer that sees RANK/WORLD_SIZE joins an NCCL process
group, which would outlive this test in pytest's own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=128", "model.max_text_len=40",
         "model.image_size=16", "model.patch_size=8", "model.moe.every=1", "model.moe.num_experts=4",
         "model.moe.capacity_factor=null", "data.kind=synthetic", "data.num_samples=64", "data.eval_samples=8",
         "data.seq_len=32", "data.num_workers=0", "train.global_batch_size=8", "train.micro_batch_size=4",
         "train.eval_every=0", "logging.console=false", "logging.every=1", "checkpoint.every=0",
         "optim.warmup_steps=2", "train.grad_clip=1.0", "train.precision=fp32", "train.device=cuda",
         "memory.host_optimizer=auto"]
STEPS = 6
OFFLOAD = ["memory.offload=optimizer+params"]
SETTINGS = {"none": ["parallel.shard=none"], "full": ["parallel.shard=full"],
            "full-offload": ["parallel.shard=full", *OFFLOAD], "optimizer-offload": ["parallel.shard=optimizer", *OFFLOAD]}


def test_sharded_offload_trains_like_the_device_runs_and_resumes(device, tmp_path):
    if device.type != "cuda":
        pytest.skip("FSDP2's CPU offload needs CUDA: run with pytest --device cuda")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=240, cwd=repo)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    curves = result["curves"]
    for name in SETTINGS:
        assert len(curves[name]) == STEPS, name
    # The same model and math; only the AdamW kernels differ (CUDA's fused on the device, the
    # host's foreach on the offloaded shards) and the order of sums: fp32 rounding apart.
    for name in ("full", "full-offload", "optimizer-offload"):
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(curves[name], curves["none"]), 1):
            assert loss == pytest.approx(ref_loss, rel=1e-4), (name, step)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (name, step)
    assert curves["none"][0][1] > 1.0  # train.grad_clip=1.0 clips the first steps: the host clip is exercised
    placement = result["placement"]
    assert placement["params_on_host"] and placement["params_pinned"], placement
    assert placement["grads_on_host"] and placement["optimizer_state_on_host"], placement
    # Resident after a step: the device run keeps every fp32 shard and both moments there (16 B per
    # parameter), the offloaded one none of them.
    resident = result["resident_bytes"]
    assert resident["full-offload"] < 0.1 * resident["full"], resident
    assert result["peak_bytes"]["full-offload"] < result["peak_bytes"]["full"], result["peak_bytes"]
    resumed = result["resumed"]
    straight = [loss for loss, _ in curves["full-offload"][3:]]
    assert resumed["full-offload"] == pytest.approx(straight, rel=1e-5)
    assert resumed["none"] == pytest.approx(straight, rel=1e-4)  # resharded: shard=none, no offload


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checks(root: Path) -> None:
    """The child: train every setting, look where the offloaded state lives, resume."""
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    from m6.config import load
    from m6.train.loop import Trainer

    def trainer(name: str, *extra: str) -> Trainer:
        return Trainer(load(None, [*SMALL, f"run.dir={root}/{name}", f"train.max_steps={STEPS}", *extra]))

    curves, resident, peak = {}, {}, {}
    for name, extra in SETTINGS.items():
        gc.collect()  # the previous setting's trainer (reference cycles) must not count in this one's bytes
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        tr = trainer(name, *extra)
        rows = []
        for step in range(STEPS):
            m = tr.train_step()
            rows.append((m["loss"], m["grad_norm"]))
            if name == "full-offload" and step == 2:
                tr.save_checkpoint(wait=True)
        torch.cuda.synchronize()
        curves[name], resident[name] = rows, torch.cuda.memory_allocated() - base
        peak[name] = torch.cuda.max_memory_allocated() - base
        if name == "full-offload":
            params = [p for p in tr.model.parameters() if p.requires_grad]
            locals_ = [p.to_local() for p in params if isinstance(p, DTensor)]
            assert len(locals_) == len(params)
            # One more synced backward: where the gradient shards land.
            batch = tr.held_out_batch(list(range(2)))
            tr.update.begin_micro_batch(last=True)
            lm_sum, aux = tr.forward_loss(batch)
            tr.update.backward(lm_sum + aux)
            tr.update.finish()
            grads = [p.grad.to_local() for p in params if p.grad is not None]
            states = [t for p in params for t in tr.update.optimizer.state[p].values() if t.dim() > 0]
            placement = {"params_on_host": all(t.device.type == "cpu" for t in locals_),
                         "params_pinned": all(t.is_pinned() for t in locals_),
                         "grads_on_host": bool(grads) and all(g.device.type == "cpu" for g in grads),
                         "optimizer_state_on_host": bool(states) and all(
                             (t.to_local() if isinstance(t, DTensor) else t).device.type == "cpu" for t in states)}
            tr.update.zero_grad()
        del tr
    resumed = {}
    for name, extra in (("full-offload", SETTINGS["full-offload"]), ("none", SETTINGS["none"])):
        tr = trainer("full-offload", *extra)
        assert tr.step == 3, (name, tr.step)
        resumed[name] = [tr.train_step()["loss"] for _ in range(STEPS - 3)]
        del tr
    (root / "result.json").write_text(json.dumps({"curves": curves, "resident_bytes": resident, "peak_bytes": peak,
                                                  "placement": placement, "resumed": resumed}))


if __name__ == "__main__":
    _checks(Path(sys.argv[1]))
