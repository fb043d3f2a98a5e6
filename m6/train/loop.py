"""The pretraining loop: data -> forward/backward (with accumulation) -> clip -> update ->
metrics, eval, checkpoints. ``Trainer.train_step`` reads top to bottom; the collaborators it
calls each own one concern (m6.parallel builds the model's share, ParameterUpdate everything from
the last backward to the next forward, ActivationMemory the recompute plan, TrainingState what a
checkpoint holds)."""

from __future__ import annotations

import dataclasses
import math
import random
import time
from contextlib import nullcontext
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from m6.config import Config, ConfigError, dump_yaml, fsdp_shards, num_patches, run_dir, to_dict
from m6.data.batch import MultimodalBatch, Sample
from m6.data.pipeline import build_training_data
from m6.data.record_dataset import LoadedItem
from m6.memory import ActivationMemory
from m6.model.cast_on_use import set_cast_on_use
from m6.model.flops import count_parameters, forward_flop_rates
from m6.parallel import build_parallel, join_job
from m6.parallel.compile import compile_seconds
from m6.parallel.layout import data_parallel_coordinates
from m6.parallel.speed_probe import (resolved_expert_parallel_size, speed_probe_model, speeds_size_experts,
                                    times_a_probe)
from m6.parallel.peer_check import PeerWatch
from m6.model import build_meta_model
from m6.train.balance import (BatchPlan, balance_line, finite_or_error, gather_objects, local_routing_stats,
                              measure_speed, plan_batch, rows_that_fit_layout, split_notes)
from m6.train.banner import RunFacts, checkpoint_line, compile_time_line, device_label, end_line, startup_banner
from m6.checkpoint import CheckpointManager, SavedCheckpoint, agree_on_resume, init_from_checkpoint, resolve_resume
from m6.train.compute_timer import ComputeTimer
from m6.train.determinism import use_determinism
from m6.train.eval import evaluate_captions, rank_slice
from m6.train.expert_bias import ExpertBiasUpdate
from m6.train.loggers import MetricsLogger, resolve_wandb_mode
from m6.train.loss import aux_loss_ranks, forward_loss_sums, micro_batch_loss
from m6.train.metrics import device_peak_tflops, expert_load
from m6.train.optim import schedule_change_note
from m6.train.no_target_steps import NoTargetSteps
from m6.train.preemption import StopOnSignal
from m6.train.pseudo_to_real import train_pseudo_to_real
from m6.train.resume_fit import check_steps_left, nothing_to_train_line
from m6.train.run_directory import prepare_run_dir
from m6.train.step_metrics import StepMetrics
from m6.train.step_scalars import StepLosses, StepReduction
from m6.train.state import ModelState, OptimizerState, SkipLedger, TrainerCounters, TrainingState
from m6.train.tensorboard_writer import require_tensorboard
from m6.train.update import ParameterUpdate


