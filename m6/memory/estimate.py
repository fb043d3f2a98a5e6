"""Where the training state of one process lives, in bytes, given its layout and memory features.

One home for the per-process memory model: ``m6.inspect`` prints it and the planner (m6.plan)
searches over it. Works on a model built on ``meta`` holding this process's share of the
parameters (its experts only, as m6.parallel shards them), so any config and layout is reported
without allocating it. Activations come from m6.model.activation_bytes (the one formula).

Bytes per parameter: 4 weight, 4 gradient, 8 Adam moments (+ a 4 B step count per tensor); with
optim.name=adafactor the moments are torch's Adafactor's: per matrix (or expert stack) 4 B per row
and per column, per vector 4 B per element (``optimizer_state_sizes``). The update's temporary is
foreach AdamW's sqrt(exp_avg_sq), or foreach Adafactor's full-size variance estimate: 4 B per
element of one foreach call, and torch calls it per (param group x apply group), so the largest
such call counts.

The peak is the largest of three moments of a step, on top of what lives all the time (weights,
and optimizer state when it stays on the device):
  backward   walked unit by unit in the order backward runs (head, blocks last to first,
             embeddings): at each unit, gradients of earlier micro-batches + the activations not
             yet released + the gradients produced so far + the gradient-sync buckets in flight
             (laid out and launched as m6.parallel.grad_sync does: reverse registration order,
             a bucket goes once it and every bucket before it are complete, at most two in
             flight) + that unit's own transient (``unit_transients``: the head's two fp32
             logit-sized gradients, a block's gradient buffers beside its recomputed part's
             activations made again), at least the all-to-all payload. A bucket therefore weighs on the
             activation peak only when it completes while activations are still held: one bucket
             holding every gradient is copied after they are gone;
  end of backward   every gradient + the buckets;
  update     every gradient + the step's temporaries (on the host when offloaded).
Offloaded, the device's gradients are those other ranks share (held until their all-reduce in the
last micro-batch) plus one transient gradient: the others stream to the host in every
micro-batch's backward (m6.memory.grad_stream).
memory.offload=zero (``zero_memory``, ZeRO-Offload's layout; the planner's model of it too):
  device  c B per resident parameter (the blocks not in ``memory.offload_blocks``; the streamed
          ones: the two adjacent blocks in use, as optimizer+params), the 16-bit gradients while
          they are on the device: at one micro-batch per step each leaves once final (a gradient
          other ranks share once its bucket's all-reduce is done: the backward walk of
          m6.memory.estimate, its buckets and gradients at c bytes); with accumulation those that
          wait add up on the device in 16 bits (a 16-bit weight's .grad is 16-bit): every one
          with 16-bit host gradients (memory.host_grad_dtype=compute: they leave once, in the last
          micro-batch), the shared ones with fp32 host buffers (the others leave in every
          micro-batch, widened to fp32 on the device one at a time, and are summed on the host).
  host    4 B fp32 master + the optimizer's state (m6.memory.estimate.optimizer_state_sizes) + the
          gradients' pinned host buffers, 4 B (fp32) or c B (compute) per parameter (twice with
          the delayed update: the next backward streams into a second set; none for a streamed
          block's parameter whose gradient lands in its 16-bit home, memory.zero_grad_landing,
          m6.memory.home_grads) + pinned 16-bit weight
          staging: the streamed blocks' 16-bit homes (what their forward and backward fetch) and
          the copy back's 16-bit buffers (``copy_back_staging``: two of the largest push's size,
          at most 2^25 elements each, a push being one forward-order segment's resident weights,
          the weights outside the blocks or one block's) + the update's temporaries
          (with 16-bit host gradients one update group's read back in fp32; torch's foreach
          optimizers' own) + the checkpoint staging copy (checkpoint.async_save), as the fp32
          layouts.

DeepSpeed's CPU Adam (memory.host_optimizer=deepspeed) updates in place: no temporaries; auto
counts torch's, as it falls back to torch where DeepSpeed's op does not build.

Host memory also holds, with checkpoint.async_save, the checkpoint staging buffer: one copy of
every weight and optimizer tensor of this rank, allocated at the first save and kept for the run
(m6.checkpoint.staging), page-locked where the tensor lives on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from m6.config import Config, accumulation_steps, expert_ffn_dim, micro_batch_size
from m6.model.activation_bytes import (RESIDUAL_BYTES, ActivationBytes, ActivationShape, activation_bytes,
                                      resolved_expert_kernel)
from m6.moe import MoELayer
from m6.memory.master_weights import compute_weight_params
from m6.memory.grouped_apply import split_apply_groups
from m6.memory.home_grads import grads_land_in_homes
from m6.memory.shard_estimate import ShardLayout, fused_update, shard_layout, sharded_backward, sharded_states


COMPONENTS = ("params", "grads", "optimizer state", "optimizer step temporaries", "activations (per micro-batch)",
              "all-to-all buffers", "backward transients", "gradient-sync buckets", "gathered parameters",
              "unsharded gradients", "checkpoint staging")
MAX_BUCKETS_IN_FLIGHT = 2  # m6.parallel.grad_sync.GradientSync.max_in_flight
STAGING_ALIGN = 64  # m6.checkpoint.staging.ALIGN: every staged tensor starts on a 64-byte boundary
WEIGHT_STAGING = "16-bit weight staging"  # the zero layout's pinned host homes and copy-back buffers
STAGING_CHUNK = 2**25  # elements of each of the copy back's two pinned 16-bit buffers (m6.memory.half_weight_push)


@dataclass
class MemoryReport:
    """Estimated bytes per component (names in COMPONENTS) on the accelerator and in host memory,
    and the peaks of a step (see the module docstring)."""

    device: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    peak_device: float = 0.0  # the accelerator's high-water mark over a step
    peak_host: float = 0.0  # model states in host memory (offload), with the update's temporaries
    peak_shared: float = 0.0  # both in one memory (device = cpu): the high-water mark of their sum

    def total(self, where: str) -> float:
        return sum(getattr(self, where).values())


class ModelFacts:
    """What the estimate reads off a model, walked once: its trainable parameters and which are
    experts, its state_dict's tensor sizes, and (per layout, cached) the gradient-sync buckets.
    The planner sizes thousands of candidates on one rank model: walking its modules for each
    took most of a search. Valid while the model's parameters stay as they were when made."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.expert_ids = {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
        self.replicated = [p for p in self.params if id(p) not in self.expert_ids]
        self.experts = [p for p in self.params if id(p) in self.expert_ids]
        self.state_sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
        self.block_numels = [sum(p.numel() for p in b.parameters()) for b in getattr(model, "blocks", [])]
        self.expert_numel = sum(p.numel() for p in self.experts)
        self.largest_numel = max((p.numel() for p in self.params), default=0)  # the largest parameter's
        self._walks: dict[tuple, _BackwardWalk] = {}
        self._largest_call: dict[tuple, int] = {}
        self._largest_group: dict[int, int] = {}
        self._largest_push: dict[frozenset[int], int] = {}
        self._optimizer_state: dict[str, float] = {}
        self._staging: dict[str, float] = {}
        self._shard_layouts: dict[tuple, ShardLayout] = {}
        self._compute_weight_numel: Optional[int] = None

    def walk(self, world_size: int, ep: int, bucket_bytes: float) -> "_BackwardWalk":
        key = (world_size, ep, bucket_bytes)
        if key not in self._walks:
            self._walks[key] = _BackwardWalk(self.model, self.expert_ids, world_size, ep, bucket_bytes)
        return self._walks[key]

    def largest_call(self, apply_groups: int, no_decay: set[int]) -> int:
        """Elements of the largest foreach optimizer call: per (apply group x decay group)."""
        key = (apply_groups, frozenset(no_decay))
        if key not in self._largest_call:
            groups = split_apply_groups(self.replicated, self.experts, apply_groups) if apply_groups > 1 \
                else [self.params]
            self._largest_call[key] = max((sum(p.numel() for p in g if (id(p) in no_decay) == nd)
                                           for g in groups for nd in (False, True)), default=0)
        return self._largest_call[key]

    def optimizer_state_bytes(self, optimizer_name: str) -> float:
        """Bytes of the optimizer's fp32 state over the trainable parameters (optimizer_state_sizes)."""
        if optimizer_name not in self._optimizer_state:
            self._optimizer_state[optimizer_name] = float(
                sum(sum(optimizer_state_sizes(optimizer_name, p)) for p in self.params))
        return self._optimizer_state[optimizer_name]

    def staging_bytes(self, cfg: Config) -> float:
        """staging_bytes of this model's state and its trainable parameters' optimizer state."""
        if not cfg.checkpoint.async_save:
            return 0.0
        if cfg.optim.name not in self._staging:
            self._staging[cfg.optim.name] = staging_bytes(cfg, self.model, self.params, self.state_sizes)
        return self._staging[cfg.optim.name]

    def shard_layout(self, cfg: Config, no_decay: set[int], world_size: int, ep: int) -> ShardLayout:
        """m6.memory.shard_estimate.shard_layout, which reads only the model, the degrees, the
        no-decay ids and optim.apply_groups off cfg."""
        key = (world_size, ep, cfg.optim.apply_groups, frozenset(no_decay))
        if key not in self._shard_layouts:
            self._shard_layouts[key] = shard_layout(cfg, self.model, no_decay, world_size, ep)
        return self._shard_layouts[key]

    def compute_weight_numel(self) -> int:
        """Elements of the weights train.weight_copy=per_step copies (compute_weight_params)."""
        if self._compute_weight_numel is None:
            self._compute_weight_numel = sum(p.numel() for p in compute_weight_params(self.model))
        return self._compute_weight_numel

    def largest_group(self, apply_groups: int) -> int:
        """Elements of the largest apply group (optim.apply_groups), both decay groups together."""
        if apply_groups not in self._largest_group:
            groups = split_apply_groups(self.replicated, self.experts, apply_groups) if apply_groups > 1 \
                else [self.params]
            self._largest_group[apply_groups] = max((sum(p.numel() for p in g) for g in groups), default=0)
        return self._largest_group[apply_groups]


    def largest_copy_back_push(self, streamed: frozenset[int]) -> int:
        """Elements of zero's largest copy-back push (m6.memory.block_copy_back), for which its
        staging is allocated: one forward-order segment (the weights outside the blocks, or one
        resident block's; the blocks ``streamed`` names are cast into their host homes instead)."""
        if streamed not in self._largest_push:
            blocks = getattr(self.model, "blocks", [])
            segment: dict[int, int] = {}
            for i, block in enumerate(blocks):
                for p in block.parameters():
                    segment.setdefault(id(p), i + 1)
            pushes: dict[int, int] = {}
            for p in self.params:
                s = segment.get(id(p), 0)
                if s - 1 not in streamed:
                    pushes[s] = pushes.get(s, 0) + p.numel()
            self._largest_push[streamed] = max(pushes.values(), default=0)
        return self._largest_push[streamed]


