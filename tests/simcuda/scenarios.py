"""The scenarios that run under simulated CUDA, in groups; one process runs one group.

    LD_PRELOAD=<library> python tests/simcuda/scenarios.py GROUP REPORT.json WORKDIR

(tests/simcuda/preload.py builds the library and starts this.) Each scenario's result goes into
the JSON report: what it checked itself (``facts``), the findings of simulated CUDA (problems, host
syncs with their call sites and phases) and, for Trainer runs, the events the host-sync allow-list
counts by (run_phases.py). A scenario that raises is reported with its traceback. The tests assert
on the report.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

import mirror_world
import run_phases
import sim_adaptations
from fake_cuda_api import DEVICE, simulated_cuda
from sim_tensor import PINNED, RECORD, SimTensor, on_device

# The fake-tensor replay logs every meta check it sees fail; the findings carry them instead.
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

GROUPS: dict[str, list[Callable[[Path], dict]]] = {}


def scenario(group: str):
    def register(fn):
        GROUPS.setdefault(group, []).append(fn)
        return fn
    return register


# ---- harness self-test: planted defects must be reported -----------------------------------------
def planted_item(x: torch.Tensor) -> float:
    return x.sum().item()


@scenario("layers")
def planted_defects(workdir: Path) -> dict:
    """A device mix, a CUDA-only constraint, a host sync and a host tensor to an NCCL all-reduce,
    each planted on purpose: the harness must report every one (else it could pass silently)."""
    facts = {}
    with simulated_cuda():
        a = torch.ones(4, 4, device="cuda")
        with RECORD.capture() as mix:
            a + torch.ones(4, 4)  # cuda + a host tensor: "Expected all tensors to be on the same device"
        with RECORD.capture() as meta:
            offs = torch.tensor([2, 4], dtype=torch.int32, device="cuda")
            torch._grouped_mm(torch.ones(4, 8, device="cuda"), torch.ones(2, 8, 8, device="cuda"), offs=offs)
        with RECORD.capture() as sync:
            planted_item(a)
        with RECORD.capture() as clean:
            (a @ a).relu_().sum(0)
    mirror_world.install(2)
    import torch.distributed as dist
    dist.init_process_group("nccl")
    with simulated_cuda(), RECORD.capture() as nccl:
        host = torch.ones(3)
        dist.all_reduce(host)
        facts["mirror_sum"] = host.tolist()
        on_device = torch.ones(3, device="cuda")
        dist.all_reduce(on_device)
    mirror_world.leave()
    facts["clean"] = clean.to_json()
    return {"facts": facts, "device_mix": mix.to_json(), "cuda_only": meta.to_json(), "host_sync": sync.to_json(),
            "nccl_host_tensor": nccl.to_json()}


# ---- the MoE layer and the model ---------------------------------------------------------------------
def _moe_forward_backward(kernel: str, dtype: torch.dtype | None, capacity_factor: float | None,
                          cast_on_use: bool = False) -> dict:
    from m6.moe import MoELayer
    torch.manual_seed(0)
    layer = MoELayer(64, 128, 8, top_k=2, capacity_factor=capacity_factor, expert_kernel=kernel).to("cuda")
    layer.experts.cast_on_use = cast_on_use
    x = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    mask = torch.ones(2, 16, dtype=torch.bool, device="cuda")
    mask[1, 12:] = False
    autocast = torch.autocast("cuda", dtype=dtype, enabled=dtype is not None)
    with RECORD.capture() as found:
        with autocast:
            y, aux = layer(x, mask)
        (y.float().square().sum() + aux).backward()
    grads_on_device = all(isinstance(p.grad, SimTensor) for p in layer.parameters()) and isinstance(x.grad, SimTensor)
    return {"facts": {"kernel": layer.experts.last_kernel, "output_on_device": isinstance(y, SimTensor),
                      "grads_on_device": grads_on_device, "output_dtype": str(y.dtype)},
            "findings": found.to_json()}


@scenario("layers")
def moe_layer(workdir: Path) -> dict:
    """Forward and backward of one MoE layer: capacity and dropless, loop and grouped GEMMs, fp32,
    bf16 autocast and cast-on-use."""
    cases = {
        "capacity-fp32-loop": ("loop", None, 1.25, False),
        "dropless-fp32-loop": ("loop", None, None, False),
        "capacity-bf16-autocast-auto": ("auto", torch.bfloat16, 1.25, False),
        "dropless-bf16-cast_on_use-grouped_mm": ("grouped_mm", torch.bfloat16, None, True),
    }
    with simulated_cuda():
        return {name: _moe_forward_backward(*case) for name, case in cases.items()}


@scenario("layers")
def expert_kernel_choice(workdir: Path) -> dict:
    """model.moe.expert_kernel on CUDA: which kernel auto takes on each compute capability, and what
    an explicit grouped_mm does where torch has no fused kernel (fp32, or a GPU other than sm90/sm100)."""
    out = {}
    saved = (DEVICE.major, DEVICE.minor)
    try:
        with simulated_cuda():
            for capability in ((8, 0), (9, 0), (10, 0), (12, 0)):
                DEVICE.major, DEVICE.minor = capability
                for kernel, dtype in (("auto", torch.bfloat16), ("grouped_mm", torch.bfloat16),
                                      ("grouped_mm", None)):
                    name = f"sm{capability[0]}{capability[1]}-{kernel}-{'bf16' if dtype else 'fp32'}"
                    try:
                        result = _moe_forward_backward(kernel, dtype, None)
                        result["error"] = None
                    except Exception as e:  # noqa: BLE001: the refusal is what some cases check
                        result = {"error": f"{type(e).__name__}: {e}"}
                    out[name] = result
    finally:
        DEVICE.major, DEVICE.minor = saved
    return out


def _tiny_config(overrides: list[str], run_dir: Path):
    import m6
    base = ["data.num_workers=0", "train.max_steps=2", "train.global_batch_size=8", "logging.every=2",
            "logging.console=false", "checkpoint.every=0", "train.eval_every=0", "data.eval_samples=8",
            "train.eval_batches=1", "train.device=cuda", f"run.dir={run_dir}"]
    return m6.load_config("configs/tiny.yaml", base + overrides)


@scenario("layers")
def model_forward_backward(workdir: Path) -> dict:
    """The tiny model's forward, loss and backward on one collated micro-batch, fp32 and bf16."""
    from m6.data.batch import collate
    from m6.data.byte_tokenizer import ByteTokenizer
    from m6.data.synthetic import SyntheticImageCaptionDataset
    from m6.model import M6Model
    from m6.train.loss import forward_loss_sums
    cfg = _tiny_config([], workdir / "model")
    m = cfg.model
    data = SyntheticImageCaptionDataset(16, image_size=m.image_size, seed=0)
    batch = collate([data[i] for i in range(4)], ByteTokenizer(), cfg.data.seq_len,
                    (m.image_channels, m.image_size, m.image_size))
    out = {}
    with simulated_cuda():
        torch.manual_seed(0)
        model = M6Model(m).to("cuda")
        for name, dtype in (("fp32", None), ("bf16-autocast", torch.bfloat16)):
            device_batch = batch.to("cuda")
            with RECORD.capture() as found:
                autocast = torch.autocast("cuda", dtype=dtype, enabled=dtype is not None)
                loss, aux = forward_loss_sums(model, device_batch, autocast)
                (loss / device_batch.num_target_tokens + aux).backward()
            model.zero_grad(set_to_none=True)
            out[name] = {"findings": found.to_json(), "facts": {"moe_layers": len(model.moe_layers()),
                                                                 "loss_on_device": isinstance(loss, SimTensor)}}
    return out


