"""Step time of a candidate layout: compute + all-to-all + gradient sync + offload traffic + update.

compute   GPUs (not runnable here): model FLOPs of the densest micro-batch (m6.model.flops rates,
          recomputed forwards added) / (datasheet peak x an ASSUMED efficiency); the router GEMMs'
          share at the datasheet peak of their precision (model.moe.router_dtype: fp32 on an H100
          runs at 67 of 989 TFLOP/s).
          cpu: MEASURED on this host by running the rank's real modules at the planned shapes
          (forward+backward of the densest micro-batch, recompute applied, each followed by the
          update as in training), with the threads each rank gets, in as many processes at once
          as the node runs ranks (they share cores, caches and memory bandwidth as the ranks will).
all-to-all  per MoE layer and micro-batch: 4 payload exchanges (dispatch and combine, forward
          and backward) + 1 counts exchange, each latency + bytes sent to other ranks / bandwidth;
          once the group spans nodes, the rows for other nodes at the inter-node bandwidth while
          those for the node's own ranks move at the intra-node one (model.moe.a2a_dispatch
          node_aware: a token's row crosses to each remote node once, then is forwarded inside
          it, the two stages in turn; expert_exchange_s). GPUs, with
          model.moe.a2a_overlap_degree d > 1: the rows go in d chunks, one chunk's exchange
          running while the experts compute another (forward: dispatch and combine around the
          expert forward; backward: the same around the expert backward, 2x its FLOPs), so a pass
          with exchange time C and expert time E takes max(C, E) + min(C, E) / d (d = 1: C + E,
          many chunks: the longer of the two) and each of its exchanges pays d latencies; what
          exceeds E is the exposed all-to-all, the rest is reported as hidden. ASSUMED: the
          expert compute at the model's efficiency and the exchanges at full link rate while they
          overlap. CPU: not modelled (gloo's copies and the experts share the cores; the measured
          gain was 0.87x at degree 2, bench/results/a2a_overlap-pooled.md), degree 1.
grad sync ring all-reduce, 2 (n-1)/n x bytes / bandwidth per group (memory.offload=zero with
          parallel.shard=optimizer: a reduce-scatter, (n-1)/n; m6.plan.zero_partition_step); the
          inter-node bandwidth once the data-parallel world spans nodes (data_parallel_s). GPUs: m6 launches each bucket
          as its gradients are final during the last micro-batch's backward (m6.parallel.grad_sync),
          so only what exceeds that backward (2/3 of the micro-batch's compute), or at least the
          last bucket's all-reduce, is exposed; ASSUMED: NCCL's transfers do not slow the backward.
          CPU: not overlapped (gloo reduces on the cores the backward uses; the 14/14 validation,
          bench/results/plan_validation-cpu-2core.md, holds with it so).
small collectives  the step's scalar all-reduces, one latency each (world > 1): target-token count,
          routing statistics per MoE layer and micro-batch (aux_loss_scope global; local: one
          aux-loss sum per step), the gradient sync's reach check, loss and metric sums, the expert
          gradient norm (EP > 1) and the stop-signal flag, as m6.train.loop issues them.
inter-node link shared  GPUs: the transfers hidden in one window that cross nodes share the
          rank's one inter-node link (m6.plan.link_floor): the last backward lasts at least its
          gradient sync (world across nodes) + its all-to-alls' inter-node part, the partitioned
          zero's next forward at least its all-gathers + its all-to-alls'; the excess is added.
offload   host<->device bytes / the PCIe figure, counted where the step waits for them (sharded:
          FSDP2's CPU offload copies each unit's shards in at every gather and the gradient shards
          out once, beside compute; nothing is copied back after the host update); unsharded: the
          gradients streamed out (the unshared ones in every micro-batch) and the streamed blocks'
          weights (memory.offload_blocks: those listed; fetched twice per micro-batch, the next
          block prefetched while one computes)
          overlap the forward and backward, so only what exceeds the compute time shows; the
          weights copied back overlap the update group by group (optim.apply_groups), so the last
          group's copy, or what exceeds the update, shows.
update    cpu: MEASURED on the rank's real parameters between the profiled steps. GPUs: on the
          device, 28 B per parameter over the memory bandwidth; offloaded, the host update from a
          per-core rate MEASURED on this host with one thread (m6's gradient clipping + the
          optimizer the run will choose, m6.plan.host_update: torch's foreach AdamW, DeepSpeed's
          CPU Adam, torch's foreach Adafactor or m6's C++ Adafactor, its op probed and built as
          the run does; a per-tensor and a per-element cost, for the rank's tensor count), divided
          by the host cores each GPU gets (``--host-cores-per-gpu``; ASSUMED to scale linearly).
"""

from __future__ import annotations

import os
import queue
from contextlib import nullcontext
import statistics
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from m6.batch_format import IGNORE_INDEX, SEG_SOURCE, SEG_TARGET
from m6.config import Config, accumulation_steps, micro_batch_size, num_patches
from m6.memory.estimate import activation_report, recomputed_parts
from m6.memory.recompute import RecomputeParts
from m6.memory.shard_estimate import data_parallel_traffic, shard_layout
from m6.model.cast_on_use import set_cast_on_use
from m6.model.flops import TokenCounts, forward_flop_rates, step_flops
from m6.model.param_groups import no_decay_ids
from m6.moe.router import router_gemm_precision
from m6.moe.chunked_all_to_all import auto_overlap_degree
from m6.parallel.fsdp import clip_sharded_grad_norm, shard_units
from m6.parallel.sharded_adafactor import ShardedAdafactor
from m6.parallel.grad_sync import clip_coefficient, clip_grad_norm, global_grad_norm
from m6.moe.loopback import LoopbackDispatcher
from m6.plan.host_update import HOST_UPDATE_NAMES, probe_optimizer, resolve_host_update
from m6.plan.link_floor import LinkWindow, link_window
from m6.plan.memory import rank_model
from m6.plan.offload_layouts import ZERO, Copy, offload_step, streamed_blocks
from m6.plan.zero_partition_step import partitioned_offload_step
from m6.memory.zero_partition_estimate import partitioned


