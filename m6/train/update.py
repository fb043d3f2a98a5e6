"""The one owner of everything between the step's backwards and the next forward: gradient sync,
CPU offload, clipping to the global norm, the (group-wise) optimizer update and the LR schedule.

    update.begin_micro_batch(last=i == n - 1)   # only the last backward communicates
    update.backward(loss)                       # fp16: of loss x the loss scale
    update.finish()                             # reduced gradients, on the host when offloaded
    norm = update.clip(max_norm)                # fp16: unscaled here, in the clip's multiply
    update.step(apply=finite)                   # update (unless skipped), zero grads, next lr (and loss scale)

With optim.delayed_update, ``step`` launches the host update in the background
(m6.memory.delayed_update) and the next step's ``finish`` waits for it and copies its weights to
the device: the forward/backward in between runs on the weights from before that update.

The collaborators are wired here once, not per step: the sync hands each bucket's final gradients
to offload, and clipping and the update run on whichever tensors hold them (device params, or
their host masters when offloaded).
"""

from __future__ import annotations

import math
import socket
from typing import Callable

import torch
import torch.distributed as dist

from m6.config import Config, ConfigError, fsdp_shards
from m6.memory import GroupedApply, build_offload
from m6.memory.delayed_update import DelayedUpdate
from m6.memory.home_grads import grads_land_in_homes
from m6.memory.host_optimizer import choose_host_optimizer, probe_cpu_adam, thread_note
from m6.memory.host_adafactor import choose_host_adafactor, probe_adafactor_op
from m6.memory.live_bytes import grad_bytes
from m6.memory.adamw_copy import AdamWWithCopy, choose_adamw_copy_kernel
from m6.memory.master_weights import MasterWeights
from m6.memory.offload_blocks import resolve_offload_blocks
from m6.memory.zero_partition import ZeroPartition, partition_line
from m6.model.param_groups import no_decay_ids
from m6.parallel import GradientSync, ShardedModel, clip_grad_norm
from m6.parallel.grad_sync import clip_coefficient, global_grad_norm
from m6.parallel.fsdp import ShardedGradientSync, clip_sharded_grad_norm
from m6.train.loss_scale import DynamicLossScale
from m6.train.optim import build_optimizer, build_scheduler