def _streamed_window_of(sizes: list[int]) -> int:
    """Elements of the two adjacent blocks resident at once (the one running + the prefetched one)."""
    if len(sizes) < 2:
        return sum(sizes)
    return max(a + b for a, b in zip(sizes, sizes[1:]))


def compute_bytes(cfg: Config, device_type: str) -> int:
    """Element size of the compute dtype: train.precision (auto = bf16 on CUDA, fp32 on CPU)."""
    precision = cfg.train.precision
    if precision == "auto":
        return 2 if device_type == "cuda" else 4
    return 2 if precision in ("bf16", "bf16-autocast", "fp16") else 4


def activation_report(cfg: Config, world_size: int, expert_parallel_size: int, device_type: str) -> ActivationBytes:
    """The activation formula at this layout's micro-batch and precision."""
    c = compute_bytes(cfg, device_type)
    a2a = 2 if cfg.model.moe.a2a_dtype == "bf16" else c
    moe = cfg.model.moe
    kernel = resolved_expert_kernel(moe.expert_kernel, device_type, cfg.train.precision, cfg.train.deterministic,
                                    moe.num_experts, expert_ffn_dim(cfg.model))
    # memory.offload=zero keeps 16-bit device weights, the embeddings' too: the residual stream is
    # 16-bit (and on CPU LayerNorm keeps its mean and rstd in a 16-bit input's dtype).
    residual = c if cfg.memory.offload == "zero" else RESIDUAL_BYTES
    shape = ActivationShape(micro_batch_size(cfg.train, world_size), cfg.data.seq_len, c, a2a, expert_parallel_size,
                            expert_kernel=kernel, weight_copies=cfg.train.precision == "bf16-autocast",
                            residual_bytes=residual,
                            norm_stats_bytes=residual if device_type == "cpu" else 4)
    return activation_bytes(cfg.model, shape)