@dataclass(frozen=True)
class Hardware:
    """One accelerator kind; figures marked in ``assumed`` are not measured here."""

    name: str
    peak_tflops: Optional[float]  # datasheet, at the compute dtype; None: compute is measured (cpu)
    compute_efficiency: float  # fraction of peak a step's matmuls reach (ASSUMED)
    memory_gib: float
    intra_node_GBps: float  # per-GPU all-to-all / all-reduce bandwidth inside a node
    inter_node_GBps: float  # per-GPU bandwidth between nodes
    pcie_GBps: float  # host <-> device copies
    latency_s: float  # per collective
    memory_GBps: float  # device memory bandwidth (the on-device update streams 28 B per param)
    precision: str  # the train.precision m6 runs on it
    assumed: tuple[str, ...] = field(default_factory=tuple)
    # Datasheet matmul peaks by precision (dense), for work that does not run at ``precision``
    # (the router GEMM); a precision missing here runs at the fp32 rate (no unit for it).
    matmul_tflops: tuple[tuple[str, float], ...] = ()
    # Time per byte of an all-gather or reduce-scatter against a ring's ((n-1)/n of the gathered or
    # reduced bytes over the bandwidth): 1 for NCCL's rings; gloo's on a CPU host cost about an
    # all-reduce of the same tensor, 2 (bench.plan_measure's probe measures it).
    gather_scatter_cost: float = 1.0

    def matmul_peak(self, precision: str) -> float:
        """TFLOP/s of a matmul at ``precision`` (tf32/bf16 without their unit: the fp32 rate)."""
        peaks = dict(self.matmul_tflops)
        return peaks.get(precision, peaks.get("fp32", self.peak_tflops))


# Datasheet peaks (dense): H100 SXM bf16 989.4 TFLOP/s, 3.35 TB/s HBM3, NVLink 900 GB/s (450 per
# direction); V100 SXM2 fp16 tensor cores 125 TFLOP/s (no bf16 unit: m6 runs it in fp16 with loss
# scaling), fp32 15.7, 900 GB/s HBM2, NVLink 300 GB/s (150 per direction). Efficiencies and
# network figures are assumptions.
GPUS = {
    "h100": Hardware("H100 SXM 80GB", 989.4, 0.40, 80.0, 300.0, 50.0, 50.0, 20e-6, 3350.0, "bf16",
                     ("compute efficiency 0.40 of 989.4 TFLOP/s", "NVLink 300 GB/s effective per GPU",
                      "inter-node 50 GB/s per GPU (400 Gb/s IB)", "PCIe5 50 GB/s", "collective latency 20 us"),
                     (("bf16", 989.4), ("tf32", 494.7), ("fp32", 67.0))),
    "v100": Hardware("V100 SXM2 32GB", 125.0, 0.40, 32.0, 100.0, 12.5, 12.0, 30e-6, 900.0, "fp16",
                     ("compute efficiency 0.40 of 125 TFLOP/s fp16 tensor cores (train.precision fp16; V100 has "
                      "no bf16)", "NVLink 100 GB/s effective per GPU", "inter-node 12.5 GB/s per GPU (100 Gb/s RDMA)",
                      "PCIe3 12 GB/s", "collective latency 30 us"),
                     (("fp16", 125.0), ("fp32", 15.7))),
}


GLOO_GATHER_SCATTER_COST = 2.0  # gloo's all-gather / reduce-scatter vs a ring's bytes (Hardware.gather_scatter_cost)


def cpu_hardware(memory_gib: float, intra_GBps: float, latency_s: float,
                 gather_scatter_cost: float = GLOO_GATHER_SCATTER_COST) -> Hardware:
    """This host as the device: compute and the update are measured; network figures given."""
    return Hardware("cpu (this host)", None, 1.0, memory_gib, intra_GBps, intra_GBps, 0.0, latency_s, 0.0, "fp32",
                    gather_scatter_cost=gather_scatter_cost)


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step, by component."""

    compute: float
    all_to_all: float
    grad_sync: float
    offload: float
    update: float
    model_flops: float  # of the whole job's step (active parameters: MFU's numerator)
    small_collectives: float = 0.0
    all_to_all_hidden: float = 0.0  # behind the expert compute (model.moe.a2a_overlap_degree > 1)
    grad_sync_hidden: float = 0.0  # behind the last micro-batch's backward (GPUs)
    offload_hidden: float = 0.0  # host<->device copies beside compute or the host update
    update_hidden: float = 0.0  # host update behind the next step's forward/backward (optim.delayed_update)
    copies: tuple[Copy, ...] = ()  # the offloaded layout's copies, each with its exposed seconds
    # optim.delayed_update: the step of the first delayed_update_after steps, which update synchronously
    synchronous_total: Optional[float] = None
    tensor_parallel: float = 0.0  # the split regions' collectives (m6.plan.tensor_parallel)
    pipeline_bubble: float = 0.0  # a pipeline rank's idle time (m6.plan.pipeline)
    pipeline_p2p: float = 0.0  # stage-boundary sends on its critical path
    # What the windows' inter-node transfers add beyond the windows (m6.plan.link_floor), and the windows
    link_shared: float = 0.0
    link_windows: tuple[LinkWindow, ...] = ()

    @property
    def total(self) -> float:
        return (self.compute + self.all_to_all + self.grad_sync + self.small_collectives + self.offload + self.update
                + self.tensor_parallel + self.pipeline_bubble + self.pipeline_p2p + self.link_shared)


def densest_counts(cfg: Config, micro_batch: int) -> TokenCounts:
    """What the densest micro-batch asks of the model (the memory model's batch)."""
    P, L = num_patches(cfg.model), cfg.data.seq_len
    S = P + L
    return TokenCounts(positions=micro_batch * S, image_patches=micro_batch * P, targets=micro_batch * (L - 1),
                       attention_pairs=micro_batch * S * S)


def _profile_model(cfg: Config, world_size: int, ep: int, recompute: frozenset,
                   sync: Optional[Callable[[], None]] = None, fsdp_units: bool = False) -> nn.Module:
    """The rank's model, materialised on the CPU, recompute applied; under expert parallelism
    its experts only, with the exchange skipped (LoopbackDispatcher) and its local work kept.
    ``sync`` (ranks profiled together): called wherever the run's ranks wait for each other
    inside forward and backward (the all-to-alls; each MoE layer's routing statistics).
    ``fsdp_units`` (parallel.shard, in a process that joined its one-rank group): wrapped in the
    run's FSDP2 units (``_shard_for_profile``)."""
    model = rank_model(cfg, world_size, ep)
    model.materialize(torch.device("cpu"), cfg.run.seed)
    if sync is not None and cfg.model.moe.aux_loss_scope == "global":
        def routing_statistics(*_) -> None:  # their all-reduce (a hook returning None keeps the inputs)
            sync()
        for layer in model.moe_layers().values():
            layer.register_forward_pre_hook(routing_statistics)
    if ep > 1:
        wire = torch.bfloat16 if cfg.model.moe.a2a_dtype == "bf16" else None
        for layer in model.moe_layers().values():
            layer.dispatcher = LoopbackDispatcher(cfg.model.moe.num_experts, ep, wire, sync)
    if sync is not None and cfg.parallel.shard != "none":
        _wait_at_shard_units(model, sync)
    if fsdp_units:
        _shard_for_profile(model, cfg.parallel.shard)
    if recompute:
        RecomputeParts(model).apply(sorted(recompute))
    return model


def _join_private_group(folder: str) -> None:
    """A one-rank gloo process group of this profiling process's own (a file store in ``folder``):
    what FSDP2 needs to wrap the profiled model (``_shard_for_profile``)."""
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, f"store-{os.getpid()}"), 1),
                            rank=0, world_size=1)