class ParameterUpdate:
    """Gradient sync + offload + grouped apply + schedule for this process's share of the model."""

    def __init__(self, sharded: ShardedModel, cfg: Config, device: torch.device,
                 log: Callable[[str], None] = lambda line: None, compute_dtype: torch.dtype = torch.float32) -> None:
        """``log``: where the host optimizer's lines go (its build, a fallback; rank 0 prints them);
        ``compute_dtype``: the forward's (memory.host_grad_dtype=compute keeps host gradients in it)."""
        model = sharded.model
        self.device = device
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.trainable = trainable
        # The most gradient bytes the model's parameters held at the end of one of this step's backwards.
        self.grad_bytes_after_backward = 0
        layout = sharded.groups.layout
        # Sharded (FSDP2) units reduce-scatter their own gradients: m6's all-reduce must not add them again.
        self.sharded_dp = fsdp_shards(cfg)
        # Sharded with offload: FSDP2's CPUOffloadPolicy (m6.parallel.fsdp) holds the shards, their
        # gradients and the optimizer state on the host, and the host optimizer steps them there;
        # m6's own offload (whole host masters per rank) is for unsharded runs.
        self.fsdp_offload = self.sharded_dp and cfg.memory.offload != "none"
        streamed = [] if self.sharded_dp else resolve_offload_blocks(
            cfg, model, no_decay_ids(model), layout.world_size, layout.expert_parallel_size, device, log)
        host_grad_dtype = compute_dtype if cfg.memory.host_grad_dtype == "compute" else torch.float32
        if cfg.memory.offload == "zero" and compute_dtype == torch.float32:
            raise ConfigError(f"memory.offload=zero with train.precision={cfg.train.precision}, which is fp32 on "
                              f"{device.type}: zero keeps 16-bit weights on the device; use train.precision=bf16 or fp16")
        # A pipeline rank streams the blocks of its own stages (the others are empty StageGaps).
        streamed = [i for i in streamed if any(True for _ in model.blocks[i].parameters())]
        # zero with parallel.shard=optimizer: each rank's host keeps its dim-0 chunks only.
        self.partition = ZeroPartition([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                                       {id(p) for p in sharded.expert_params.values()}, sharded.groups) \
            if cfg.memory.offload == "zero" and cfg.parallel.shard == "optimizer" else None
        self.offload = None if self.sharded_dp else build_offload(
            cfg.memory.offload, trainable, device, streamed_layers=[model.blocks[i] for i in streamed],
            grad_dtype=host_grad_dtype, separate_homes=cfg.optim.delayed_update, compute_dtype=compute_dtype,
            keep_fp32=[layer.router.weight for layer in model.moe_layers().values()],
            grads_in_homes=grads_land_in_homes(cfg), partition=self.partition)
        if self.partition is not None:
            log(partition_line(self.partition, self.offload, sharded.groups.layout))
        if self.offload is not None and cfg.memory.offload == "zero":
            # The copy back overlaps the next forward: each block waits for its own weights only.
            self.offload.attach_block_copy_back(model, model.blocks)
        # train.weight_copy=per_step: bf16 module weights, fp32 masters here (config.py allows it only
        # unsharded, without offload). Built before the sync: its gradient hooks must run first.
        self.masters = MasterWeights(model, compute_dtype) if cfg.train.weight_copy == "per_step" else None
        # Parameters whose gradient stays on the device past the sync until finish's ``after_sync``
        # (hold_grads: the pipeline's tied token embedding, summed over its two stages first).
        self._held: set[int] = set()
        self.sync = ShardedGradientSync(model, sharded.stages or None) if self.sharded_dp else GradientSync(
            sharded, int(cfg.parallel.bucket_size_mb * 2**20),
            on_grads_final=self._grads_final if self.offload else None,
            grad_holder=self.masters.grad_holder if self.masters else None,
            partition=self.partition, on_chunks_final=self.offload.chunks_final if self.partition else None)
        # Tensor-parallel shards count once per tp group in the norm (tp 1: none).
        split = [p for n, p in sharded.replicated_params.items() if n in sharded.tensor_split]
        # Pipeline parallel, tied head: the last stage's copy of the token embedding is clipped and
        # updated like its first-stage original, and counted in the norm there only.
        copies = {"text_embed.tokens.weight"} if getattr(model, "tied_embedding_copy", False) else set()
        self.uncounted = [p for n, p in sharded.replicated_params.items() if n in copies]
        replicated = [p for n, p in sharded.replicated_params.items() if n not in sharded.tensor_split
                      and n not in copies]
        experts = list(sharded.expert_params.values())
        self.split, self.tensor_group = split, sharded.groups.tensor
        self.tensor_parallel_size = layout.tensor_parallel_size
        self.pipeline_group = sharded.groups.pipeline  # the norm spans every pipeline stage
        if self.offload:  # the host masters hold the gradients once offloaded: clip and update those
            replicated, experts = self.offload.masters_of(replicated), self.offload.masters_of(experts)
            self.uncounted = self.offload.masters_of(self.uncounted)
        # Where the gradients are after a backward (the per-step weight copy's masters, or the params).
        self.grad_holders = self.masters.masters_of(trainable) if self.masters else trainable
        if self.masters:  # so do the device masters of the per-step weight copy
            replicated, experts = self.masters.masters_of(replicated), self.masters.masters_of(experts)
        self.replicated, self.experts = replicated, experts
        self.expert_group = sharded.groups.expert
        self.world_group = sharded.groups.world
        # "deepspeed", "cpp" (m6's Adafactor) or "torch" for the host update when offloaded; None: on the device.
        self.host_optimizer = agree_on_host_optimizer(cfg.memory.host_optimizer, cfg.optim.name, sharded, log) \
            if self.offload or self.fsdp_offload else None
        if self.fsdp_offload and device.type != "cuda":
            log(f"parallel.shard={cfg.parallel.shard} with memory.offload={cfg.memory.offload} on a CPU device: the "
                f"shards are in host memory already (FSDP2 moves nothing); the host optimizer "
                f"({self.host_optimizer}) updates them")
        if self.offload or self.fsdp_offload:  # the host clips and updates: whichever optimizer, its threads matter
            note = thread_note(sharded.groups.layout.local_world_size)
            if note:
                log(note)
        masters = self.offload or self.masters
        # per_step with AdamW: the update writes the bf16 copies itself (m6.memory.adamw_copy).
        copies = self.masters.copies() if self.masters and cfg.optim.name == "adamw" else None
        self.optimizer = build_optimizer(model, cfg.optim, masters.master if masters else None,
                                         self.host_optimizer or "torch", copies=copies,
                                         copy_kernel=choose_adamw_copy_kernel(device, cfg.optim.implementation, compute_dtype))
        t = cfg.train
        self.loss_scale = DynamicLossScale(t.loss_scale_init, t.loss_scale_growth_interval, t.loss_scale_min) \
            if t.precision == "fp16" else None
        # zero: the groups update in forward order, each going back to the device as it finishes.
        forward_order = self.offload.masters_of(trainable) if cfg.memory.offload == "zero" and self.offload else ()
        self.apply = GroupedApply(self.optimizer, replicated + split + self.uncounted, experts, cfg.optim.apply_groups,
                                  forward_order)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.max_steps)
        # optim.delayed_update (config.py allows it with m6's unsharded offload): step t's host update
        # runs in the background during step t+1's forward/backward.
        self.delayed = DelayedUpdate(self.offload, cfg.optim.delayed_update_after) \
            if cfg.optim.delayed_update else None

    def weight_copy_line(self) -> str | None:
        """train.weight_copy=per_step: the banner's words (the copy, and which kernel writes it)."""
        if self.masters is None:
            return None
        update = self.optimizer.describe() if isinstance(self.optimizer, AdamWWithCopy) else \
            f"update: torch's {type(self.optimizer).__name__}, then one foreach copy to " \
            f"{str(self.masters.compute_dtype).removeprefix('torch.')}"
        return self.masters.describe(update)

    @property
    def lr(self) -> float:
        """The learning rate the next update uses."""
        return self.scheduler.get_last_lr()[0]

    def begin_micro_batch(self, last: bool) -> None:
        """Before a backward: only the step's last one reduces (and offloads) gradients; the
        others accumulate locally."""
        self.sync.enabled = last

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for one micro-batch; before the step's last one the gradient sync
        learns which parameters its graph reaches (every rank then reduces the same buckets in the
        same order, and may free each bucket's copy during backward). fp16: the loss is multiplied
        by the loss scale first, so small gradients stay above fp16's smallest normal number."""
        if self.loss_scale is not None:
            loss = loss * self.loss_scale.scale
        self.sync.prepare(loss)
        # Offload: a gradient no other rank shares leaves for the host in every training backward
        # (summed there in fp32), not only in the last; the trial backwards outside this method keep
        # theirs. 16-bit host gradients are not summed on the host (each add would round to 16
        # bits): with accumulation those gradients add up on the device in fp32, as the replicated
        # ones do, and leave once, final, in the last backward.
        self.sync.stream_local = self.offload is not None and not self.offload.half_grads
        try:
            loss.backward()
        finally:
            self.sync.stream_local = False
        self.grad_bytes_after_backward = max(self.grad_bytes_after_backward, grad_bytes(self.grad_holders))

    def hold_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Keep ``params``' gradients on the device after their reduction, until ``finish``'s
        ``after_sync`` has run (offload streams them then): a gradient that is still to be summed
        with another rank's outside the data-parallel sync (the pipeline's tied embedding)."""
        self._held.update(id(p) for p in params)

    def _grads_final(self, params: list[torch.nn.Parameter]) -> None:
        self.offload.grads_final([p for p in params if id(p) not in self._held])

    def finish(self, after_sync: Callable[[], None] = lambda: None) -> None:
        """After the last backward: gradients reduced, and on the host when offloaded (clipping
        needs the global norm before any group updates). ``after_sync`` runs once the sync is
        done, before the gradients still on the device leave for the host."""
        self.sync.finish()
        after_sync()
        if self.offload:
            self.offload.finish_backward()
        if self.delayed is not None:  # the last step's update is done and on the device; now this step's
            self.delayed.catch_up()
            self.offload.attach_grads()

    def clip(self, max_norm: float) -> float:
        """Clip to the norm of the global gradient (every expert counted once); returns it.
        ``max_norm`` <= 0 or inf: no clipping, the norm is still measured. fp16: the gradients are
        unscaled first (in the same multiply) and the norm is the unscaled one."""
        limit = max_norm if max_norm > 0 else math.inf
        scale = self.loss_scale.scale if self.loss_scale is not None else 1.0
        if self.sharded_dp:
            return clip_sharded_grad_norm(self.replicated + self.experts, limit, self.world_group, self.device,
                                          grad_scale=scale, uncounted=self.uncounted, split=self.split,
                                          copies=self.tensor_parallel_size)
        if self.partition is not None:
            return self._clip_partitioned(limit, scale)
        if self.offload is not None and self.offload.half_grads:
            # 16-bit host gradients: the norm from the buffers (summed in float64); the unscale and
            # the clip wait for the update, which reads each group back in fp32 (an fp16 unscale in
            # fp16 would flush small gradients to zero).
            off = self.offload
            total = global_grad_norm(off.host_grads(self.replicated), off.host_grads(self.experts), self.expert_group,
                                     self.device, off.host_grad_factors(self.replicated),
                                     off.host_grad_factors(self.experts), pipeline_group=self.pipeline_group) / scale
            self.offload.grad_multiplier = clip_coefficient(total, limit) / scale
            return total
        return clip_grad_norm(self.replicated, self.experts, limit, self.expert_group, self.device, grad_scale=scale,
                              split=self.split, tensor_group=self.tensor_group, pipeline_group=self.pipeline_group,
                              uncounted=self.uncounted)

    def _clip_partitioned(self, limit: float, scale: float) -> float:
        """zero partitioned: every element of the global gradient lies in one rank's host chunks
        (a split parameter's rows over its group; an unsplit expert on its one EP rank), so one
        sum of squares over the world is the squared norm, and an inf/nan in any rank's chunk
        reaches every rank's norm (the fp16 overflow skip, agreed)."""
        off, masters = self.offload, self.replicated + self.experts
        total = global_grad_norm([], off.host_grads(masters), self.world_group, self.device,
                                 expert_factors=off.host_grad_factors(masters)) / scale
        coef = clip_coefficient(total, limit)
        if off.half_grads:  # applied as the update reads each group back in fp32
            off.grad_multiplier = coef / scale
        elif math.isfinite(total) and (coef < 1.0 or scale != 1.0):
            for g in off.host_grads(masters):
                g.mul_(coef / scale)
        return total

    def overflow_is_normal(self) -> bool:
        """Whether a non-finite gradient now is the loss scale's normal search (fp16, scale above
        its floor): the step is skipped and the scale backs off, but it is not a bad step."""
        return self.loss_scale is not None and not self.loss_scale.at_floor

    def step(self, apply: bool = True) -> None:
        """Update the weights (``apply=False``: skip a non-finite step), drop the gradients, and
        advance the schedule (the lr follows the step count, skipped steps included) and, under
        fp16, the loss scale (a skipped step backs it off: the same on every rank, as ``apply`` is)."""
        if self.loss_scale is not None:
            self.loss_scale.update(overflow=not apply)
        step = self.scheduler.last_epoch + 1  # this step, counted from 1 (the schedule's position travels in checkpoints)
        if apply and self.delayed is not None and self.delayed.is_delayed(step):
            # The thread advances the schedule after its update: the rate it reads is this step's.
            self.grad_bytes_after_backward = 0
            self.delayed.launch(step, lambda: (self.offload.background_step(self.apply), self.scheduler.step()))
            return
        if apply:
            if self.offload:
                self.offload.step(self.apply)
            else:
                self.apply.step()
            if self.masters and not isinstance(self.optimizer, AdamWWithCopy):  # Adafactor: one copy pass
                self.masters.write_compute_weights()
        self.zero_grad()
        self.scheduler.step()

    def wait(self) -> None:
        """Delayed update: wait for the update in flight (the device keeps its weights); before a
        checkpoint reads the optimizer state and the masters, and at the run's end."""
        if self.delayed is not None:
            self.delayed.wait()
        if self.offload is not None:  # zero: the copies back are in place before the weights are read
            self.offload.settle_weights()

    def zero_grad(self) -> None:
        if self.delayed is not None:  # an update in flight reads the masters' gradients: never drop them under it
            self.delayed.wait()
        self.grad_bytes_after_backward = 0
        self.optimizer.zero_grad(set_to_none=True)
        if self.offload:
            self.offload.zero_grad()

    def optimizer_names(self, model: torch.nn.Module) -> dict[int, str] | None:
        """Offload or the per-step weight copy: the optimizer updates masters, named after their model
        parameters (so checkpoints index optimizer state by parameter name); None: the model's own params."""
        masters = self.offload or self.masters
        return masters.master_names(model) if masters else None


def agree_on_host_optimizer(choice: str, optimizer_name: str, sharded: ShardedModel,
                            log: Callable[[str], None]) -> str:
    """``memory.host_optimizer`` resolved the same on every rank: replicated weights stay identical
    only if every rank updates them with the same optimizer, so one rank whose DeepSpeed op fails
    sends all of them to torch (auto) or to the config error (deepspeed). One collective.
    ``optim.name=adafactor``: m6's C++ Adafactor ("cpp") where its op builds on every rank, else
    torch's (DeepSpeed's op is Adam only; config.py refuses deepspeed)."""
    if choice == "torch":
        return "torch"
    adafactor = optimizer_name == "adafactor"
    failure = probe_adafactor_op(log) if adafactor else probe_cpu_adam(log)
    groups = sharded.groups
    world = groups.layout.world_size
    if world == 1:
        failures = {} if failure is None else {0: failure}
    else:
        everyone: list = [None] * world
        mine = None if failure is None else f"host {socket.gethostname()}: {failure}"
        dist.all_gather_object(everyone, mine, group=groups.checkpoint)
        failures = {r: f for r, f in enumerate(everyone) if f is not None}
    if adafactor:
        return choose_host_adafactor(choice, failures, log)
    return choose_host_optimizer(choice, failures, log)
