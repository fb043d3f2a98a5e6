"""parallel.shard (FSDP2 over m6's mesh, composed with experts) on real gloo processes: the same
losses and gradient norms as the replicated run, per-rank bytes measured at ~1/N of it, and
checkpoints that reshard between settings, world sizes and EP sizes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dist_helpers import run_distributed

from m6.config import load
from m6.parallel.fsdp import local_storage_bytes
from m6.train.loop import Trainer

# Dropless, fp32, no dropout: the math does not depend on how the global batch is split or
# whether parameters are sharded; only the order of floating-point sums differs.
SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=40",
         "model.image_size=16", "model.patch_size=8", "model.moe.every=1", "model.moe.num_experts=4",
         "model.moe.capacity_factor=null", "data.kind=synthetic", "data.num_samples=64", "data.eval_samples=8",
         "data.seq_len=32", "data.num_workers=0", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.eval_every=0", "logging.console=false", "logging.every=1", "checkpoint.every=0",
         "optim.warmup_steps=2", "train.grad_clip=1.0"]
STEPS = 8


def _env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _measured_bytes(tr: Trainer) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes, dense and expert apart, measured
    on the live tensors after one more synced forward/backward."""
    batch = tr.held_out_batch(list(range(2)))
    tr.update.begin_micro_batch(last=True)
    lm_sum, aux = tr.forward_loss(batch)
    tr.update.backward(lm_sum + aux)
    tr.update.finish()
    experts = {id(p) for p in tr.sharded.expert_params.values()}
    out = {}
    for kind, params in (("dense", [p for p in tr.model.parameters() if id(p) not in experts]),
                         ("expert", [p for p in tr.model.parameters() if id(p) in experts])):
        out[f"{kind}_params"] = local_storage_bytes(params)
        out[f"{kind}_grads"] = local_storage_bytes(p.grad for p in params)
        out[f"{kind}_optimizer"] = local_storage_bytes(t for p in params for t in tr.update.optimizer.state[p].values()
                                                  if t.dim() > 0)
    tr.update.zero_grad()
    return out


def _curve(tr: Trainer) -> list[tuple[float, float]]:
    return [(h["loss"], h["grad_norm"]) for h in tr.history]


def _assert_same_curve(got, want, what: str) -> None:
    assert len(got) == len(want) == STEPS, what
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (what, step, loss, ref_loss)
        assert norm == pytest.approx(ref_norm, rel=1e-5), (what, step, norm, ref_norm)


def _equality_checks(rank: int, world: int, root: str) -> None:
    _env(rank, world)
    for ep in (1, 2):
        runs = {}
        # full with recompute at world 4 EP 2: recompute of the experts' and attention's parts inside
        # FSDP units; optimizer (ZeRO-2) at world 2 only (the same units, another reshard setting).
        settings = [("none", []), ("full", ["memory.activation_checkpointing=full"] if world == 4 and ep == 2 else [])]
        if world == 2:
            settings.append(("optimizer", []))
        for mode, extra in settings:
            tr = Trainer(load(None, [*SMALL, f"run.dir={root}/ep{ep}-{mode}", f"train.max_steps={STEPS}",
                                     f"parallel.shard={mode}", f"parallel.expert_parallel_size={ep}", *extra]))
            tr.fit()
            runs[mode] = tr
        none = runs["none"]
        assert none.history[0]["grad_norm"] > 1.0  # train.grad_clip=1.0 really clips the first steps
        base = _measured_bytes(none)
        edp = world // ep
        for mode, tr in runs.items():
            if mode == "none":
                continue
            _assert_same_curve(_curve(tr), _curve(none), f"shard={mode} world {world} EP {ep}")
            got = _measured_bytes(tr)
            # Dense state 1/world of the replicas', expert state 1/EDP (each expert rests on its
            # EDP group), within 10%: uneven rows (the 261-row embedding over 2 ranks: 131 and
            # 130) and FSDP2's padding of a parameter's dim 0 to a multiple of the group size.
            for key, value in got.items():
                share = edp if key.startswith("expert") else world
                assert 0.9 * base[key] / share <= value <= 1.1 * base[key] / share, (mode, world, ep, key, value, base[key])
            if rank == 0:
                with open(f"{root}/bytes-w{world}-ep{ep}-{mode}.json", "w") as f:
                    json.dump({"none": base, mode: got}, f)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_runs_equal_replicated_runs(tmp_path, world):
    run_distributed(_equality_checks, world, str(tmp_path), timeout_s=300)
    assert (tmp_path / "bytes-w{}-ep2-full.json".format(world)).exists()  # rank 0 got to the end