def _shard_for_profile(model: nn.Module, mode: str) -> None:
    """parallel.shard: wrap the profiled rank in the run's FSDP2 units (m6.parallel.fsdp.shard_units)
    over a one-rank mesh, so its timed forward+backward and update include FSDP2's own host work:
    the hooks around every unit, the copies into and out of the gather and reduce-scatter buffers,
    the DTensor update. At one rank each gather and reduce-scatter copies whole units (at N ranks
    the gather's input and the reduce-scatter's output are 1/N): a little more copying than the
    run's; the bytes on the wire stay the sync term's."""
    mesh = init_device_mesh("cpu", (1,))
    experts = {id(p) for layer in model.moe_layers().values() for p in layer.experts.parameters()}
    shard_units(model, experts, mesh, mesh, reshard=mode == "full")


def _wait_at_shard_units(model: nn.Module, sync: Callable[[], None]) -> None:
    """parallel.shard: FSDP2 all-gathers each unit's parameters before its forward and, as its
    backward begins, gathers them again (full) and reduce-scatters the unit backward finished
    last: each is a point where the ranks wait for each other. The profiled rank waits there too:
    before each block's and each MoE layer's experts' forward, and when the gradient of their
    output arrives (the root's are the step's start and end, already waits)."""
    def before_backward(grad: torch.Tensor) -> None:
        sync()

    def in_backward() -> bool:  # a recompute's forward inside backward: gathered already, no new waits
        return torch._C._current_graph_task_id() != -1

    def before_forward(*_) -> None:
        if not in_backward():
            sync()

    def after_forward(_module, _args, output) -> None:
        out = next((t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad), None)
        if out is not None and not in_backward():
            out.register_hook(before_backward)

    units = [*model.blocks, *(layer.experts for layer in model.moe_layers().values())]
    for unit in units:
        unit.register_forward_pre_hook(before_forward)
        unit.register_forward_hook(after_forward)