HF_BLOCK_OPTIONS = [  # the Hugging Face families' block options (docs/training.md#block-architecture)
    "model.norm=rmsnorm", "model.positions=rope", "model.image_positions=rope", "model.num_kv_heads=2",
    "model.head_dim=16", "model.qk_norm=head", "model.linear_bias=false", "model.attention_bias=true",
    "model.ffn_activation=swiglu", "model.tie_embeddings=false", "model.moe.activation=swiglu",
    "model.moe.num_shared_experts=1", "model.moe.shared_expert_gate=true", "model.moe.first_dense_blocks=1",
    "model.moe.every=1", "model.moe.routed_scaling_factor=1.5",
]


@scenario("layers")
def built_under_cuda_context(workdir: Path) -> dict:
    """Modules built under ``with torch.device("cuda")`` (as torchtitan and transformers build
    models): an MoE layer, and the model with the Hugging Face block options, whose forward, loss
    and backward then run on the device in fp32 and bf16 autocast."""
    from m6.data.batch import collate
    from m6.data.byte_tokenizer import ByteTokenizer
    from m6.data.synthetic import SyntheticImageCaptionDataset
    from m6.model import M6Model
    from m6.moe import MoELayer
    from m6.train.loss import forward_loss_sums
    cfg = _tiny_config(HF_BLOCK_OPTIONS, workdir / "context")
    m = cfg.model
    data = SyntheticImageCaptionDataset(16, image_size=m.image_size, seed=0)
    batch = collate([data[i] for i in range(4)], ByteTokenizer(), cfg.data.seq_len,
                    (m.image_channels, m.image_size, m.image_size))
    out = {}
    with simulated_cuda():
        try:
            with torch.device("cuda"):
                layer = MoELayer(64, 128, 8, activation="swiglu")
                model = M6Model(m)
        except Exception as e:  # noqa: BLE001: the failure is what the test reports
            return {"error": f"{type(e).__name__}: {e}"}
        out["error"] = None
        out["on_device"] = all(p.device.type == "cuda" for p in [*layer.parameters(), *model.parameters()])
        for name, dtype in (("fp32", None), ("bf16-autocast", torch.bfloat16)):
            device_batch = batch.to("cuda")
            with RECORD.capture() as found:
                autocast = torch.autocast("cuda", dtype=dtype, enabled=dtype is not None)
                loss, aux = forward_loss_sums(model, device_batch, autocast)
                (loss / device_batch.num_target_tokens + aux).backward()
            model.zero_grad(set_to_none=True)
            out[name] = {"findings": found.to_json(), "facts": {"moe_layers": len(model.moe_layers()),
                                                                 "loss_on_device": isinstance(loss, SimTensor)}}
    return out