def recomputed_parts(cfg: Config, acts: ActivationBytes) -> set[str]:
    """The parts memory.activation_checkpointing recomputes: none, every part (full), or for auto
    the parts that free the most bytes, one by one, until the kept bytes fit its budget (GiB, or
    a fraction of the no-recompute bytes). The run's own planner (m6.memory.recompute_plan) ranks
    parts by bytes freed per second of recompute, measured; here every part of a kind costs
    time in proportion to its bytes, so the two orders agree up to ties."""
    mode, mem, parts = cfg.memory.activation_checkpointing, cfg.memory, acts.parts
    if mode == "none":
        return set()
    if mode == "full":
        return set(parts)
    none = acts.kept()
    budget = mem.activation_budget_gb * 2**30 if mem.activation_budget_gb is not None else \
        (0.5 if mem.activation_budget_fraction is None else mem.activation_budget_fraction) * none
    chosen, kept = set(), none
    for name in sorted(parts, key=lambda n: parts[n][1] - parts[n][0]):  # most bytes freed first
        if kept <= budget:
            break
        chosen.add(name)
        kept -= parts[name][0] - parts[name][1]
    return chosen


def kept_activations(cfg: Config, acts: ActivationBytes) -> tuple[float, float]:
    """(bytes kept for backward, the largest recomputed part's bytes re-made in backward)."""
    chosen = recomputed_parts(cfg, acts)
    return acts.kept(chosen), max((acts.parts[n][0] for n in chosen), default=0.0)