def _densest_inputs(cfg: Config, micro_batch: int) -> tuple[torch.Tensor, ...]:
    """(images, has_image, text ids, segments, labels) of the densest micro-batch."""
    m, L = cfg.model, cfg.data.seq_len
    images = torch.randn(micro_batch, m.image_channels, m.image_size, m.image_size)
    ids = torch.randint(0, min(m.vocab_size, 256), (micro_batch, L))
    seg = torch.full((micro_batch, L), SEG_TARGET)
    seg[:, 0] = SEG_SOURCE
    labels = torch.full((micro_batch, L), IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    return images, torch.ones(micro_batch, dtype=torch.bool), ids, seg, labels


@dataclass(frozen=True)
class ProfiledStep:
    """How the profiled rank computes and updates, from the run's config: the forward's 16-bit dtype
    (None: fp32) and whether it casts on use (else autocast), the optimizer, and whether the host
    gradients are 16-bit buffers read back in fp32 by the update (memory.host_grad_dtype=compute)."""

    dtype: Optional[torch.dtype] = None
    cast_on_use: bool = False
    optimizer: str = "adamw"
    half_grads: bool = False

    @staticmethod
    def of(cfg: Config) -> "ProfiledStep":
        precision = cfg.train.precision  # on a CPU host: auto is fp32
        dtype = torch.float16 if precision == "fp16" else \
            torch.bfloat16 if precision in ("bf16", "bf16-autocast") else None
        return ProfiledStep(dtype, dtype is not None and precision != "bf16-autocast", cfg.optim.name,
                            dtype is not None and cfg.memory.offload != "none" and cfg.memory.host_grad_dtype == "compute")


def _clip_from_half_grads(params: list[torch.Tensor], halves: list[torch.Tensor]) -> None:
    """The host clip over 16-bit gradients as the run makes it (memory.host_grad_dtype=compute):
    the norm from the 16-bit buffers, each read back into fp32 ``.grad`` times the coefficient."""
    coef = clip_coefficient(global_grad_norm(halves, []), 1.0)
    for p, h in zip(params, halves):
        p.grad = h.to(torch.float32).mul_(coef)


def _time_rank_steps(model: nn.Module, inputs: tuple[torch.Tensor, ...], runs: Optional[int],
                     sync: Optional[Callable[[], None]] = None,
                     how: ProfiledStep = ProfiledStep()) -> tuple[float, float]:
    """Median seconds of (forward+backward, update) of the rank's steps after one warm-up: ``runs``
    timed steps, or (None) at least 5 and up to 0.5 s of them (a burst of another process's work
    on a shared host can stretch a few runs several-fold).

    Each step runs as training does: forward+backward, then m6's global-norm clip and torch's
    foreach AdamW over the two groups m6's optimizer uses (decayed matrices, the rest), then the
    gradients dropped. On a CPU the update streams every weight, gradient and moment through the
    caches, so the next forward starts cold, as in the run; timed back to back without it, the
    forward+backward came out 10-35% faster than the trainer's.

    ``how``: the run's precision (cast-on-use or autocast in 16 bits), optimizer (AdamW or
    Adafactor) and, with 16-bit host gradients, their cast after backward and fp32 read-back
    before the update."""
    assert sync is None or runs is not None, "ranks in lockstep must time the same number of steps"
    images, has, ids, seg, labels = inputs
    params = [p for p in model.parameters() if p.requires_grad]
    sharded = any(isinstance(p, DTensor) for p in params)
    skip = no_decay_ids(model)
    groups = [{"params": [p for p in params if id(p) not in skip], "weight_decay": 0.1},
              {"params": [p for p in params if id(p) in skip], "weight_decay": 0.0}]
    if how.optimizer == "adafactor":  # parallel.shard: the run's exact form over FSDP2's shards
        optimizer = ShardedAdafactor(groups, lr=1e-6) if sharded else \
            torch.optim.Adafactor(groups, lr=1e-6, foreach=True)
    else:
        optimizer = torch.optim.AdamW(groups, lr=1e-6, foreach=True)
    set_cast_on_use(model, how.cast_on_use)
    autocast = (lambda: torch.autocast("cpu", dtype=how.dtype, cache_enabled=not how.cast_on_use)) \
        if how.dtype is not None else nullcontext
    compute: list[float] = []
    update: list[float] = []
    while (len(compute) < 6 or (sum(compute[1:]) < 0.5 and len(compute) < 40)) if runs is None \
            else len(compute) < runs + 1:
        if sync is not None:
            sync()  # the step's first collective (its target count): nobody starts while another updates
        t0 = time.perf_counter()
        with autocast():
            hidden, aux = model(images, has, ids, seg)
            loss = model.target_loss_sum(hidden, labels) + aux
        loss.backward()
        if how.half_grads:  # streamed out in the compute dtype as backward makes them
            halves = [p.grad.to(how.dtype) for p in params if p.grad is not None]
        if sync is not None:
            sync()  # the gradient sync and the step's scalar all-reduces: every rank done with backward
        t1 = time.perf_counter()
        if sharded:
            clip_sharded_grad_norm(params, 1.0, None, torch.device("cpu"))
        elif how.half_grads:
            _clip_from_half_grads([p for p in params if p.grad is not None], halves)
        else:
            clip_grad_norm(params, [], 1.0)
        optimizer.step()
        update.append(time.perf_counter() - t1)
        compute.append(t1 - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(compute[1:]), statistics.median(update[1:])


def _concurrent_rank(cfg: Config, world_size: int, ep: int, micro_batch: int, recompute: frozenset, threads: int,
                     runs: int, barrier, results) -> None:
    """One of the processes that profile the ranks of a node together (spawned by HostProfile).

    When the node's processes are all the job's ranks (``world_size`` of them), they also wait
    for each other wherever the run's collectives make ranks wait: a rank slowed by a neighbour
    holds the others up, as in the run. Only the waiting is kept: the data moved is the
    all-to-all and sync terms' business (bytes / bandwidth)."""
    torch.set_num_threads(threads)
    sync = barrier.wait if world_size > 1 and barrier.parties == world_size else None
    with tempfile.TemporaryDirectory(prefix="m6-plan-profile-") as folder:
        sharded = cfg.parallel.shard != "none"
        if sharded:
            _join_private_group(folder)
        model = _profile_model(cfg, world_size, ep, recompute, sync, fsdp_units=sharded)
        inputs = _densest_inputs(cfg, micro_batch)
        barrier.wait()  # every rank's process times at once, as the ranks of a run compute at once
        results.put(_time_rank_steps(model, inputs, runs, sync, ProfiledStep.of(cfg)))
        if sharded:
            dist.destroy_process_group()


def _collect(procs: list, results, timeout_s: float) -> list:
    """One result from each profiling process; a process that dies first (an error in the
    profiled model) ends the wait with an error instead of leaving the others at their barrier."""
    out, deadline = [], time.monotonic() + timeout_s
    try:
        while len(out) < len(procs):
            try:
                out.append(results.get(timeout=1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"exit code {dead[0].exitcode}" if dead else f"no result in {timeout_s:.0f} s"
                    raise RuntimeError(f"a process profiling the node's ranks failed ({why}); its error is above")
    finally:
        for p in procs:
            if p.is_alive() and len(out) < len(procs):
                p.terminate()
            p.join()
    return out


class HostProfile:
    """Timings measured on this host: the rank's forward+backward at a shape, and clip + AdamW.

    ``concurrent`` > 1 (the ranks a node runs, more than one): the forward+backward is timed in
    that many processes at once, each with ``threads`` threads, so the figure holds what the
    ranks really get of the host: shared cores, memory bandwidth and caches; when they are the
    whole job, in the run's lockstep too (they wait for each other where its collectives do)."""

    CONCURRENT_RUNS = 8

    def __init__(self, threads: int, concurrent: int = 1, host_cores_per_gpu: Optional[int] = None) -> None:
        """``host_cores_per_gpu``: the offloaded update of a GPU rank runs on that many cores of
        its server, timed here per core (one thread) and divided by it; None: timed with ``threads``."""
        self.threads, self.concurrent, self.host_cores_per_gpu = threads, concurrent, host_cores_per_gpu
        self._cache: dict[tuple, tuple[float, float]] = {}  # shape -> (forward+backward, update) seconds
        self._step_costs: dict[tuple, tuple[float, float]] = {}  # (optimizer, host, ...) -> (per tensor, per element)
        self._host_updates: dict[tuple[str, str], str] = {}  # (optim.name, memory.host_optimizer) -> resolved
        self.notes: list[str] = []  # what resolving the host optimizer said (a fallback, a build)

    def forward_backward_s(self, cfg: Config, world_size: int, ep: int, micro_batch: int,
                           recompute: frozenset) -> float:
        """Seconds of one forward+backward of the rank's real modules on a densest micro-batch
        (the median over the concurrent processes of each one's median)."""
        return self._profile(cfg, world_size, ep, micro_batch, recompute)[0]

    def update_s(self, cfg: Config, world_size: int, ep: int, micro_batch: int, recompute: frozenset) -> float:
        """Seconds of the rank's clip + AdamW update, timed on its real parameters between the
        profiled steps (``forward_backward_s``'s runs)."""
        return self._profile(cfg, world_size, ep, micro_batch, recompute)[1]

    def _profile(self, cfg: Config, world_size: int, ep: int, micro_batch: int,
                 recompute: frozenset) -> tuple[float, float]:
        # Sharded: FSDP2's units around the profiled model, waits at each in lockstep (_shard_for_profile,
        # _wait_at_shard_units); profiled in processes of their own (each its own one-rank group).
        key = (world_size, ep, micro_batch, recompute, cfg.model.moe.a2a_dtype, cfg.parallel.shard, ProfiledStep.of(cfg))
        if key in self._cache:
            return self._cache[key]
        if self.concurrent > 1 or cfg.parallel.shard != "none":
            ctx = mp.get_context("spawn")
            barrier, results = ctx.Barrier(self.concurrent), ctx.Queue()
            runs = self.CONCURRENT_RUNS if self.concurrent > 1 else None
            procs = [ctx.Process(target=_concurrent_rank, args=(cfg, world_size, ep, micro_batch, recompute,
                                                                self.threads, runs, barrier, results))
                     for _ in range(self.concurrent)]
            for proc in procs:
                proc.start()
            times = _collect(procs, results, timeout_s=600.0)
            self._cache[key] = (statistics.median(t[0] for t in times), statistics.median(t[1] for t in times))
            return self._cache[key]
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            self._cache[key] = _time_rank_steps(_profile_model(cfg, world_size, ep, recompute),
                                                _densest_inputs(cfg, micro_batch), None, how=ProfiledStep.of(cfg))
        finally:
            torch.set_num_threads(previous)
        return self._cache[key]

    def host_update_of(self, cfg: Config) -> str:
        """The host optimizer ("torch", "deepspeed", "cpp") the run of ``cfg`` will choose on this
        host (m6.plan.host_update), resolved once per (optim.name, memory.host_optimizer)."""
        key = (cfg.optim.name, cfg.memory.host_optimizer)
        if key not in self._host_updates:
            self._host_updates[key] = resolve_host_update(cfg, self.notes.append)
        return self._host_updates[key]

    def host_rates(self) -> dict[str, float]:
        """What the offloaded update was timed on so far: its name -> ns per parameter on one core
        (the per-element cost of the probe)."""
        return {HOST_UPDATE_NAMES[(k[0], k[1])] + (" (16-bit gradients in, 16-bit weights out: zero)" if len(k) > 3
                                                   else " (16-bit host gradients)" if k[2] else ""): v[1] * 1e9
                for k, v in self._step_costs.items()}

    def host_step_s(self, num_tensors: int, numel: int, optimizer: str = "adamw", half_grads: bool = False,
                    host: str = "torch", half_weights: bool = False) -> float:
        """Seconds of the host's clip + foreach ``optimizer`` step over ``num_tensors`` tensors
        holding ``numel`` elements: a per-element and a per-tensor cost, fitted to two measured
        shapes (8 tensors of 512K elements; 512 of 1K), since a real model's many small tensors
        (norms, biases) cost far more per element than one large buffer. With
        ``host_cores_per_gpu``: timed on one thread, divided by the cores. ``half_grads``: the
        gradients are 16-bit host buffers (memory.host_grad_dtype=compute), their norm taken from
        them and each read back in fp32 before the step. ``host``: which implementation runs
        ``optimizer`` (host_update_of: torch's, DeepSpeed's CPU Adam, m6's C++ Adafactor).
        ``half_weights`` (memory.offload=zero): each updated fp32 master is also copied out into
        its 16-bit staging buffer (what goes back to the device)."""
        key = (optimizer, host, half_grads) + ((True,) if half_weights else ())
        if key not in self._step_costs:
            previous = torch.get_num_threads()
            torch.set_num_threads(1 if self.host_cores_per_gpu else self.threads)
            try:
                big = self._time_host_update(8, 2**19, optimizer, half_grads, host, half_weights)
                small = self._time_host_update(512, 2**10, optimizer, half_grads, host, half_weights)
            finally:
                torch.set_num_threads(previous)
            # big = 8 a + 8*2^19 b ; small = 512 a + 512*2^10 b
            n1, e1, n2, e2 = 8, 8 * 2**19, 512, 512 * 2**10
            per_elem = max((big * n2 - small * n1) / (e1 * n2 - e2 * n1), 0.0)
            per_tensor = max((small - e2 * per_elem) / n2, 0.0)
            self._step_costs[key] = (per_tensor, per_elem)
        per_tensor, per_elem = self._step_costs[key]
        return (num_tensors * per_tensor + numel * per_elem) / (self.host_cores_per_gpu or 1)

    @staticmethod
    def _time_host_update(num_tensors: int, size: int, optimizer: str = "adamw", half_grads: bool = False,
                          host: str = "torch", half_weights: bool = False) -> float:
        """Median of 3 (after one warm-up) host steps as the run makes them: m6's own gradient
        clipping (a norm per tensor) and a foreach AdamW (or Adafactor) step. Adafactor's state is
        factored per matrix: the tensors are timed as 512-row matrices. ``half_grads``: the norm
        from bf16 buffers, each read back in fp32 (times the clip) before the step. ``half_weights``:
        each master then copied into a bf16 buffer (the zero layout's weights going back).

        Timed in the process's CPU seconds, not wall time: the probe runs on one thread (the
        per-core rate), and on a shared planning host the wall clock also counts the time the
        thread waits for a core (under a load of 13 on 2 cores, 1.4-4x its CPU time); the
        CPU time keeps what the cores do, memory stalls included."""
        shape = (512, size // 512) if optimizer == "adafactor" and size >= 512 * 2 else (size,)
        params = [torch.zeros(shape, requires_grad=True) for _ in range(num_tensors)]
        halves = [torch.randn(shape).to(torch.bfloat16) for _ in params] if half_grads else []
        staged = [torch.empty(shape, dtype=torch.bfloat16) for _ in params] if half_weights else []
        for p in params:
            p.grad = torch.randn_like(p)
        opt = probe_optimizer(params, optimizer, host)
        times = []
        for _ in range(4):
            t0 = time.process_time()
            if half_grads:
                _clip_from_half_grads(params, halves)
            else:
                clip_grad_norm(params, [], 1.0)
            opt.step()
            for w, p in zip(staged, params):
                w.copy_(p.detach())
            times.append(time.process_time() - t0)
        return statistics.median(times[1:])


def _exchange_s(nbytes: float, hw: Hardware, group: int, gpus_per_node: int) -> float:
    """One collective moving ``nbytes`` per rank over a group of ``group`` ranks."""
    bw = hw.intra_node_GBps if group <= gpus_per_node else hw.inter_node_GBps
    return hw.latency_s + nbytes / (bw * 1e9)


def data_parallel_s(nbytes: float, hw: Hardware, world_size: int, gpus_per_node: int) -> float:
    """One collective moving ``nbytes`` per rank over a data-parallel group of a ``world_size``-rank
    data-parallel world: the dense parameters' (the world) or an expert-data-parallel group (a
    column of m6.parallel.layout's EP-first mesh: ranks r, r + EP, r + 2 EP, ...). Either stays
    inside a node only when the whole world does; otherwise its ring crosses nodes, and the
    inter-node link paces it (an EDP group has fewer ranks than a node yet one per EP group: at
    EP >= ranks per node, every member on another node)."""
    bw = hw.intra_node_GBps if world_size <= gpus_per_node else hw.inter_node_GBps
    return hw.latency_s + nbytes / (bw * 1e9)


@dataclass(frozen=True)
class ModelFacts:
    """What step_time reads off a rank's (meta) model, the same for every setting the search times
    on it: FLOP rates, replicated and expert parameter counts, trainable tensors, no-decay ids,
    each block's parameter count."""

    rates: object
    numel_rep: int
    numel_exp: int
    num_trainable: int
    no_decay: frozenset
    block_numels: tuple


_FACTS: "weakref.WeakKeyDictionary[nn.Module, ModelFacts]" = weakref.WeakKeyDictionary()
_SHARD_LAYOUTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def model_facts(model: nn.Module) -> ModelFacts:
    """``model``'s facts, computed once per model object (the search times up to a few thousand
    settings on the same rank models; walking their parameters each time dominated it)."""
    if model not in _FACTS:
        named = list(model.named_parameters())
        _FACTS[model] = ModelFacts(
            forward_flop_rates(model), sum(p.numel() for n, p in named if ".experts." not in n),
            sum(p.numel() for n, p in named if ".experts." in n), sum(1 for _, p in named if p.requires_grad),
            frozenset(no_decay_ids(model)),
            tuple(sum(p.numel() for p in block.parameters()) for block in getattr(model, "blocks", ())))
    return _FACTS[model]


def nodes_per_token(top_k: int, nodes: int, max_nodes_per_token: int) -> float:
    """Expected nodes a token's ``top_k`` experts lie on, experts chosen uniformly (ASSUMED: real
    routing is skewed) over ``nodes`` nodes, or over its ``max_nodes_per_token`` best (node-limited
    routing): n (1 - (1 - 1/n)^k) for n nodes in reach."""
    reach = min(max_nodes_per_token, nodes) if max_nodes_per_token else nodes
    return reach * (1 - (1 - 1 / reach) ** top_k)


def expert_exchange_s(cfg: Config, positions: int, wire_bytes: int, ep: int, gpus_per_node: int,
                      hw: Hardware) -> float:
    """One of a MoE layer's four payload exchanges (dispatch, combine; each again in backward) for
    ``positions`` tokens of a rank, over an expert-parallel group of ``ep`` ranks, G = min(ep,
    gpus_per_node) of them per node, B = ep / G nodes.

    flat: each of a token's K assignments is one row to its expert's rank; the rows for other
    nodes ((ep - G) / ep of them) take the inter-node link while those for the node's other ranks
    ((G - 1) / ep) take the intra-node one at the same time: the slower of the two.
    node_aware (m6.moe.node_aware_all_to_all): one row per (token, remote node) crosses the
    inter-node link (nodes_per_token x (B - 1) / B rows per token, plus each remote assignment's
    weight and row index: 12 bytes over the four exchanges), then the relay forwards the K
    assignments inside the node ((G - 1) / G of them leave the relay): the two stages one after
    the other, a latency each."""
    moe = cfg.model.moe
    K, row = moe.top_k * moe.num_prototypes, cfg.model.d_model * wire_bytes
    G = min(ep, gpus_per_node)
    if ep // G == 1:
        return _exchange_s(positions * K * row * (ep - 1) / ep, hw, ep, gpus_per_node)
    inter, intra = _exchange_bytes(cfg, positions, wire_bytes, ep, gpus_per_node)
    if moe.a2a_dispatch == "node_aware":
        return 2 * hw.latency_s + inter / (hw.inter_node_GBps * 1e9) + intra / (hw.intra_node_GBps * 1e9)
    return hw.latency_s + max(inter / (hw.inter_node_GBps * 1e9), intra / (hw.intra_node_GBps * 1e9))


def _exchange_bytes(cfg: Config, positions: int, wire_bytes: int, ep: int, gpus_per_node: int) -> tuple[float, float]:
    """(inter-node, intra-node) bytes a rank sends in one exchange of expert_exchange_s."""
    moe = cfg.model.moe
    K, row = moe.top_k * moe.num_prototypes, cfg.model.d_model * wire_bytes
    G = min(ep, gpus_per_node)
    B = ep // G
    if B == 1:
        return 0.0, positions * K * row * (ep - 1) / ep
    if moe.a2a_dispatch == "node_aware":
        remote_rows = positions * nodes_per_token(K, B, moe.max_nodes_per_token or 0) * (B - 1) / B
        return remote_rows * row + positions * K * (B - 1) / B * 12 / 4, positions * K * (G - 1) / G * row
    return positions * K * row * (ep - G) / ep, positions * K * row * (G - 1) / ep


def expert_exchange_inter_s(cfg: Config, positions: int, wire_bytes: int, ep: int, gpus_per_node: int,
                            hw: Hardware) -> float:
    """The seconds one exchange of expert_exchange_s holds the inter-node link (0 when the expert
    group stays inside a node): its inter-node bytes at the inter-node bandwidth."""
    return _exchange_bytes(cfg, positions, wire_bytes, ep, gpus_per_node)[0] / (hw.inter_node_GBps * 1e9)


def _shard_layout_of(cfg: Config, model: nn.Module, world_size: int, ep: int):
    """m6.memory.shard_estimate.shard_layout, once per model and degrees (it reads only the model,
    the degrees and optim.apply_groups off cfg)."""
    layouts = _SHARD_LAYOUTS.setdefault(model, {})
    key = (world_size, ep, cfg.optim.apply_groups)
    if key not in layouts:
        layouts[key] = shard_layout(cfg, model, model_facts(model).no_decay, world_size, ep)
    return layouts[key]


def sharded_sync_s(cfg: Config, model: nn.Module, world_size: int, ep: int, gpus_per_node: int, hw: Hardware) -> float:
    """parallel.shard: each FSDP2 unit's all-gathers and reduce-scatter (a ring moves (n-1)/n of
    the gathered or reduced bytes per rank; x ``hw.gather_scatter_cost``), one latency per unit and
    collective, none overlapped with compute (an upper bound: FSDP2 prefetches the next unit's gather)."""
    device = "cpu" if hw.peak_tflops is None else "cuda"
    # shard_layout reads only the model, the degrees and optim.apply_groups off cfg: one per model and those.
    layout = _shard_layout_of(cfg, model, world_size, ep)
    traffic = data_parallel_traffic(cfg, layout, world_size, ep, device)
    edp = world_size // ep
    dense_share = layout.dense_numel * (world_size > 1)
    expert_share = layout.expert_numel * (edp > 1)
    total = max(dense_share + expert_share, 1)
    seconds = 0.0
    for share, n in ((dense_share, world_size), (expert_share, edp)):
        if n > 1 and share:
            moved = (traffic["all-gather"] + traffic["reduce-scatter"]) * share / total * hw.gather_scatter_cost
            seconds += (n - 1) / n * (data_parallel_s(moved, hw, world_size, gpus_per_node) - hw.latency_s)
    passes = 3 if cfg.parallel.shard == "full" else 2  # gathers (forward, backward for full) + reduce-scatter
    return seconds + hw.latency_s * passes * (len(layout.unit_numel) + 1)


def step_time(cfg: Config, world_size: int, ep: int, gpus_per_node: int, hw: Hardware,
              host: HostProfile, cores: int = 0, model=None) -> StepTime:
    """Predicted time of one step of ``cfg`` at this layout on ``hw`` (see the module docstring);
    ``model``: the rank's meta model when the caller has it (m6.plan.memory.rank_model)."""
    mb, accum = micro_batch_size(cfg.train, world_size), accumulation_steps(cfg.train, world_size)
    model = model if model is not None else rank_model(cfg, world_size, ep)
    facts = model_facts(model)
    rates = facts.rates
    moe_layers = len(model.moe_layers())
    K = cfg.model.moe.top_k * cfg.model.moe.num_prototypes
    counts = densest_counts(cfg, mb)
    kept = counts.positions * K * moe_layers
    flops_mb = step_flops(rates, counts, kept)
    acts = activation_report(cfg, world_size, ep, "cpu" if hw.peak_tflops is None else "cuda")
    recompute = frozenset(recomputed_parts(cfg, acts))
    c = 2 if hw.precision in ("bf16", "fp16") else 4
    if hw.peak_tflops is None:
        ranks_here = min(world_size, gpus_per_node)
        # Profiled with every rank of the node running at once: their sharing is in the figure.
        # Profiled alone: ranks beyond the cores take turns on them.
        share = 1.0 if host.concurrent >= ranks_here else max(1.0, ranks_here / max(cores, 1))
        compute = accum * share * host.forward_backward_s(cfg, world_size, ep, mb, recompute)
        # The rank's own update, timed between those steps (the same sharing of the cores).
        cpu_update = share * host.update_s(cfg, world_size, ep, mb, recompute)
    else:
        extra = (len(recompute) / max(len(acts.parts), 1)) * flops_mb / 3 * 0.9  # the blocks' forward again
        compute = accum * (flops_mb + extra) / (hw.peak_tflops * 1e12 * hw.compute_efficiency)
        # The router GEMMs run at their own precision's rate, not the model's (m6.moe.router).
        router_precision = router_gemm_precision(cfg.model.moe.router_dtype, "cuda")
        router_flops = 3.0 * rates.router_per_position * counts.positions
        compute += accum * router_flops * (1 / hw.matmul_peak(router_precision) - 1 / hw.peak_tflops) \
            / (1e12 * hw.compute_efficiency)
    wire = 2 if cfg.model.moe.a2a_dtype == "bf16" else c
    a2a = a2a_hidden = 0.0
    # One micro-batch's forward and backward all-to-alls: exposed seconds, seconds on the inter-node link
    a2a_pass_exposed = a2a_pass_inter = (0.0, 0.0)
    if ep > 1:
        sent = counts.positions * K * cfg.model.d_model * wire * (ep - 1) / ep
        exchange = expert_exchange_s(cfg, counts.positions, wire, ep, gpus_per_node, hw)
        inter = 2 * moe_layers * expert_exchange_inter_s(cfg, counts.positions, wire, ep, gpus_per_node, hw)
        a2a_pass_inter = (inter, inter)  # dispatch + combine of every MoE layer, forward and backward alike
        blocking = accum * moe_layers * (4 * exchange + hw.latency_s)
        degree = overlap_degree(cfg, sent, hw)
        if degree > 1:
            expert_forward = rates.per_assignment * counts.positions * K / (hw.peak_tflops * 1e12 * hw.compute_efficiency)
            shown = []
            # d latencies per exchange (node-aware across nodes: two stages, two each)
            stages = 2 if cfg.model.moe.a2a_dispatch == "node_aware" and ep > gpus_per_node else 1
            for expert_s in (expert_forward, 2 * expert_forward):  # forward, backward of one layer
                comm = 2 * (exchange + (degree - 1) * stages * hw.latency_s)  # dispatch + combine
                shown.append(pipelined_s(comm, expert_s, degree) - expert_s)
            a2a = accum * moe_layers * (sum(shown) + hw.latency_s)
            a2a_hidden = max(0.0, blocking - a2a)
            a2a_pass_exposed = (moe_layers * shown[0], moe_layers * shown[1])
        else:
            a2a = blocking
            a2a_pass_exposed = (2 * moe_layers * exchange, 2 * moe_layers * exchange)
    numel_rep, numel_exp = facts.numel_rep, facts.numel_exp
    sync = 0.0
    bucket = cfg.parallel.bucket_size_mb * 2**20
    # zero with shard=optimizer (partitioned host states): the buckets reduce-scatter instead,
    # (n-1)/n of their bytes per rank (x gather_scatter_cost), overlapped with backward the same way.
    zero_partitioned = partitioned(cfg)
    bucketed = cfg.parallel.shard == "none" or zero_partitioned
    if not bucketed:
        sync = sharded_sync_s(cfg, model, world_size, ep, gpus_per_node, hw)
    all_reduced = ((numel_rep, world_size), (numel_exp, world_size // ep)) if bucketed else ()
    ring = hw.gather_scatter_cost if zero_partitioned else 2.0  # x (n-1)/n of the bytes: reduce-scatter, all-reduce
    last_bucket = 0.0
    grad_bytes = c if cfg.memory.offload == ZERO else 4.0  # zero: the 16-bit weights' 16-bit gradients
    for numel, n in all_reduced:
        if n > 1 and numel:
            nbytes = grad_bytes * numel
            sync += ring * (n - 1) / n * (data_parallel_s(nbytes, hw, world_size, gpus_per_node) - hw.latency_s) \
                + hw.latency_s * max(1, round(nbytes / bucket))
            last_bucket = max(last_bucket, ring * (n - 1) / n * (data_parallel_s(min(nbytes, bucket), hw, world_size,
                                                                                 gpus_per_node) - hw.latency_s)
                              + hw.latency_s)
    sync_hidden = 0.0
    windows: list[LinkWindow] = []
    backward = 2 / 3 * compute / accum  # the last micro-batch's: its buckets launch as they fill
    if hw.peak_tflops is not None and sync > 0 and bucketed:
        exposed = max(min(last_bucket, sync), sync - backward)
        sync, sync_hidden = exposed, sync - exposed
    # The buckets cross nodes whenever the data-parallel world does (data_parallel_s).
    sync_inter = (sync + sync_hidden) * (bucketed and world_size > gpus_per_node)
    if hw.peak_tflops is not None and (sync_inter or a2a_pass_inter[1]):
        windows.append(link_window("last backward", backward + sync * bucketed + a2a_pass_exposed[1],
                                   {"grad sync": sync_inter, "all-to-all": a2a_pass_inter[1]}))
    link_backward = windows[0].excess_s if windows else 0.0
    scalars = 0
    if world_size > 1:
        per_step = 4 + (ep > 1)  # targets, sync reach check, loss/metric sums, stop flag; expert norm
        if cfg.model.moe.aux_loss_scope == "global":
            scalars = per_step + moe_layers * accum  # routing statistics, in each MoE layer's forward
        else:
            scalars = per_step + 1  # the aux-loss sums, once per step
    small = scalars * hw.latency_s
    numel = numel_rep + numel_exp
    sharded = cfg.parallel.shard != "none"
    # Sharded, the update runs over this rank's shards only (FSDP2 pads each to whole rows).
    updated = _shard_layout_of(cfg, model, world_size, ep).shard_numel if sharded else numel
    cast = 0.0  # zero: the host's cast of the masters to 16 bits (m6.plan.offload_layouts)
    if hw.peak_tflops is None:
        update = cpu_update
    elif cfg.memory.offload != "none":
        zero = cfg.memory.offload == ZERO
        half_grads = cfg.memory.host_grad_dtype == "compute"
        update = host.host_step_s(facts.num_trainable, updated, cfg.optim.name, half_grads=half_grads,
                                  host=host.host_update_of(cfg), half_weights=zero)
        if zero:  # the cast runs on the copy-back thread, not in the update (m6.memory.block_copy_back)
            cast = max(0.0, update - host.host_step_s(facts.num_trainable, updated, cfg.optim.name,
                                                      half_grads=half_grads, host=host.host_update_of(cfg)))
    else:
        update = 28.0 * updated / (hw.memory_GBps * 1e9 * 0.7)
    offload = 0.0
    if zero_partitioned and hw.peak_tflops is not None:
        step = _partitioned_step(cfg, model, world_size, ep, gpus_per_node, hw, compute,
                                 a2a + sync + small + link_backward, update, cast, c, a2a_pass_exposed[0],
                                 a2a_pass_inter[0])
        windows += [step.link_window] if step.link_window is not None else []
        return StepTime(compute, a2a, sync, step.offload, step.update, flops_mb * accum * world_size, small,
                        all_to_all_hidden=a2a_hidden, grad_sync_hidden=sync_hidden, offload_hidden=step.offload_hidden,
                        update_hidden=step.update_hidden, copies=step.copies,
                        synchronous_total=None if step.synchronous_total_extra is None
                        else compute + a2a + sync + small + link_backward + step.synchronous_total_extra,
                        link_shared=sum(w.excess_s for w in windows), link_windows=tuple(windows))
    if sharded and cfg.memory.offload != "none":
        # FSDP2's CPU offload: every gather first copies the unit's fp32 shards to the device (the
        # forward's and, for full, the backward's, in every micro-batch), each gradient shard goes
        # back once after its reduce-scatter; on the gathers' and reduce-scatters' own streams,
        # beside compute. The host shards are the masters: nothing is copied back after the update.
        copy_Bps = (hw.pcie_GBps if hw.pcie_GBps else 10.0) * 1e9
        gathers = (2 if cfg.parallel.shard == "full" else 1) * accum
        offload = max(0.0, 4.0 * updated * (gathers + 1) / copy_Bps - compute)
    elif cfg.memory.offload != "none":
        copy_Bps = (hw.pcie_GBps if hw.pcie_GBps else 10.0) * 1e9
        streamed = 0
        first, resident_blocks = 0, 0  # zero's copy back: its first piece, the blocks it copies
        if cfg.memory.offload in ("optimizer+params", ZERO):
            block_numels = model_facts(model).block_numels
            streamed_ids = streamed_blocks(cfg, len(block_numels))
            streamed = sum(block_numels[i] for i in streamed_ids)
            resident = [n for i, n in enumerate(block_numels) if i not in streamed_ids]
            first = numel - sum(block_numels) + (resident[0] if resident else 0)
            resident_blocks = len(resident)
        # The delayed update's overlap is a GPU's: on a CPU device the update thread shares the cores.
        step = offload_step(cfg, numel, numel_exp, streamed, world_size, ep, compute, a2a + sync + small + link_backward,
                            update,
                            copy_Bps, c, delayed=cfg.optim.delayed_update and hw.peak_tflops is not None,
                            cast_s=cast, first_numel=first, num_resident_blocks=resident_blocks)
        return StepTime(compute, a2a, sync, step.offload, step.update, flops_mb * accum * world_size, small,
                        all_to_all_hidden=a2a_hidden, grad_sync_hidden=sync_hidden, offload_hidden=step.offload_hidden,
                        update_hidden=step.update_hidden, copies=step.copies,
                        synchronous_total=None if step.synchronous_total_extra is None
                        else compute + a2a + sync + small + link_backward + step.synchronous_total_extra,
                        link_shared=link_backward, link_windows=tuple(windows))
    return StepTime(compute, a2a, sync, offload, update, flops_mb * accum * world_size, small,
                    all_to_all_hidden=a2a_hidden, grad_sync_hidden=sync_hidden, link_shared=link_backward,
                    link_windows=tuple(windows))


def _partitioned_step(cfg: Config, model: nn.Module, world_size: int, ep: int, gpus_per_node: int, hw: Hardware,
                      compute_s: float, device_other_s: float, update_s: float, cast_s: float, c: int,
                      forward_a2a_s: float, forward_a2a_inter_s: float):
    """zero with shard=optimizer: the copies and gathers of m6.plan.zero_partition_step at this
    layout. The gathers: per group ring all-gathers of the 16-bit weights ((n-1)/n of their bytes per
    rank, x gather_scatter_cost, over the link the group spans), a latency per segment; on the
    inter-node link, beside the forward's all-to-alls (``forward_a2a_s`` exposed, ``forward_a2a_inter_s``
    on that link, one micro-batch's), once the data-parallel world spans nodes."""
    facts = model_facts(model)
    layout = _shard_layout_of(cfg, model, world_size, ep)
    edp = world_size // ep
    blocks = len(facts.block_numels)
    gather = 0.0
    for numel, n in ((facts.numel_rep, world_size), (facts.numel_exp, edp)):
        if n > 1 and numel:
            gather += hw.gather_scatter_cost * (n - 1) / n * (data_parallel_s(c * numel, hw, world_size, gpus_per_node)
                                                              - hw.latency_s) + hw.latency_s * (blocks + 1)
    numel = facts.numel_rep + facts.numel_exp
    first = numel - sum(facts.block_numels) + (facts.block_numels[0] if blocks else 0)
    local = layout.shard_numel if world_size == 1 else (layout.expert_numel if edp == 1 else 0)
    copy_Bps = (hw.pcie_GBps if hw.pcie_GBps else 10.0) * 1e9
    n_bucket = world_size if facts.numel_rep else edp  # the dense group's buckets are the most
    return partitioned_offload_step(cfg, layout.shard_numel, local, world_size, compute_s, device_other_s, update_s,
                                    cast_s, gather, copy_Bps, c, cfg.parallel.bucket_size_mb * 2**20 / n_bucket,
                                    first / max(numel, 1), blocks,
                                    cfg.optim.delayed_update and hw.peak_tflops is not None,
                                    forward_a2a_s, forward_a2a_inter_s, world_size > gpus_per_node)


def pipelined_s(comm_s: float, compute_s: float, degree: int) -> float:
    """Seconds of a pass whose exchange (``comm_s``) and compute (``compute_s``) are cut into
    ``degree`` chunks that overlap one ahead: the longer of the two, plus one chunk of the other."""
    return max(comm_s, compute_s) + min(comm_s, compute_s) / degree


def overlap_degree(cfg: Config, sent_bytes: float, hw: Hardware) -> int:
    """The chunks model.moe.a2a_overlap_degree makes of a layer's exchange (auto: by the bytes the
    rank sends, as m6.moe.chunked_all_to_all picks); 1 on a CPU host (not modelled there)."""
    if hw.peak_tflops is None:
        return 1
    setting = cfg.model.moe.a2a_overlap_degree
    return auto_overlap_degree(int(sent_bytes), 1) if setting == "auto" else int(setting)