# ---- short Trainer runs -------------------------------------------------------------------------------
# Two steps of configs/tiny.yaml on a global batch of 8, one logging step (the last), one evaluation
# and one checkpoint (both at the end): every phase of the host-sync allow-list occurs. The fp32 run
# then resumes from its checkpoint for a third step.
PRECISION_VARIANTS = {
    "fp32": ["train.precision=fp32"],
    "bf16-accumulate": ["train.precision=bf16", "train.micro_batch_size=4"],
    "bf16-autocast": ["train.precision=bf16-autocast"],
    # Dropless on torch's grouped GEMM (simulated H100): the MoE layers read nothing back (host
    # syncs checked against DROPLESS_SINGLE_GPU_ALLOW_LIST).
    "dropless-grouped_mm": ["train.precision=bf16", "model.moe.capacity_factor=null",
                            "model.moe.expert_kernel=grouped_mm"],
    # train.weight_copy=per_step with accumulation: bf16 weights copied once per step from fp32 masters
    # on the device, gradients folded into the masters' by a hook. torch's fused AdamW then one foreach
    # copy (optim.implementation=fused): m6's Triton AdamW, auto's pick on a GPU, cannot run on
    # simulated tensors (its host side reads only the host step count).
    "bf16-weight-copy": ["train.precision=bf16", "train.micro_batch_size=4", "train.weight_copy=per_step",
                         "optim.implementation=fused"],
}
MEMORY_VARIANTS = {
    # Accumulation 2: the experts' and every gradient's second micro-batch goes through the host
    # accumulator's pinned ring (m6.memory.grad_stream) on the copy stream.
    "offload-optimizer": ["train.precision=bf16", "memory.offload=optimizer", "memory.host_optimizer=torch",
                          "train.micro_batch_size=4"],
    "offload-optimizer+params": ["train.precision=bf16", "memory.offload=optimizer+params",
                                 "memory.host_optimizer=torch"],
    "recompute-full": ["train.precision=bf16", "memory.activation_checkpointing=full"],
    # The delayed update from step 1: step 1's host update runs on the worker thread during step 2,
    # whose end copies its weights back on the copy stream (the worker waits for that copy before
    # it changes the masters again); the save and the run's end wait for the last one.
    "offload-optimizer-delayed": ["train.precision=bf16", "memory.offload=optimizer", "memory.host_optimizer=torch",
                                  "train.micro_batch_size=4", "optim.delayed_update=true",
                                  "optim.delayed_update_after=0"],
    # The same with the blocks streamed: their host homes apart from the masters, refreshed at each copy-back.
    "offload-optimizer+params-delayed": ["train.precision=bf16", "memory.offload=optimizer+params",
                                         "memory.host_optimizer=torch", "optim.delayed_update=true",
                                         "optim.delayed_update_after=0"],
    # ZeRO-Offload's layout: bf16 weights resident on the device, fp32 masters on the host, the
    # masters cast into pinned bf16 staging and copied back on the copy stream; accumulation 2
    # (the bf16 gradients summed into fp32 host buffers through the pinned ring).
    "offload-zero": ["train.precision=bf16", "memory.offload=zero", "memory.offload_blocks=[]",
                     "memory.host_optimizer=torch", "train.micro_batch_size=4"],
    # Blocks 0 and 2 streamed from bf16 host homes, with the delayed update from step 1.
    "offload-zero-streamed-delayed": ["train.precision=bf16", "memory.offload=zero", "memory.offload_blocks=[0,2]",
                                      "memory.host_optimizer=torch", "optim.delayed_update=true",
                                      "optim.delayed_update_after=0"],
    # Blocks 0 and 2 streamed with bf16 host gradients, accumulation 2, no delayed update: the
    # streamed gradients land in the blocks' bf16 homes (m6.memory.home_grads); the copies into and
    # out of those homes are logged with their streams (facts["home_copies"]).
    "offload-zero-streamed-home": ["train.precision=bf16", "memory.offload=zero", "memory.offload_blocks=[0,2]",
                                   "memory.host_optimizer=torch", "memory.host_grad_dtype=compute",
                                   "train.micro_batch_size=4"],
    # The delayed update with 16-bit host gradients: fp16 (each gradient's power-of-two divisor
    # written to a pinned host scalar beside its copy, a second set for the next backward) with the
    # optimizer offloaded; bf16 with ZeRO-Offload's layout resident.
    "offload-optimizer-delayed-half": ["train.precision=fp16", "memory.offload=optimizer",
                                       "memory.host_optimizer=torch", "memory.host_grad_dtype=compute",
                                       "optim.delayed_update=true", "optim.delayed_update_after=0"],
    "offload-zero-delayed-half": ["train.precision=bf16", "memory.offload=zero", "memory.offload_blocks=[]",
                                  "memory.host_optimizer=torch", "memory.host_grad_dtype=compute",
                                  "optim.delayed_update=true", "optim.delayed_update_after=0"],
}
EXPERT_PARALLEL_VARIANTS = {  # name -> (world size, overrides); a mirror world (mirror_world.py)
    "ep-world2": (2, ["train.precision=bf16", "parallel.expert_parallel_size=2"]),
    "ep-world4": (4, ["train.precision=bf16", "parallel.expert_parallel_size=4"]),
    # ZeRO-Offload partitioned (m6.memory.zero_partition): the buckets reduce-scatter on NCCL, each
    # rank's chunks go to the host and back, the weights are all-gathered; accumulation 2.
    "zero-partitioned-world2": (2, ["train.precision=bf16", "memory.offload=zero", "memory.offload_blocks=[]",
                                    "memory.host_optimizer=torch", "parallel.shard=optimizer",
                                    "parallel.expert_parallel_size=1", "train.micro_batch_size=4"]),
}