# A constant LR (each segment stops at its own train.max_steps, which a cosine would follow) in
# its warmup (as tests/dist/test_train_world_sizes.py). With full LR from step 3 the round trip
# was 2e-5 (relative) off the straight run's loss at step 5, more than the 1e-5 asked here; not
# isolated, the likely cause being AdamW amplifying sums taken in another order over 1, 2 and 4 ranks.
ROUND_TRIP = ["optim.schedule=constant", "optim.warmup_steps=30"]


def _resume_segment(rank: int, world: int, run_dir: str, checkpoint: str, mode: str, ep: int, steps: int) -> None:
    _env(rank, world)
    tr = Trainer(load(None, [*SMALL, f"run.dir={run_dir}", f"train.max_steps={steps}", "checkpoint.every=2",
                             f"checkpoint.resume={checkpoint}", *ROUND_TRIP, f"parallel.shard={mode}",
                             f"parallel.expert_parallel_size={ep}"]))
    assert tr.start.startswith("resumed from"), tr.start
    tr.fit()
    if rank == 0:
        with open(f"{run_dir}/curve.json", "w") as f:
            json.dump(_curve(tr), f)


def test_checkpoints_reshard_between_settings(tmp_path):
    """none (world 1) -> full (world 4, EP 2: experts sharded over EDP 2) -> optimizer (world 2,
    EP 1: experts sharded over both ranks) -> none (world 1), two steps each, continue the curve
    of one straight run: every saved layout is read by every other (weights, moments, step)."""
    straight = Trainer(load(None, [*SMALL, f"run.dir={tmp_path}/straight", f"train.max_steps={STEPS}",
                                   "checkpoint.every=2", "checkpoint.keep=4", *ROUND_TRIP]))
    straight.fit()
    want = _curve(straight)
    checkpoint = tmp_path / "straight" / "checkpoints" / "step_00000002"
    for segment, (world, mode, ep) in enumerate([(4, "full", 2), (2, "optimizer", 1), (1, "none", 1)]):
        steps = 4 + 2 * segment
        run_dir = tmp_path / f"{mode}-w{world}"
        if world == 1:
            tr = Trainer(load(None, [*SMALL, f"run.dir={run_dir}", f"train.max_steps={steps}", "checkpoint.every=2",
                                     f"checkpoint.resume={checkpoint}", *ROUND_TRIP]))
            tr.fit()
            got = _curve(tr)
        else:
            run_distributed(_resume_segment, world, str(run_dir), str(checkpoint), mode, ep, steps, timeout_s=300)
            got = json.loads((run_dir / "curve.json").read_text())
        assert len(got) == 2, (mode, got)
        for (loss, norm), (ref_loss, ref_norm) in zip(got, want[steps - 2:steps]):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (mode, world, steps, loss, ref_loss)
            assert norm == pytest.approx(ref_norm, rel=1e-5), (mode, world, steps, norm, ref_norm)
        checkpoint = run_dir / "checkpoints" / f"step_{steps:08d}"