def unit_transients(acts: ActivationBytes, chosen: set[str], least: float = 0.0,
                    units: Optional[list[str]] = None) -> dict[str, float]:
    """What each unit's backward makes on top of the activations still held when it runs: its own
    gradient buffers (ActivationBytes.transient_by_unit: the head's two fp32 logit-sized
    gradients, a block's) beside the activations of its largest recomputed part, re-made for
    that backward (``chosen``: the parts recomputed); at least ``least`` (a transient any unit
    may hold: the all-to-all payload, a gradient being streamed out); ``units``: the names of
    ``acts.kept_by_unit()`` where the caller has them."""
    redo: dict[str, float] = {}
    for name in chosen:
        unit = name.rsplit(".", 1)[0]  # blocks.<i>.attention -> blocks.<i>
        redo[unit] = max(redo.get(unit, 0.0), acts.parts[name][0])
    return {u: max(acts.transient_by_unit.get(u, 0.0) + redo.get(u, 0.0), least)
            for u in (units if units is not None else acts.kept_by_unit())}


def optimizer_state_sizes(optimizer_name: str, p: nn.Parameter) -> tuple[int, ...]:
    """Bytes of each fp32 state tensor the optimizer keeps for ``p``, its step count included:
    AdamW's two moments; torch Adafactor's row and column means of a matrix's squared gradient
    (over the last two dims, per leading index: [E, D, F] keeps [E, D, 1] and [E, 1, F]), or a
    vector's full second moment."""
    n = p.numel()
    if optimizer_name == "adamw":
        return (4 * n, 4 * n, 4)
    if p.dim() > 1:
        return (4 * (n // p.shape[-1]), 4 * (n // p.shape[-2]), 4)
    return (4 * n, 4)


def staging_bytes(cfg: Config, model: nn.Module, params: list[nn.Parameter],
                  state_sizes: Optional[list[int]] = None) -> float:
    """Host bytes of the buffer an asynchronous checkpoint save copies this rank's model and
    optimizer tensors into (m6.checkpoint.staging.StagingBuffer): its weights, and per trained
    parameter its optimizer state tensors, each padded to STAGING_ALIGN (the RNG states, ~10 KB,
    not counted). 0 with checkpoint.async_save false."""
    if not cfg.checkpoint.async_save:
        return 0.0
    sizes = list(state_sizes) if state_sizes is not None else \
        [t.numel() * t.element_size() for t in model.state_dict().values()]
    sizes += [n for p in params for n in optimizer_state_sizes(cfg.optim.name, p)]
    return float(sum(-(-n // STAGING_ALIGN) * STAGING_ALIGN for n in sizes))


def layout_memory(cfg: Config, model: nn.Module, no_decay: set[int], world_size: int = 1,
                  expert_parallel_size: Optional[int] = None, device_type: str = "cuda",
                  facts: Optional[ModelFacts] = None) -> MemoryReport:
    """The unsharded, sharded (FSDP2) and zero layouts' part of m6.memory.memory_report.estimate_memory
    (the partitioned zero builds on zero's report there). Per-process estimate for ``cfg`` with ``model`` (meta or real) holding this process's params.

    ``no_decay``: ids of the params in the optimizer's no-weight-decay group (torch updates each
    param group in its own foreach call). ``world_size`` > 1: gradients other ranks share are
    all-reduced on the device before they may be offloaded, so the device holds those until then.
    ``expert_parallel_size``: the all-to-all's degree (None: 1); ``device_type``: where it runs
    (train.precision=auto computes in bf16 on cuda, fp32 on cpu). ``facts``: ``ModelFacts(model)``
    made once by a caller that sizes many configs on one model (the planner).
    """
    ep = expert_parallel_size or 1
    facts = facts if facts is not None else ModelFacts(model)
    params, numel, expert_ids = facts.params, facts.numel, facts.expert_ids
    largest_call = facts.largest_call(cfg.optim.apply_groups, no_decay)

    acts = activation_report(cfg, world_size, ep, device_type)
    kept, redo = kept_activations(cfg, acts)
    if cfg.parallel.shard != "none":
        return _sharded_report(cfg, facts, no_decay, world_size, ep, device_type, acts)
    if cfg.memory.offload == "zero":
        return zero_memory(cfg, model, facts, no_decay, world_size, ep, device_type)
    accum = accumulation_steps(cfg.train, world_size)
    # Gradients summed over other ranks travel in flat bucket copies: replicated ones whenever
    # world > 1, expert ones when another rank holds the same experts.
    walk = facts.walk(world_size, ep, cfg.parallel.bucket_size_mb * 2**20)
    buckets = walk.most_in_flight()
    transients = {"activations (per micro-batch)": kept, "all-to-all buffers": acts.a2a_buffers,
                  "backward transients": max(acts.backward_transient, redo), "gradient-sync buckets": buckets}

    # train.weight_copy=per_step (config.py: unsharded, no offload): the bf16 copies beside the fp32 masters.
    copies = 2.0 * facts.compute_weight_numel() if cfg.train.weight_copy == "per_step" else 0.0
    states = {
        "params": 4.0 * numel + copies,
        "grads": 4.0 * numel,
        "optimizer state": facts.optimizer_state_bytes(cfg.optim.name),
        "optimizer step temporaries": 0.0 if fused_update(cfg, device_type) else 4.0 * largest_call,
    }
    mode = cfg.memory.offload
    keeps_grads = accum > 1 or world_size > 1
    if mode == "none":
        device = {**states, **transients}
        host: dict[str, float] = {}
        grads_before = states["grads"] if accum > 1 else 0.0
        resident, update_device, update_host = states["params"] + states["optimizer state"], \
            states["grads"] + states["optimizer step temporaries"], 0.0
        grads_end = states["grads"]
    else:
        # Offloaded (gradient streaming, m6.memory.grad_stream): a gradient no other rank shares
        # leaves the device as backward writes it, in every micro-batch: one transient tensor at a
        # time (the largest, a backward transient). A shared one waits on the device for its
        # all-reduce in the last micro-batch (accumulating there until then).
        edp = world_size // ep
        local = [p for p in params if world_size == 1 or (id(p) in expert_ids and edp == 1)]
        shared_numel = numel - sum(p.numel() for p in local)
        half_grads = cfg.memory.host_grad_dtype == "compute"
        # 16-bit host gradients are never summed on the host: with accumulation the unshared ones
        # add up on the device too, and leave in the last micro-batch.
        waits = numel if half_grads and compute_bytes(cfg, device_type) < 4 and accum > 1 else shared_numel
        device_grads = 4.0 * waits
        streaming = 4.0 * max((p.numel() for p in local), default=0)
        transients["backward transients"] = max(transients["backward transients"], streaming)
        if mode == "optimizer+params":
            sizes = facts.block_numels
            chosen = cfg.memory.offload_blocks  # auto: counted as all (the least the device can hold)
            if isinstance(chosen, list):
                sizes = [sizes[i] for i in sorted(chosen)]
            device_params = 4.0 * (numel - sum(sizes) + _streamed_window_of(sizes))
            # optim.delayed_update: the streamed weights' host homes apart from their masters.
            host_homes = 4.0 * sum(sizes) if cfg.optim.delayed_update else 0.0
        else:
            device_params, host_homes = 4.0 * numel, 0.0
        device = {"params": device_params, "grads": device_grads, **transients}
        # optim.delayed_update: the next step's gradients stream into a second set (double buffer,
        # fp32 or 16-bit as the first).
        host = {"params": states["params"] + host_homes,
                "grads": (compute_bytes(cfg, device_type) * numel if half_grads else states["grads"])
                * (2 if cfg.optim.delayed_update else 1),
                "optimizer state": states["optimizer state"],
                # 16-bit host gradients are read back in fp32 one apply group at a time.
                "optimizer step temporaries": (0.0 if cfg.memory.host_optimizer == "deepspeed"
                                               else states["optimizer step temporaries"])
                + (4.0 * facts.largest_group(cfg.optim.apply_groups) if half_grads else 0.0)}
        grads_before = device_grads if accum > 1 else 0.0
        resident, update_device, update_host = device_params, 0.0, host["optimizer step temporaries"]
        grads_end = device_grads
    # Gradients this backward allocates as it goes: all of them when none exist before it (no
    # accumulation); offloaded ones leave as they become final (one at a time at world 1).
    # Each unit's own transient on the activations still held when it runs (the head's on all);
    # in every unit at least the all-to-all payload and, offloaded, the unshared gradient being
    # written and streamed.
    chosen = recomputed_parts(cfg, acts)
    floor = max(acts.a2a_buffers, streaming if mode != "none" else 0.0)
    kept_by_unit = acts.kept_by_unit(chosen)
    backward = grads_before + walk.peak(kept_by_unit, grads_made=accum == 1 and (mode == "none" or keeps_grads),
                                        offloaded=mode != "none",
                                        transients=unit_transients(acts, chosen, floor, list(kept_by_unit)))
    staging = facts.staging_bytes(cfg)
    if staging:
        host["checkpoint staging"] = staging  # from the first save on, for the rest of the run
    phases_device = max(backward, grads_end + buckets, update_device)
    host_resident = sum(v for k, v in host.items() if k != "optimizer step temporaries")
    return MemoryReport(
        device=device, host=host,
        peak_device=resident + phases_device,
        peak_host=host_resident + update_host,
        peak_shared=resident + host_resident + max(backward, grads_end + buckets, update_device + update_host),
    )


def _sharded_report(cfg: Config, facts: ModelFacts, no_decay: set[int], world_size: int, ep: int, device_type: str,
                    acts: ActivationBytes) -> MemoryReport:
    """parallel.shard optimizer/full (m6.memory.shard_estimate): shards and optimizer state
    resident; backward walked unit by unit (activations not yet released, gathered parameters,
    unsharded and sharded gradients at each); the update over the gradient shards. With
    memory.offload (FSDP2's CPUOffloadPolicy) the shards, their gradients, the optimizer state and
    the update live on the host: the device holds what backward gathers and makes."""
    layout = facts.shard_layout(cfg, no_decay, world_size, ep)
    states = sharded_states(cfg, layout, world_size, device_type)
    kept, redo = kept_activations(cfg, acts)
    transient = max(acts.a2a_buffers, acts.backward_transient, redo)
    offloaded = cfg.memory.offload != "none"
    backward = sharded_backward(cfg, layout, acts.kept_by_unit(recomputed_parts(cfg, acts)), transient, world_size,
                                device_type, offloaded)
    walk = {"activations (per micro-batch)": kept, "all-to-all buffers": acts.a2a_buffers,
            "backward transients": max(acts.backward_transient, redo),
            "gathered parameters": backward.gathered, "unsharded gradients": backward.unsharded_grads}
    resident = states["params"] + states["optimizer state"]
    update = states["grads"] + states["optimizer step temporaries"]
    host = {"checkpoint staging": resident} if cfg.checkpoint.async_save else {}  # the staged shards
    if offloaded:
        host = {**states, **host}
        host_resident = sum(host.values()) - update
        return MemoryReport(device=walk, host=host, peak_device=backward.peak, peak_host=host_resident + update,
                            peak_shared=backward.peak + host_resident + update)
    host_resident = sum(host.values())
    return MemoryReport(device={**states, **walk}, host=host, peak_device=resident + max(backward.peak, update),
                        peak_host=host_resident, peak_shared=resident + host_resident + max(backward.peak, update))


def _units_of(model: nn.Module, name: str) -> tuple[str, str]:
    """(unit whose backward allocates a parameter's gradient, unit after which it is final), in
    ActivationBytes.kept_by_unit's names. They differ for the tied embedding: the LM head's
    backward makes its [V, D] gradient, the embeddings' backward adds to it last."""
    if name.startswith("blocks."):
        unit = ".".join(name.split(".")[:2])
        return unit, unit
    if name.startswith(("final_norm.", "lm_head.")):
        return "head", "head"
    if name == "text_embed.tokens.weight" and getattr(model, "lm_head", True) is None:
        return "head", "embeddings"
    return "embeddings", "embeddings"


class _BackwardWalk:
    """Gradient-sync buckets and gradients along one backward, unit by unit.

    Buckets as m6.parallel.grad_sync.GradientSync builds them (one open bucket per group and dtype,
    filled in reverse registration order, closed at ``bucket_bytes``); parameters whose group has
    one rank are not bucketed. A bucket is launched once complete with all before it; the last
    MAX_BUCKETS_IN_FLIGHT launched count as in flight (the link may not have finished them).
    """

    def __init__(self, model: nn.Module, expert_ids: set[int], world_size: int, ep: int, bucket_bytes: float) -> None:
        # Per parameter: (allocated in, final after, bytes, bucket index or None).
        self.grads: list[tuple[str, str, float, Optional[int]]] = []
        open_buckets: dict[tuple, int] = {}
        closing: list[int] = []
        self.buckets: list[list] = []  # [bytes, units that must be done]
        for name, p in reversed([(n, p) for n, p in model.named_parameters() if p.requires_grad]):
            made_in, final_after = _units_of(model, name)
            nbytes = float(p.numel() * p.element_size())
            group = ("expert_data", world_size // ep) if id(p) in expert_ids else ("world", world_size)
            index = None
            if group[1] > 1:
                key = (group[0], p.dtype)
                if key not in open_buckets:
                    open_buckets[key] = len(self.buckets)
                    self.buckets.append([0.0, set()])
                index = open_buckets[key]
                self.buckets[index][0] += nbytes
                self.buckets[index][1].add(final_after)
                if self.buckets[index][0] >= bucket_bytes:
                    closing.append(open_buckets.pop(key))
            self.grads.append((made_in, final_after, nbytes, index))
        # GradientSync lists a bucket when it closes, then the still-open ones in the order they
        # were opened: that list is the launch order.
        order = closing + list(open_buckets.values())
        self.buckets = [self.buckets[i] for i in order]
        remap = {old: new for new, old in enumerate(order)}
        self.grads = [(a, f, b, None if i is None else remap[i]) for a, f, b, i in self.grads]
        # peak() walks backward unit by unit: each unit's gradients as (final after, bucket, bytes).
        self._made_in: dict[str, list[tuple[str, Optional[int], float]]] = {}
        for made_in, final_after, nbytes, bucket in self.grads:
            self._made_in.setdefault(made_in, []).append((final_after, bucket, nbytes))

    def most_in_flight(self) -> float:
        """Bytes of the largest MAX_BUCKETS_IN_FLIGHT buckets (the end of backward, the update)."""
        return sum(sorted((b[0] for b in self.buckets), reverse=True)[:MAX_BUCKETS_IN_FLIGHT])

    def peak(self, kept_by_unit: dict[str, float], grads_made: bool, offloaded: bool = False,
             transients: Optional[dict[str, float]] = None, least_transient: float = 0.0) -> float:
        """Largest activations still held + gradients made so far + buckets in flight + the
        unit's own transient, as each unit's backward runs. ``grads_made``: this backward
        allocates the gradients (False: they exist before it, accumulation). ``offloaded``: a
        gradient leaves the device once final: at once when nothing sums it with other ranks, else
        when its bucket is drained (past the in-flight window). ``transients``: what each unit's
        backward makes at its worst (ActivationBytes.transient_by_unit), at least
        ``least_transient`` in every unit (a transient any unit may hold: the all-to-all payload,
        a recomputed part, a gradient being streamed)."""
        transients = transients or {}
        held, launched, next_bucket = sum(kept_by_unit.values()), [], 0
        done: set[str] = set()
        worst = 0.0
        # The gradients made so far, added unit by unit; once streamed to the host one stays gone
        # (``done`` and the drained buckets only grow), so it leaves the list for good. Byte counts
        # are whole numbers: the running sums are exact whatever the order.
        made_so_far, live = 0.0, []
        for unit, acts in kept_by_unit.items():
            drained = max(0, len(launched) - MAX_BUCKETS_IN_FLIGHT)  # buckets 0 .. drained-1
            made = 0.0
            if grads_made:
                new = self._made_in.get(unit, ())
                if offloaded:
                    live = [g for g in (*live, *new) if not (g[1] is None and g[0] in done
                                                               or g[1] is not None and g[1] < drained)]
                    made = float(sum(g[2] for g in live))
                else:
                    made_so_far += sum(g[2] for g in new)
                    made = made_so_far
            transient = max(transients.get(unit, 0.0), least_transient)
            worst = max(worst, held + made + sum(launched[-MAX_BUCKETS_IN_FLIGHT:]) + transient)
            held -= acts
            done.add(unit)
            while next_bucket < len(self.buckets) and self.buckets[next_bucket][1] <= done:
                launched.append(self.buckets[next_bucket][0])
                next_bucket += 1
        return worst




def streamed_blocks(cfg: Config, num_blocks: int) -> list[int]:
    """The blocks whose weights live on the host and stream in (memory.offload_blocks; all: every
    one; auto counted as all, the least the device can hold)."""
    chosen = cfg.memory.offload_blocks
    return sorted(chosen) if isinstance(chosen, list) else list(range(num_blocks))


def copy_back_staging(push_numel: int) -> int:
    """Elements of the copy back's pinned 16-bit staging buffers (m6.memory.half_weight_push) after
    pushes of at most ``push_numel`` elements: two buffers (a push's copy runs while the next is
    cast into the other), each of the largest push's size up to a chunk."""
    return 2 * min(push_numel, STAGING_CHUNK)


def zero_memory(cfg: Config, model: nn.Module, facts: ModelFacts, no_decay: set[int], world_size: int, ep: int,
                device_type: str = "cuda") -> MemoryReport:
    """Device and host bytes of one rank in ZeRO-Offload's layout (see the module docstring),
    named as m6.memory.estimate names its components; the peaks taken as it takes them.
    ``no_decay``: the ids of the optimizer's no-decay parameters (a foreach call per group)."""
    c = compute_bytes(cfg, device_type)
    numel = facts.numel
    accum = accumulation_steps(cfg.train, world_size)
    acts = activation_report(cfg, world_size, ep, device_type)
    chosen = recomputed_parts(cfg, acts)
    kept, redo = kept_activations(cfg, acts)
    # The walk lays buckets out by fp32 bytes: a 16-bit bucket of bucket_size_mb holds 4/c as many
    # elements, and every gradient and bucket it sums weighs c/4 of its fp32 bytes.
    scale = c / 4.0
    walk = facts.walk(world_size, ep, cfg.parallel.bucket_size_mb * 2**20 / scale)
    buckets = scale * walk.most_in_flight()
    streamed = streamed_blocks(cfg, len(facts.block_numels))
    sizes = [facts.block_numels[i] for i in streamed]
    params = float(c * (numel - sum(sizes) + _streamed_window_of(sizes)))
    resident_params = float(c * (numel - sum(sizes)))  # the blocks that never leave
    # A streamed block is on the device only around its forward and its backward, the next one in
    # that direction prefetched (m6.memory.offload.ParamStreamer): during block k's backward, k
    # and the streamed block before it; the head's backward and the end of the step hold none.
    window = {f"blocks.{k}": c * (facts.block_numels[k] + (facts.block_numels[streamed[j - 1]] if j else 0))
              for j, k in enumerate(streamed)}
    half_grads = cfg.memory.host_grad_dtype == "compute"
    # With accumulation the gradients that wait add up on the device in 16 bits (a 16-bit weight's
    # .grad is 16-bit): all of them with 16-bit host gradients (they leave once, in the last
    # backward); with fp32 host buffers only the shared ones (the others leave in every
    # micro-batch and are summed on the host in fp32).
    edp = world_size // ep
    local = facts.numel if world_size == 1 else facts.expert_numel if edp == 1 else 0
    held = float(c * (numel if half_grads else numel - local)) if accum > 1 else 0.0
    # One gradient being written and copied: fp32 host buffers widen it to fp32 on the device first.
    largest = (c if half_grads else 4) * facts.largest_numel
    kept_by_unit = acts.kept_by_unit(chosen)
    by_unit = {unit: b / scale for unit, b in kept_by_unit.items()}
    # Each unit's own transient on the activations still held when it runs (the head's on all),
    # at least the all-to-all payload or the gradient being copied out; plus the streamed blocks
    # on the device then.
    extra = {u: (b + window.get(u, 0.0)) / scale
             for u, b in unit_transients(acts, chosen, max(acts.a2a_buffers, largest), list(by_unit)).items()}
    backward = held + scale * walk.peak(by_unit, grads_made=accum == 1, offloaded=True, transients=extra)
    # The forward's end: every activation but the head's, the last streamed blocks' window.
    forward = held + kept - kept_by_unit["head"] + c * _streamed_window_of(sizes)
    device = {"params": params, "grads": held, "activations (per micro-batch)": kept,
              "all-to-all buffers": acts.a2a_buffers,
              "backward transients": max(acts.backward_transient, redo, largest), "gradient-sync buckets": buckets}
    group = facts.largest_group(cfg.optim.apply_groups)
    # The resident weights go back in forward-order segments (the weights outside the blocks, then
    # block by block), the staging sized for the largest.
    push = facts.largest_copy_back_push(frozenset(streamed_blocks(cfg, len(facts.block_numels))))
    foreach = 0.0 if cfg.memory.host_optimizer == "deepspeed" else \
        4.0 * facts.largest_call(cfg.optim.apply_groups, no_decay)
    # memory.zero_grad_landing: the streamed blocks' 16-bit gradients land in their homes, no buffers of their own.
    own_grad_buffers = numel - (sum(sizes) if half_grads and grads_land_in_homes(cfg) else 0)
    host = {"params": 4.0 * numel,
            "grads": float((c if half_grads else 4) * own_grad_buffers) * (2 if cfg.optim.delayed_update else 1),
            "optimizer state": facts.optimizer_state_bytes(cfg.optim.name),
            WEIGHT_STAGING: float(c * sum(sizes) + c * copy_back_staging(push)),
            "optimizer step temporaries": foreach + (4.0 * group if half_grads else 0.0)}
    staging = facts.staging_bytes(cfg)
    if staging:
        host["checkpoint staging"] = staging
    peak_device = resident_params + max(backward, held + buckets, forward)
    peak_host = sum(host.values())
    # One memory (a CPU device): the update's temporaries come after backward's bytes are gone,
    # except with the delayed update, whose host update runs beside the next forward/backward.
    temporaries = host["optimizer step temporaries"]
    shared = peak_device + peak_host if cfg.optim.delayed_update else \
        resident_params + peak_host - temporaries + max(backward, held + buckets, forward, temporaries)
    return MemoryReport(device=device, host=host, peak_device=peak_device, peak_host=peak_host, peak_shared=shared)