def _trainer_run(name: str, overrides: list[str], workdir: Path, resume: bool = False) -> dict:
    """Two steps; with ``resume`` a second Trainer then continues from the checkpoint for a third."""
    import m6
    cfg = _tiny_config(overrides, workdir / name)
    run_phases.reset()
    mirror_world.calls.clear()
    resumed = []
    with simulated_cuda(), RECORD.capture() as found:
        trainer = m6.Trainer(cfg)
        landing = getattr(trainer.update.offload, "home_grads", None)
        if landing is not None:  # zero's streamed gradients land in the homes: log the homes' copies
            names = {id(p): n for n, p in trainer.model.named_parameters()}
            RECORD.watched = {h.untyped_storage().data_ptr(): names[k] for k, h in landing.buffers.items()}
        try:
            history = trainer.fit()
        finally:
            RECORD.watched = {}
        home_copies = {}
        for name, what, stream in RECORD.copies:
            home_copies.setdefault(name, []).append(what if stream is None else f"{what} @{stream}")
        RECORD.copies.clear()
        if resume:
            trainer = m6.Trainer(_tiny_config([*overrides, "train.max_steps=3"], workdir / name))
            resumed = trainer.fit()
    params = list(trainer.model.parameters())
    off = trainer.update.offload
    facts = {
        "weight_dtypes": sorted({str(p.dtype) for p in params}),
        # memory.offload=zero: the staging buffers the masters are cast into (pinned: asynchronous copies).
        "staging_pinned": None if off is None or off._half_push is None
        else [b in PINNED for b in off._half_push._buffers if b is not None],
        "losses": [h["loss"] for h in history],
        "resumed_losses": [h["loss"] for h in resumed],
        "params": len(params),
        "params_on_device": sum(on_device(p) for p in params),
        "home_copies": home_copies,
        "checkpoints": sorted(p.name for p in (Path(cfg.run.dir) / "checkpoints").glob("step_*")),
        "collectives": {" ".join(k): n for k, n in mirror_world.calls.items()},
        # Where the optimizer keeps its step counts (after a resume: where the load put them).
        "step_count_devices": sorted({v.device.type for st in trainer.update.optimizer.state.values()
                                      for k, v in st.items() if k == "step" and torch.is_tensor(v)}),
    }
    return {"facts": facts, "events": dict(run_phases.events), "findings": found.to_json()}