_OPTIMIZER_NAMES = {"torch": "torch's optimizer", "deepspeed": "DeepSpeed's CPU Adam", "cpp": "m6's C++ Adafactor"}


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite steps; the last good checkpoint is left untouched."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' requested but this machine has no usable CUDA device "
                          f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use auto or cpu")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype, or None for plain fp32. auto = bf16 on CUDA, fp32 on CPU."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if precision == "fp16":
        return torch.float16
    return torch.bfloat16 if precision in ("bf16", "bf16-autocast") else None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Owns the model, its update, the data position and the outputs of one run.

    ``Trainer(cfg).fit()`` trains on the configured data; ``dataset`` (a map-style sequence of
    m6.data.batch.Sample, picklable when data.num_workers > 0) replaces data.kind/data.sources, and
    ``eval_samples`` (image-caption Samples) feed the caption-loss eval."""

    def __init__(self, cfg: Config, dataset: Sequence[Sample] | None = None,
                 eval_samples: Sequence[Sample] | None = None) -> None:
        self.cfg = cfg
        self.env = join_job(cfg.parallel.timeout_s)
        self.rank, self.world_size = self.env.rank, self.env.world_size
        # Batches are split over the data-parallel ranks: all of them, or world / tp at tensor
        # parallel, where a tp group's ranks read the same batch (m6.parallel.layout).
        # ... and at pipeline parallel every stage of a pipeline reads its batch.
        self.tp_size, self.pp_size = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
        self.data_rank, self.data_world = data_parallel_coordinates(self.world_size, self.rank, self.tp_size,
                                                                    self.pp_size)
        # Names a dead or hung peer even while this rank's main thread waits inside a device sync.
        self.peer_watch = PeerWatch.for_job(self.rank, self.world_size, cfg.parallel.timeout_s) \
            if self.world_size > 1 else None
        self.is_main = self.rank == 0
        self.device = resolve_device(cfg.train.device)
        # Before the model's first matmul: cuBLAS reads its workspace setting when it starts.
        self._restore_determinism = use_determinism(cfg.train.deterministic)
        if cfg.logging.wandb.enabled and self.is_main:
            resolve_wandb_mode(cfg.logging.wandb.mode)  # pre-flight: no credentials fails now, not after setup
        if cfg.logging.tensorboard.enabled:
            require_tensorboard()  # pre-flight on every rank: a missing package fails now, on all of them
        if self.device.type == "cuda" and self.world_size > 1:
            self.device = torch.device("cuda", self.env.local_rank)
        self.autocast_dtype = resolve_precision(cfg.train.precision, self.device)
        # bf16, fp16 (and auto on CUDA) = cast-on-use; bf16-autocast = plain autocast, kept to compare.
        self.cast_on_use = self.autocast_dtype is not None and cfg.train.precision != "bf16-autocast"
        # parallel.balance: the split of the global batch (auto: measured once the model is built).
        self.batch_plan = None if cfg.parallel.balance == "auto" else plan_batch(cfg, self.data_world)
        self.aux_ranks = aux_loss_ranks(cfg.model.moe.aux_loss_scope, self.data_world)
        seed_everything(cfg.run.seed)
        self.run_dir = Path(run_dir(cfg))
        prepare_run_dir(self.run_dir)  # every rank: each writes its checkpoint shards there

        self.data = build_training_data(cfg, self.data_rank, self.data_world, pin_memory=self.device.type == "cuda",
                                        dataset=dataset, eval_samples=eval_samples)
        self.dataset_name = None if dataset is None else type(dataset).__name__
        self.loader, self.eval_set = self.data.loader, self.data.eval_set
        self.skips = SkipLedger(self.data.index_skips, self.all_reduce_sum, self.rank)
        if self.is_main:
            self.skips.report(self.data.index_skips, "at start-up (indexing data.sources and the eval hold-out)")
        self.no_targets = NoTargetSteps(self.skips.by_reason, cfg.data.seq_len, cfg.train.max_steps)

        # optimizer+params keeps the blocks' weights on the host: initialise there, so the device
        # never holds the whole model (m6.memory.offload moves the rest to the device); zero takes
        # its fp32 masters there and sends the device only 16-bit weights.
        init_device = torch.device("cpu") if cfg.memory.offload in ("optimizer+params", "zero") else self.device
        # Sharded: FSDP2 gathers bf16 copies of the weights (its MixedPrecisionPolicy), in place of cast-on-use.
        self.fsdp_bf16 = self.cast_on_use and fsdp_shards(cfg)
        # parallel.balance=auto at expert parallelism or under parallel.shard: the speeds are measured
        # first, on a probe of this rank's compute (m6.parallel.speed_probe); without shard they lay
        # out the experts too.
        layout_cfg, ep = cfg, resolved_expert_parallel_size(cfg, self.env) if cfg.parallel.balance == "auto" else 1
        if times_a_probe(cfg, ep):
            self.batch_plan = self._probe_balance(ep)
        if speeds_size_experts(cfg, ep):
            layout_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(
                cfg.parallel, balance=list(self.batch_plan.speeds)))
        self.sharded = build_parallel(layout_cfg, self.device, self.env, init_device,
                                      param_dtype=self.autocast_dtype if self.fsdp_bf16 else None)
        self.model = self.sharded.model
        set_cast_on_use(self.model, self.cast_on_use and not self.fsdp_bf16)
        # At pipeline parallel the stages recompute their own blocks (m6.train.pipeline_step).
        self.activations = ActivationMemory(self.model, cfg.memory if self.pp_size == 1 else dataclasses.replace(
            cfg.memory, activation_checkpointing="none"), self.device, self.autocast_dtype, log=self._print_main)
        self.update = ParameterUpdate(self.sharded, cfg, self.device, log=self._print_main,
                                      compute_dtype=self.autocast_dtype or torch.float32)
        # The batch plan fixes the micro-batch counts the loader, train_step and the banner read.
        # ParameterUpdate reads none (16-bit host gradients accumulate on the device at any count),
        # and parallel.balance=auto at EP 1 times the model as the run holds it (offloaded, its
        # gradient sync off), so the plan is completed here, after the update.
        self._use_batch_plan(self.batch_plan or self._measure_balance())
        self.expert_bias = ExpertBiasUpdate(self.model.moe_layers(), self.sharded.groups.data, self.device)
        self.pipeline = None
        if self.pp_size > 1:  # imported here: torch's pipelining loads dynamo (~1 s), which other runs skip
            from m6.train.pipeline_step import PipelineStep
            self.pipeline = PipelineStep(self.sharded, cfg, self.update, self.expert_bias, self.device, self.accum,
                                         self.aux_ranks, log=self._print_main)
        self.size = count_parameters(build_meta_model(cfg.model))  # the whole model: every rank's experts
        # The whole model's rates: a tensor-parallel rank's blocks hold 1/tp of the heads and FFN.
        # The whole model's rates: a tensor-parallel rank's blocks hold 1/tp of the heads and FFN, a
        # pipeline rank its stages' blocks.
        self.flop_rates = forward_flop_rates(self.model if self.tp_size == self.pp_size == 1
                                             else build_meta_model(cfg.model))
        self.peak_tflops = device_peak_tflops(self.device, self.autocast_dtype or torch.float32, cfg.train.peak_tflops)

        self.counters = TrainerCounters()
        # The step's bookkeeping: its compute time, its one scalar all-reduce, its metrics row.
        self.compute_timer = ComputeTimer(self.device, self.data_rank, self.data_world)
        self.step_reduction = StepReduction(self.model, self.flop_rates, num_patches(cfg.model))
        self.step_metrics = StepMetrics(cfg.train.global_batch_size, self.device, self.peak_tflops, self.world_size,
                                        self.step_reduction.has_expert_exchange)
        layout = self.sharded.groups.layout
        self.state = TrainingState(
            ModelState(self.sharded, self.update.offload, self.update.delayed, self.update.masters),
            OptimizerState(self.sharded, self.update.optimizer, self.update.optimizer_names(self.model),
                           self.update.partition),
            {"scheduler": self.update.scheduler, "data": self.loader, "counters": self.counters, "skips": self.skips,
             **({"loss_scale": self.update.loss_scale} if self.update.loss_scale is not None else {})},
            rank=self.rank, optional={"loss_scale"},
            metadata={"config": to_dict(cfg), "world_size": self.world_size,
                      "expert_parallel_size": layout.expert_parallel_size,
                      "host_optimizer": self.update.host_optimizer})
        self.checkpoints = CheckpointManager(self.run_dir, cfg.checkpoint.keep, self.rank,
                                             self.sharded.groups.checkpoint)
        self.checkpoints.on_saved = self._say_saved
        self.checkpoints.sweep_temporaries()  # rank 0, before any rank writes (the first save follows a step)
        self.start = "fresh start"
        resume_from = agree_on_resume(resolve_resume(cfg.checkpoint.resume, self.checkpoints, self._print_main),
                                      self.rank, self.world_size, self.sharded.groups.checkpoint)
        self.resumed_from = resume_from
        if resume_from is not None:
            self._restore(resume_from)
            check_steps_left(self.step, cfg.train.max_steps, resume_from)
        elif self.checkpoints.latest() is not None:
            self._print_main(f"checkpoint.resume={cfg.checkpoint.resume}: starting fresh in {self.run_dir}, which "
                             f"holds checkpoints of an earlier run (latest {self.checkpoints.latest().name}); this "
                             f"run's saves replace them")
        if cfg.checkpoint.init_from is not None and resume_from is not None:
            self._print_main(f"checkpoint.init_from={cfg.checkpoint.init_from} not used: resuming from {resume_from} "
                             f"(resume wins)")
        elif cfg.checkpoint.init_from is not None:
            init_from_checkpoint(cfg.checkpoint.init_from, self.state.model, self.checkpoints.group, self._print_main)
        if self.is_main:  # once the checkpoint is known to fit: a refused run leaves the run dir's config alone
            dump_yaml(cfg, self.run_dir / "config.yaml")
        self.logger = MetricsLogger(self.run_dir, to_dict(cfg), cfg.logging.wandb, cfg.train.max_steps,
                                    console=cfg.logging.console, is_main_process=self.is_main,
                                    tensorboard=cfg.logging.tensorboard, resumed_step=self.step)
        self.history: list[dict] = []
        self.last_saved_step: int | None = None
        # train.compile: torch.compile's seconds so far (the process's), and whether a step reported any.
        self._compile_s_seen, self._compile_reported = compile_seconds(), False
        self._print_main(startup_banner(cfg, self._facts()))

    def _facts(self) -> RunFacts:
        precision = "fp32" if self.autocast_dtype is None else (
            "bf16 (FSDP2 gathers bf16)" if self.fsdp_bf16 else
            f"bf16 ({self.update.weight_copy_line()})" if self.update.masters else
            "bf16 (cast-on-use)" if self.cast_on_use else "bf16 (autocast)")
        if self.update.loss_scale is not None:
            how = "FSDP2 gathers fp16" if self.fsdp_bf16 else \
                self.update.weight_copy_line() if self.update.masters else "cast-on-use"
            precision = f"fp16 ({how}), {self.update.loss_scale.describe()}"
        return RunFacts(
            world_size=self.world_size, expert_parallel_size=self.sharded.groups.layout.expert_parallel_size,
            micro_batch=self.micro_batch, accumulation=self.accum, device=self.device, precision=precision,
            size=self.size, moe_blocks=[int(name.removeprefix("block")) for name in self.model.moe_layers()],
            source_records=self.data.source_records, held_out=self.data.held_out, eval_samples=len(self.eval_set),
            tokenizer=f"{self.cfg.data.tokenizer or 'byte'} (vocab {self.data.tokenizer.vocab_size:,})",
            run_dir=self.run_dir.resolve(), start=self.start, wandb=self.logger.wandb_mode,
            user_dataset=self.dataset_name, tensorboard=self.logger.tensorboard_dir, balance=self.balance_line)

    def _measure_balance(self) -> BatchPlan:
        """parallel.balance=auto without expert parallelism: time this rank's model on a micro-batch
        of the run's shape, agree on all ranks' speeds (one all-gather) and plan the split from them."""
        def forward_backward(batch: MultimodalBatch) -> None:  # gradients kept local, dropped below
            self.update.begin_micro_batch(last=False)
            lm_sum, aux = self.forward_loss(batch)
            micro_batch_loss(lm_sum, aux, max(batch.num_target_tokens, 1), 1).backward()

        with local_routing_stats(self.model):
            plan = self._timed_plan(forward_backward, 1)
        self.update.zero_grad()
        return plan

    def _probe_balance(self, expert_parallel_size: int) -> BatchPlan:
        """parallel.balance=auto at expert parallelism or under parallel.shard: the same timing on a
        probe of this rank's compute (unsharded, its experts at the even layout, the all-to-all looped
        back: m6.parallel.speed_probe), so each rank is timed alone; the probe is dropped before the
        real model is built."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            probe = speed_probe_model(self.cfg, self.env, expert_parallel_size, self.device)
        set_cast_on_use(probe, self.cast_on_use and self.cfg.parallel.shard == "none")

        def forward_backward(batch: MultimodalBatch) -> None:
            lm_sum, aux = forward_loss_sums(probe, batch, self._autocast())
            micro_batch_loss(lm_sum, aux, max(batch.num_target_tokens, 1), 1).backward()

        plan = self._timed_plan(forward_backward, expert_parallel_size)
        del probe
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return plan

    def _timed_plan(self, forward_backward, expert_parallel_size: int) -> BatchPlan:
        """Speed of ``forward_backward`` on a micro-batch of the run's shape, every rank's (one
        all-gather), this rank's memory cap at the layout those speeds give, every rank's (another),
        and the split planned from them."""
        t = self.cfg.train
        rows = t.micro_batch_size or math.ceil(t.global_batch_size / self.world_size)
        batch = self.to_device(self.loader.sample_batch(rows).batch)
        # The timed passes draw no numbers from the run's generators: a run's curve does not depend on them.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            speed = measure_speed(lambda: forward_backward(batch), rows, self.device)
        speeds = finite_or_error(gather_objects(speed, self.world_size))
        # A GPU's share is capped by what its memory holds (the memory estimate, for the experts this
        # rank will hold: the speeds may give it more than it was timed with); host memory is not capped.
        cap = rows_that_fit_layout(self.cfg, self.env, expert_parallel_size, speeds,
                                   torch.cuda.get_device_properties(self.device).total_memory,
                                   accumulates=t.micro_batch_size is not None) if self.device.type == "cuda" else None
        caps = gather_objects(cap, self.world_size)
        return plan_batch(self.cfg, self.world_size, speeds, caps=None if None in caps else list(caps))

    def _use_batch_plan(self, plan: BatchPlan) -> None:
        self.batch_plan, self.micro_batch, self.accum = plan, plan.max_micro_batch, plan.num_micro
        self.balance_line = None
        if plan.mode != "even":
            self.loader.set_shares(plan.shares, plan.num_micro)
            layout = self.sharded.groups.layout
            experts = None if layout.expert_parallel_size == 1 else layout.expert_ranges_by_rank()
            self.balance_line = balance_line(plan, gather_objects(device_label(self.device), self.world_size), experts)
            for note in split_notes(self.cfg, plan):
                self._print_main(note)

    @property
    def step(self) -> int:
        return self.counters.step

    def _print_main(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum scalars over the data-parallel ranks (one collective, on the compute device); identity
        on one process. At tensor parallel the ranks of a tp group hold the same values (one batch,
        replicated losses): the sum over all ranks counts each tp group tp times; so at pipeline
        parallel, whose stages agree on the step's values (m6.train.pipeline_step), each pipeline pp times."""
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        copies = self.tp_size * self.pp_size
        return (t / copies).tolist() if copies > 1 else t.tolist()

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        # Cast-on-use ops keep no weight copy; an uncached autocast keeps none for the forward either.
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=not self.cast_on_use)

    def forward_loss(self, batch: MultimodalBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of target-token cross-entropy, summed MoE aux loss) for one micro-batch."""
        return forward_loss_sums(self.model, batch, self._autocast())

    # ---- one optimizer step -------------------------------------------------------------------
    def train_step(self) -> dict:
        """Forward/backward over the accumulation micro-batches, clip, and update (unless non-finite)."""
        t0 = time.perf_counter()
        self.model.train()
        loaded, data_wait = self.loader.next_step()
        batches = [lb.batch.to(self.device, non_blocking=True) for lb in loaded]
        new_skips = self.skips.count(loaded, self.step + 1)
        (num_targets,) = self.all_reduce_sum([float(sum(b.num_target_tokens for b in batches))])
        self.no_targets.check(num_targets, self.step + 1)  # every record skipped, step after step: stop
        self._ensure_recompute_plan(batches[0], num_targets)
        self.compute_timer.start()
        if self.pipeline is not None:  # the micro-batches through the pipeline's schedule, gradients reduced
            local = self.pipeline.step(batches, num_targets, self._autocast(), self.all_reduce_sum,
                                       on_compute_done=self.compute_timer.stop)
        else:
            losses = StepLosses(self.model)
            for i, batch in enumerate(batches):
                self.update.begin_micro_batch(last=i == len(batches) - 1)
                with self.activations.micro_batch(batch.num_target_tokens,
                                                  measure=self.is_logging_step(self.step + 1)):
                    lm_sum, aux = self.forward_loss(batch)
                self.update.backward(micro_batch_loss(lm_sum, aux, num_targets, self.accum, self.aux_ranks))
                self.expert_bias.add_micro_batch()
                losses.add(lm_sum, aux)
            self.compute_timer.stop()  # before the gradient sync's wait for the other ranks
            self.update.finish()
            local = losses.read(self.accum, self.aux_ranks, self.all_reduce_sum)  # the step's one host sync
        grad_norm = self.update.clip(self.cfg.train.grad_clip)
        totals = self.step_reduction.reduce(self.all_reduce_sum, loaded, local, new_skips, grad_norm,
                                            self.compute_timer.rank_slots())
        self.skips.total += totals.new_skips
        lr, grad_mb = self.update.lr, self.update.grad_bytes_after_backward / 2**20  # before step() drops them
        loss_finite = math.isfinite(totals.lm_sum) and math.isfinite(local.aux)
        grads_finite = not totals.overflow_ranks and math.isfinite(grad_norm)  # on every rank
        # fp16: an overflow is the loss scale's search (skip, back off), a bad step only at its floor.
        bad = not loss_finite or (not grads_finite and not self.update.overflow_is_normal())
        self.update.step(apply=loss_finite and grads_finite)
        self.expert_bias.step(apply=loss_finite and grads_finite)
        self._count_step(skipped=not (loss_finite and grads_finite), bad=bad)
        self.compute_timer.end_step()  # CUDA: the step's kernels done before the clock is read
        return self.step_metrics.row(local, totals, num_targets, lr, grad_norm, grad_mb, time.perf_counter() - t0,
                                     data_wait, self.counters.skipped_steps, self.skips.total,
                                     self.activations.end_step(self.step), self.update.loss_scale)

    def _ensure_recompute_plan(self, batch: MultimodalBatch, num_targets: float) -> None:
        """First step only: choose what to recompute (memory.activation_checkpointing)."""
        if not self.activations.enabled or self.activations.plan is not None:
            return

        def forward_backward() -> None:  # a real micro-batch, gradients kept local
            self.update.begin_micro_batch(last=False)
            lm_sum, aux = self.forward_loss(batch)
            micro_batch_loss(lm_sum, aux, num_targets, self.accum, self.aux_ranks).backward()

        densest = batch.densest()
        self.activations.ensure_plan(lambda: self.forward_loss(densest), forward_backward,
                                     densest.num_target_tokens, dist.group.WORLD if self.world_size > 1 else None)

    def is_logging_step(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) logs its metrics: every logging.every, and the last."""
        return step % self.cfg.logging.every == 0 or step == self.cfg.train.max_steps

    def _count_step(self, skipped: bool, bad: bool) -> None:
        """Advance the counters; stop after train.max_bad_steps consecutive bad steps (non-finite;
        under fp16 an overflow counts only at the loss scale's floor)."""
        c = self.counters
        c.step += 1
        c.bad_steps = c.bad_steps + 1 if bad else 0
        c.skipped_steps += 1 if skipped else 0
        if c.bad_steps and c.bad_steps >= self.cfg.train.max_bad_steps:
            raise TrainingDiverged(
                f"{c.bad_steps} consecutive steps had a non-finite loss or gradient (last at step "
                f"{c.step}, limit train.max_bad_steps={self.cfg.train.max_bad_steps}); stopping. "
                f"The last good checkpoint is {self.checkpoints.latest() or 'none (none was saved yet)'}."
            )

    # ---- evaluation -----------------------------------------------------------------------------
    def held_out_batch(self, indices: list[int], on_device: bool = True) -> MultimodalBatch:
        """Held-out samples ``indices`` (of the eval set), collated on the host and moved to the
        device unless ``on_device`` is False."""
        batch = self.data.collator([LoadedItem(self.eval_set[i]) for i in indices]).batch
        return self.to_device(batch) if on_device else batch

    def to_device(self, batch: MultimodalBatch) -> MultimodalBatch:
        """A host batch on the compute device; on CUDA copied from pinned memory asynchronously (a
        copy from pageable memory, or a blocking one, would make the host wait for the device)."""
        if self.device.type != "cuda":
            return batch.to(self.device)
        return batch.pin_memory().to(self.device, non_blocking=True)

    def evaluate(self) -> dict:
        """Caption loss on held-out image samples with their true and with shuffled images."""
        self.model.eval()
        if self.pipeline is not None:  # through the pipeline's stages
            loss_sum = lambda batch: self.pipeline.eval_loss_sum(self.to_device(batch), self._autocast())  # noqa: E731
        else:
            loss_sum = lambda batch: self.forward_loss(self.to_device(batch))[0]  # noqa: E731
        try:
            return evaluate_captions(
                loss_sum=loss_sum,
                eval_batch=lambda indices: self.held_out_batch(indices, on_device=False),
                num_samples=len(self.eval_set), global_batch_size=self.cfg.train.global_batch_size,
                num_batches=self.cfg.train.eval_batches, micro_batch_size=self.micro_batch,
                rank_slice=lambda idx: rank_slice(idx, self.data_rank, self.data_world),
                reduce_sum=self.all_reduce_sum, seed=self.cfg.run.seed)
        finally:
            self.model.train()

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, wait: bool = False) -> Path:
        """Every rank writes its own share of the checkpoint of this step, in parallel (a
        collective). With checkpoint.async_save the files are written in the background unless
        ``wait``; a save still running is finished first. Returns the step directory."""
        self.update.wait()  # delayed update: the state after this step's update, the device weights unchanged
        state, shards = self.state.state_dict()  # collectives inside: every rank
        path = self.checkpoints.save(self.step, state, shards, asynchronous=self.cfg.checkpoint.async_save)
        self.last_saved_step = self.step
        if self.checkpoints.last_wait_s > 0.05:
            self._print_main(f"checkpoint: waited {self.checkpoints.last_wait_s:.1f} s for the previous save to "
                             f"finish writing before saving step {self.step}")
        if wait:
            self.checkpoints.wait()
        return path

    def _restore(self, path: Path) -> None:
        meta = self.state.load(self.checkpoints, path)
        saved_world = meta.get("world_size", 1)
        rng = "" if saved_world == self.world_size else (
            "; RNG streams are per rank, so at another world size they restart from the run seed")
        auto = ", chosen by checkpoint.resume=auto (the run dir's latest)" \
            if str(self.cfg.checkpoint.resume).strip().lower() == "auto" else ""
        saved_tp = meta.get("config", {}).get("parallel", {}).get("tensor_parallel_size", 1)
        tp = "" if saved_tp == self.tp_size == 1 else f", tensor-parallel size {saved_tp} -> {self.tp_size}"
        saved_pp = meta.get("config", {}).get("parallel", {}).get("pipeline_parallel_size", 1)
        tp += "" if saved_pp == self.pp_size == 1 else f", pipeline-parallel size {saved_pp} -> {self.pp_size}"
        self.start = (f"resumed from {path} at step {self.step} (saved at world size {saved_world}, "
                      f"expert-parallel size {meta.get('expert_parallel_size', 1)}; now {self.world_size}, "
                      f"{self.sharded.groups.layout.expert_parallel_size}{tp}{rng}){auto}")

        note = schedule_change_note(self.cfg.optim, meta.get("config", {}).get("train", {}).get("max_steps"),
                                    self.cfg.train.max_steps, self.step)
        if note:
            self._print_main(note)
        if "loss_scale" in self.state.missing:
            self._print_main(f"the checkpoint holds no loss scale (its run was not fp16): the scale starts at "
                             f"train.loss_scale_init={self.cfg.train.loss_scale_init:g}")
        # torch's AdamW on the device (no offload) and on the host are the same kernels; DeepSpeed's
        # CPU Adam keeps the same state layout but rounds differently.
        saved_host, host = meta.get("host_optimizer") or "torch", self.update.host_optimizer or "torch"
        if saved_host != host:
            self._print_main(f"the checkpoint was saved by {_OPTIMIZER_NAMES[saved_host]}, this run updates with "
                             f"{_OPTIMIZER_NAMES[host]}: the optimizer state carries over, the updates round "
                             "differently (not bitwise the run the saving optimizer would have made)")

    def _say_saved(self, saved: SavedCheckpoint) -> None:
        self._print_main(checkpoint_line(saved.step, saved.path.resolve(), saved.nbytes, saved.seconds, saved.asynchronous))

    # ---- the loop ---------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> list[dict]:
        """Train to train.max_steps (or to step ``stop_at``, with a checkpoint there, the schedule
        still that of max_steps); returns the per-step metrics of this process's steps."""
        cfg = self.cfg
        started, first_step = time.perf_counter(), self.step
        stop = StopOnSignal(self.sharded.groups.checkpoint if self.world_size > 1 else None)
        end = cfg.train.max_steps if stop_at is None else stop_at
        try:
            if self.step >= end:
                self._print_main(nothing_to_train_line(self.step, end, self.resumed_from))
                self.checkpoints.close()
                if self.peer_watch is not None:
                    self.peer_watch.stop(finished=True)
                return self.history
            while self.step < end:
                metrics = self.train_step()
                self.history.append({"step": self.step, **metrics})
                last = self.step == end
                if self.is_logging_step(self.step):
                    load_scalars, load_counts = expert_load(self.model.moe_layers())
                    bias_scalars, biases = self.expert_bias.log_values()
                    if self.pipeline is not None:  # every stage's layers
                        load_scalars, load_counts, bias_scalars, biases = self.pipeline.gather_over_stages(
                            load_scalars, load_counts, bias_scalars, biases)
                    self.logger.log(self.step, {**metrics, **load_scalars, **bias_scalars}, expert_tokens=load_counts,
                                    expert_bias=biases)
                self._report_compile(metrics["step_time_s"])
                if ((cfg.train.eval_every and self.step % cfg.train.eval_every == 0) or last) and len(self.eval_set):
                    self.logger.log_eval(self.step, self.evaluate())
                if cfg.checkpoint.enabled and ((cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or last):
                    self.save_checkpoint()
                self.checkpoints.poll()  # a background save that has finished writing: put it in place
                if stop.requested():
                    self._stop_with_checkpoint(stop.signal_name)
                    break
            self.update.wait()  # delayed update: nothing runs on after fit returns
            self.checkpoints.close()
            final = self.history[-1] if self.history else {}
            self.logger.summary({"final_loss": final.get("loss"), "steps": self.step,
                                 "skipped_steps": self.counters.skipped_steps, "total_params": self.size.total,
                                 "active_params": self.size.active, "skipped_records": self.skips.total,
                                 "skipped_records_by_reason": self.skips.by_reason()})
            tokens = sum(h["tokens_per_s"] * h["step_time_s"] for h in self.history)
            latest = self.checkpoints.latest()
            self._print_main(end_line(self.step - first_step, self.step, cfg.train.max_steps, final, tokens,
                                      time.perf_counter() - started, self.run_dir.resolve(),
                                      latest.resolve() if latest else None))
            if self.peer_watch is not None:
                self.peer_watch.stop(finished=True)  # done: this rank's silence from now on is no failure
        except BaseException:
            if self.world_size > 1:
                # A peer's death surfaces here first: keep holding SIGTERM (the launcher sends it to
                # the survivors at once) so that train.py can still name the dead rank.
                stop.keep_holding()
            raise
        finally:
            stop.close()
            self.loader.close()
            self.logger.close()
            self._restore_determinism()
        return self.history

    def _report_compile(self, step_seconds: float) -> None:
        """train.compile: say how long torch.compile compiled during the step just run (lazily, at
        the first step; again when a new shape or eval compiles)."""
        if not self.cfg.train.compile:
            return
        spent = compile_seconds() - self._compile_s_seen
        if spent > 0:
            self._print_main(compile_time_line(self.step, spent, step_seconds, first=not self._compile_reported))
            self._compile_s_seen += spent
            self._compile_reported = True

    def _stop_with_checkpoint(self, signal_name: str) -> None:
        """Save this step (unless just saved), wait until it is on disk on every rank, and say so."""
        if not self.cfg.checkpoint.enabled:
            self._print_main(f"{signal_name}: stopped after step {self.step} of {self.cfg.train.max_steps} without a "
                             f"checkpoint (checkpoint.enabled=false)")
            return
        if self.last_saved_step != self.step:
            self.save_checkpoint(wait=True)
        self.checkpoints.wait()  # a background save of this step: in place before the process ends
        self._print_main(f"{signal_name}: stopped after step {self.step} of {self.cfg.train.max_steps} with "
                         f"checkpoint {self.checkpoints.step_dir(self.step)}; run again with "
                         f"checkpoint.resume=auto (the default) to continue")


def train(cfg: Config) -> list[dict]:  # the CLI's one call
    """Build a Trainer for ``cfg`` and run it to completion (delinking on the way when
    train.delink_at_step is set: m6.train.pseudo_to_real)."""
    if cfg.train.delink_at_step:
        return train_pseudo_to_real(cfg, Trainer)
    return Trainer(cfg).fit()