def _bf16_checks(rank: int, world: int, root: str) -> None:
    _env(rank, world)
    runs = {}
    for mode in ("none", "full"):
        tr = Trainer(load(None, [*SMALL, f"run.dir={root}/{mode}", "train.max_steps=4", "train.precision=bf16",
                                 f"parallel.shard={mode}", "parallel.expert_parallel_size=2"]))
        tr.fit()
        runs[mode] = tr
    full = runs["full"]
    assert full.fsdp_bf16 and not full.model.cast_on_use  # FSDP2's policy casts, not m6's ops
    assert all(p.dtype == torch.float32 for p in full.model.parameters())  # fp32 shards stay the masters
    block = full.model.blocks[0]
    assert block._get_fsdp_state()._mp_policy.param_dtype == torch.bfloat16
    # The same bf16 operands as cast-on-use; gradients reduced in fp32 in another order: close,
    # not equal (fp32 runs above are equal to 1e-5).
    for (loss, norm), (ref_loss, ref_norm) in zip(_curve(full), _curve(runs["none"])):
        assert loss == pytest.approx(ref_loss, rel=1e-3) and norm == pytest.approx(ref_norm, rel=2e-2)


def test_bf16_gathers_bf16_and_follows_cast_on_use(tmp_path):
    run_distributed(_bf16_checks, 2, str(tmp_path), timeout_s=300)


def _without_unused_param_reduction(rank: int, world: int, root: str) -> None:
    """An FSDP2 without set_reduce_scatter_unused_params (torch 2.11's): one rank trains, more refuse."""
    from torch.distributed.fsdp import FSDPModule

    from m6.parallel import LayoutError

    _env(rank, world)
    del FSDPModule.set_reduce_scatter_unused_params  # this rank's process only
    argv = [*SMALL, f"run.dir={root}/w{world}", "train.max_steps=1", "parallel.shard=full"]
    if world == 1:
        assert Trainer(load(None, argv)).fit()[-1]["step"] == 1
        return
    with pytest.raises(LayoutError, match=r"parallel.shard over more than one rank needs FSDP2's "
                                          r"set_reduce_scatter_unused_params, which torch .* lacks"):
        Trainer(load(None, argv))


@pytest.mark.parametrize("world", [1, 2])
def test_an_fsdp2_without_unused_param_reduction_shards_one_rank_only(tmp_path, world):
    run_distributed(_without_unused_param_reduction, world, str(tmp_path), timeout_s=120)


def _host_optimizer_on_shards(rank: int, world: int, root: str) -> None:
    """parallel.shard with memory.offload=optimizer+params on a CPU device: the shards are in host
    memory already (FSDP2 moves nothing) and the host optimizer, DeepSpeed's CPU Adam here, updates
    them: the curve of torch's AdamW to fp32 rounding, and a resume continues it bitwise."""
    from torch.distributed.tensor import DTensor

    from m6.memory.deepspeed_adam import DeepSpeedHostAdamW

    _env(rank, world)
    base = [*SMALL, f"train.max_steps={STEPS}", "parallel.shard=full", "parallel.expert_parallel_size=2"]
    offload = ["memory.offload=optimizer+params", "memory.host_optimizer=deepspeed"]
    device = Trainer(load(None, [*base, f"run.dir={root}/device"]))
    device.fit()
    straight = Trainer(load(None, [*base, *offload, f"run.dir={root}/straight"]))
    assert straight.update.host_optimizer == "deepspeed" and isinstance(straight.update.optimizer, DeepSpeedHostAdamW)
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in straight.model.parameters())
    straight.fit()
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(_curve(straight), _curve(device)), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4), step
    first = Trainer(load(None, [*base, *offload, f"run.dir={root}/resumed"]))
    first.fit(stop_at=STEPS // 2)
    first.save_checkpoint(wait=True)
    resumed = Trainer(load(None, [*base, *offload, f"run.dir={root}/resumed"]))
    assert resumed.step == STEPS // 2
    resumed.fit()
    assert _curve(resumed) == _curve(straight)[STEPS // 2:]


def test_the_host_optimizer_updates_shards_on_a_cpu_device(tmp_path):
    run_distributed(_host_optimizer_on_shards, 2, str(tmp_path), timeout_s=300)