@scenario("trainer_precision")
def trainer_precision(workdir: Path) -> dict:
    out = {name: _trainer_run(name, overrides, workdir, resume=name == "fp32")
           for name, overrides in PRECISION_VARIANTS.items()}
    # The same fp32 run on the CPU, not simulated: the simulation runs the real math on the data, so
    # its losses must be these (up to the attention kernel, see the test).
    import m6
    cfg = _tiny_config(["train.precision=fp32", "train.device=cpu"], workdir / "fp32-cpu")
    out["fp32-cpu"] = {"facts": {"losses": [h["loss"] for h in m6.Trainer(cfg).fit()]}}
    return out


@scenario("trainer_memory")
def trainer_memory(workdir: Path) -> dict:
    return {name: _trainer_run(name, overrides, workdir) for name, overrides in MEMORY_VARIANTS.items()}


@scenario("trainer_memory")
def zero_copy_back_waits(workdir: Path) -> dict:
    """memory.offload=zero's block copy-back (m6.memory.block_copy_back), synchronous update and
    delayed from step 1, three steps: before each forward of the model (segment 0: the weights
    outside the blocks) and of each block, the events the training thread made the compute stream
    wait for since the forward before, and whether each is that segment's copy-back event."""
    import m6
    from fake_cuda_api import FakeStream
    out = {}
    for name, extra in (("sync", []), ("delayed", ["optim.delayed_update=true", "optim.delayed_update_after=0"])):
        cfg = _tiny_config(["train.precision=bf16", "memory.offload=zero", "memory.offload_blocks=[]",
                            "memory.host_optimizer=torch", "train.max_steps=3", *extra], workdir / f"copy-back-{name}")
        run_phases.reset()
        waits: list[int] = []  # id() of each event the training thread's streams waited for
        forwards: list[dict] = []
        real_wait = FakeStream.wait_event

        def wait_event(stream, event, real_wait=real_wait, waits=waits):
            if threading.current_thread() is threading.main_thread():
                waits.append(id(event))
            return real_wait(stream, event)
        with simulated_cuda(), RECORD.capture() as found:
            trainer = m6.Trainer(cfg)
            copy_back = trainer.update.offload.block_copy_back

            def log(segment: int):
                def hook(module, args):
                    event = copy_back.event(segment)
                    forwards.append({"segment": segment, "waited": len(waits),
                                     "own": [w == id(event) for w in waits], "step": trainer.step})
                    waits.clear()
                return hook
            trainer.model.register_forward_pre_hook(log(0))
            for i, block in enumerate(trainer.model.blocks):
                block.register_forward_pre_hook(log(i + 1))
            FakeStream.wait_event = wait_event
            try:
                trainer.fit()
            finally:
                FakeStream.wait_event = real_wait
        out[name] = {"facts": {"forwards": forwards, "segments": copy_back.num_segments},
                     "events": dict(run_phases.events), "findings": found.to_json()}
    return out


@scenario("expert_parallel")
def expert_parallel(workdir: Path) -> dict:
    out = {}
    for name, (world, overrides) in EXPERT_PARALLEL_VARIANTS.items():
        mirror_world.install(world)
        try:
            out[name] = _trainer_run(name, overrides, workdir)
        finally:
            mirror_world.leave()
    return out


def main(group: str, report_path: str, workdir: str) -> None:
    run_phases.install()
    RECORD.phase = run_phases.current
    sim_adaptations.install()
    report = {"group": group, "scenarios": {}, "seconds": {}, "complete": False}
    for fn in GROUPS[group]:
        start = time.perf_counter()
        try:
            report["scenarios"][fn.__name__] = fn(Path(workdir))
        except Exception:  # noqa: BLE001: reported, and the test that reads it fails with the traceback
            report["scenarios"][fn.__name__] = {"crashed": traceback.format_exc()}
        report["seconds"][fn.__name__] = round(time.perf_counter() - start, 1)
    report["complete"] = True
    Path(report_path).write_text(json.dumps(report, indent=1, default=str))


def exit_without_finalizing() -> None:
    """Leave the process without the interpreter's finalization. Autograd ran backward on its
    CUDA device thread (a C++ thread that calls back into Python for every SimTensor); a device
    thread that takes the GIL while the interpreter finalizes is ended by CPython with
    pthread_exit, whose unwinding through torch's noexcept frames aborts the process ("terminate
    called without an active exception", exit -6): a CI run lost a whole group's results to it
    once, on a loaded machine. The report is the whole result, written and closed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    exit_without_finalizing()
