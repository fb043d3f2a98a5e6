"""The pretraining loop on one process: data -> forward/backward (with accumulation) -> clip ->
AdamW -> metrics, eval, checkpoints. Readable top to bottom in ``Trainer.fit``."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

import torch.distributed as dist

from m6.config import (Config, accumulation_steps, dump_yaml, micro_batch_size, num_patches,
                       per_rank_batch_size, run_dir, to_dict)
from m6.data.batch import IGNORE_INDEX, MultimodalBatch
from m6.data.pipeline import build_training_data
from m6.data.record_dataset import RUNTIME_SKIP_REASONS, LoadedItem
from m6.data.sources import SkipCounter
from m6.data.synthetic import shuffled_images
from m6.model import M6Model
from m6.model.cast_on_use import set_cast_on_use
from m6.model.flops import count_parameters, training_flops_per_token
from m6.train.checkpoint import CheckpointManager, load_model_state, resolve_resume, rng_state, set_rng_state
from m6.train.loggers import MetricsLogger
from m6.train.metrics import device_peak_tflops, expert_load, peak_memory_gb
from m6.parallel import (GradientSync, build_layout, classify_parameters, clip_grad_norm, create_process_groups,
                         default_plan, init_distributed, launched_distributed, shard_model)
from m6.parallel.activation_checkpoint import ActivationCheckpointing, check_recompute
from m6.parallel.activation_meter import SavedActivationMeter
from m6.parallel.activation_guard import ActivationBudgetGuard
from m6.parallel.activation_plan import budget_bytes, full_plan, profile_parts
from m6.parallel.checkpoint_state import full_model_and_optimizer_state, local_model_and_optimizer_state
from m6.parallel.offload import build_offload
from m6.parallel.optimizer_apply import GroupedApply
from m6.train.optim import build_optimizer, build_scheduler


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite steps; the last good checkpoint is left untouched."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device is 'cuda' but no CUDA device is available (use 'auto' or 'cpu')")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype, or None for plain fp32. auto = bf16 on CUDA, fp32 on CPU."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return torch.bfloat16 if precision in ("bf16", "bf16-autocast") else None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Owns the model, optimizer, data position and outputs of one run."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.dist = init_distributed(cfg.parallel.timeout_s) if launched_distributed() else None
        self.rank = self.dist.rank if self.dist else 0
        self.world_size = self.dist.world_size if self.dist else 1
        self.is_main = self.rank == 0
        self.device = resolve_device(cfg.train.device)
        if self.device.type == "cuda" and self.dist:
            self.device = torch.device("cuda", self.dist.local_rank)
        self.autocast_dtype = resolve_precision(cfg.train.precision, self.device)
        # bf16 (and auto on CUDA) = cast-on-use; bf16-autocast = plain autocast, kept to compare.
        self.cast_on_use = self.autocast_dtype is not None and cfg.train.precision != "bf16-autocast"
        self.per_rank_batch = per_rank_batch_size(cfg.train, self.world_size)
        self.micro_batch = micro_batch_size(cfg.train, self.world_size)
        self.accum = accumulation_steps(cfg.train, self.world_size)
        seed_everything(cfg.run.seed)
        self.run_dir = Path(run_dir(cfg))
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(cfg, self.run_dir / "config.yaml")

        m, d = cfg.model, cfg.data
        self.data = build_training_data(cfg, self.rank, self.world_size, pin_memory=self.device.type == "cuda")
        self.loader, self.eval_set = self.data.loader, self.data.eval_set
        self.skips = SkipCounter()  # records this rank's loader skipped (indexing skips are in self.data)
        self.skipped_records = self.data.index_skips.total  # job-wide, indexing included
        self.restored_skip_reasons: dict[str, int] = {}  # loader skips before the resumed checkpoint
        if self.is_main:
            self._report_skips(self.data.index_skips, "while indexing data.sources")

        # Built on meta, experts sharded, then materialised: no process ever allocates the experts
        # it does not hold. Same seed everywhere: replicated weights come out identical, and every
        # expert's weights depend only on (seed, layer, global expert id), not on the layout.
        # optimizer+params keeps the blocks' weights on the host: initialise there, so the device
        # never holds the whole model (m6.parallel.offload moves the rest to the device).
        init_device = torch.device("cpu") if cfg.memory.offload == "optimizer+params" else self.device
        with torch.device("meta"):
            self.model = M6Model(m)
        self.sharded = self.grad_sync = None
        if self.dist:
            layout = build_layout(self.world_size, self.rank, cfg.parallel.expert_parallel_size, m.moe.num_experts,
                                  self.dist.local_world_size)
            groups = create_process_groups(layout)
            a2a_dtype = torch.bfloat16 if m.moe.a2a_dtype == "bf16" else None
            plan = default_plan(self.model)
            shard_model(self.model, plan, groups, a2a_dtype, m.moe.aux_loss_scope)
            self.model.materialize(init_device, cfg.run.seed)
            self.sharded = classify_parameters(self.model, plan, groups)
            self.grad_sync = GradientSync(self.sharded, int(cfg.parallel.bucket_size_mb * 2**20))
            self.replicated_params = list(self.sharded.replicated_params.values())
            self.expert_params = list(self.sharded.expert_params.values())
            self.expert_group = groups.expert
        else:
            self.model.materialize(init_device, cfg.run.seed)
            expert_ids = {id(p) for layer in self.model.moe_layers().values() for p in layer.experts.parameters()}
            self.replicated_params = [p for p in self.model.parameters() if id(p) not in expert_ids]
            self.expert_params = [p for p in self.model.parameters() if id(p) in expert_ids]
            self.expert_group = None
        set_cast_on_use(self.model, self.cast_on_use)
        # Checkpointing wraps parts of the materialised model from outside; which parts is
        # decided on the first step, from a profile (m6.parallel.activation_plan).
        self.checkpointing = (ActivationCheckpointing(self.model)
                              if cfg.memory.activation_checkpointing != "none" else None)
        self.checkpoint_plan = None
        self.budget_guard: ActivationBudgetGuard | None = None  # activation_checkpointing=auto
        self.offload = build_offload(cfg.memory.offload, [p for p in self.model.parameters() if p.requires_grad],
                                     self.device, stream_in_backward=self.grad_sync is None,
                                     streamed_layers=list(self.model.blocks))
        if self.offload:
            if self.grad_sync:
                self.grad_sync.on_grads_final = self.offload.grads_final  # reduce first, then offload
            # The host masters hold the gradients once offloaded: clip and update those.
            self.replicated_params = self.offload.masters_of(self.replicated_params)
            self.expert_params = self.offload.masters_of(self.expert_params)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.offload.master if self.offload else None)
        self.apply = GroupedApply(self.optimizer, self.replicated_params, self.expert_params, cfg.optim.apply_groups)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.max_steps)
        self.size = count_parameters(self.model)
        self.flops_per_position = training_flops_per_token(m, self.size, d.seq_len)
        peak_dtype = self.autocast_dtype or torch.float32
        self.peak_tflops = device_peak_tflops(self.device, peak_dtype, cfg.train.peak_tflops)

        self.step = 0
        self.bad_steps = 0
        self.skipped_steps = 0
        self.checkpoints = CheckpointManager(self.run_dir, cfg.checkpoint.keep)
        resume_from = resolve_resume(cfg.checkpoint.resume, self.checkpoints)
        if resume_from is not None:
            self._restore(resume_from)
        self.logger = MetricsLogger(self.run_dir, to_dict(cfg), cfg.logging.wandb, cfg.train.max_steps,
                                    console=cfg.logging.console, is_main_process=self.is_main)
        self.history: list[dict] = []

    # ---- data -------------------------------------------------------------------------------
    def _eval_batch(self, indices: list[int]) -> MultimodalBatch:
        return self.data.collator([LoadedItem(self.eval_set[i]) for i in indices]).batch.to(self.device)

    def _report_skips(self, skips, where: str) -> None:
        """Print the first few skipped records (file and key) so bad data is visible, not just counted."""
        for ex in skips.examples:
            print(f"skipped record {where} (rank {self.rank}): {ex.source} [{ex.key}] {ex.reason}: {ex.detail}",
                  flush=True)

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        # Cast-on-use ops keep no weight copy; an uncached autocast keeps none for the forward either.
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=not self.cast_on_use)

    def _forward_loss_sum(self, batch: MultimodalBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of target-token cross-entropy, summed MoE aux loss) for one micro-batch."""
        with self._autocast():
            hidden, aux = self.model(batch.images, batch.has_image, batch.text_ids, batch.segment_ids)
            return self.model.target_loss_sum(hidden, batch.labels), aux

    def _count_skips(self, loaded) -> int:
        """Add the records skipped in this step's micro-batches to this rank's counter; returns how many."""
        before, shown = self.skips.total, len(self.skips.examples)
        for lb in loaded:
            for ex in lb.skips:
                self.skips.record(*ex)
        if len(self.skips.examples) > shown:
            fresh = SkipCounter()
            fresh.examples = self.skips.examples[shown:]
            self._report_skips(fresh, f"at step {self.step + 1}")
        return self.skips.total - before

    def _skip_reasons(self) -> dict:
        """Skipped records by reason: indexing (once) plus every rank's loader, summed over ranks."""
        assert set(self.skips.counts) <= set(RUNTIME_SKIP_REASONS), self.skips.counts
        # A fixed list: every rank must pass the same number of values to the collective.
        runtime = self._all_reduce_sum([float(self.skips.counts[r]) for r in RUNTIME_SKIP_REASONS])
        totals = Counter(self.data.index_skips.counts) + Counter(self.restored_skip_reasons)
        totals.update({r: int(n) for r, n in zip(RUNTIME_SKIP_REASONS, runtime)})
        return {r: n for r, n in sorted(totals.items()) if n}

    # ---- one optimizer step -------------------------------------------------------------------
    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum scalars over all ranks (one collective); identity on one process."""
        if not self.dist:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def _rank_slice(self, indices: list[int]) -> list[int]:
        """This rank's share of a global batch: changing the number of ranks keeps the global batch."""
        n = len(indices) // self.world_size
        return indices[self.rank * n:(self.rank + 1) * n]

    def train_step(self) -> dict:
        """Forward/backward over the accumulation micro-batches, clip, and update (unless non-finite)."""
        t0 = time.perf_counter()
        self.model.train()
        loaded, data_wait = self.loader.next_step()
        batches = [lb.batch.to(self.device, non_blocking=True) for lb in loaded]
        new_skips = self._count_skips(loaded)
        # Normalise by the target tokens of the whole GLOBAL step, not per micro-batch or rank:
        # the loss is then the same however the batch is split.
        (num_targets,) = self._all_reduce_sum([float(sum(b.num_target_tokens for b in batches))])
        patches = num_patches(self.cfg.model)
        # Counted from shapes and host-side counts: no device sync inside the micro-batch loop.
        positions = sum(b.segment_ids.numel() + b.batch_size * patches for b in batches)
        tokens = sum(lb.real_tokens for lb in loaded)
        if self.checkpointing is not None and self.checkpoint_plan is None:
            self._plan_checkpointing(batches[0], num_targets)
        saved_bytes = 0  # activations kept for backward, largest over the micro-batches (this rank)
        parts = []  # per micro-batch: lm sum, aux, balance, z (device tensors, read once at the end)
        for i, batch in enumerate(batches):
            if self.grad_sync:
                self.grad_sync.enabled = i == len(batches) - 1  # communicate on the last backward only
            if self.offload:
                self.offload.final_backward = i == len(batches) - 1  # stream gradients once final
            if self.budget_guard:
                meter = self.budget_guard.micro_batch(batch.num_target_tokens)
            else:
                meter = SavedActivationMeter(self.model.parameters()) if self.checkpointing else nullcontext()
            with meter as metered:
                lm_sum, aux = self._forward_loss_sum(batch)
            if self.checkpointing:
                saved_bytes = max(saved_bytes, metered.held_bytes())
            loss = lm_sum / max(num_targets, 1) + aux / self.accum
            loss.backward()
            layers = list(self.model.moe_layers().values())
            zero = aux.detach().new_zeros(())
            balance = sum((l.stats.aux_loss for l in layers), zero)
            z_sum = sum((l.stats.z_loss for l in layers), zero)
            parts.append(torch.stack([lm_sum.detach().double(), aux.detach().double(), balance.double(), z_sum.double()]))
        if self.grad_sync:
            self.grad_sync.finish()
        if self.offload:
            self.offload.finish_backward()  # all gradients on the host before the norm is taken
        lm_local, aux_total, balance, z = torch.stack(parts).sum(0).tolist()  # the step's one host sync
        aux_total, balance, z = aux_total / self.accum, balance / self.accum, z / self.accum
        lm_total, positions, tokens, new_skips = self._all_reduce_sum(
            [lm_local, float(positions), float(tokens), float(new_skips)])
        self.skipped_records += int(new_skips)
        lm_loss = lm_total / max(num_targets, 1)
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm(self.replicated_params, self.expert_params, clip, self.expert_group)
        finite = math.isfinite(lm_loss) and math.isfinite(aux_total) and math.isfinite(grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        if finite:
            if self.offload:
                self.offload.step(self.apply)
            else:
                self.apply.step()
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.offload:
            self.offload.zero_grad()
        self.scheduler.step()  # lr follows the step count, skipped steps included
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        # Model FLOPs of every position computed by all ranks (padding included: the hardware did
        # that work); MFU divides by the peak of all the job's devices.
        tflops = self.flops_per_position * positions / dt / 1e12
        metrics = {
            "loss": lm_loss + aux_total, "lm_loss": lm_loss, "aux_loss": aux_total,
            "balance_loss": balance, "z_loss": z, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens / dt, "samples_per_s": self.cfg.train.global_batch_size / dt,
            "step_time_s": dt, "tflops": tflops, "peak_mem_gb": peak_memory_gb(self.device),
            "skipped_steps": self.skipped_steps, "data_wait_s": data_wait, "skipped_records": self.skipped_records,
        }
        if self.peak_tflops:
            metrics["mfu"] = tflops / (self.peak_tflops * self.world_size)
        if self.checkpointing:
            metrics["activation_saved_mb"] = saved_bytes / 2**20
        if self.budget_guard:
            metrics["activation_extra_recomputes"] = self.budget_guard.step_extras
            new_plan = self.budget_guard.end_step()
            if new_plan is not None:
                self.checkpoint_plan = new_plan
                if self.is_main:
                    print(f"{new_plan.summary(len(self.checkpointing.parts))} (rank 0, re-planned after step "
                          f"{self.step}: a micro-batch kept x{new_plan.margin:.3f} the predicted bytes)", flush=True)
        if not finite and self.bad_steps >= self.cfg.train.max_bad_steps:
            raise TrainingDiverged(
                f"{self.bad_steps} consecutive steps had a non-finite loss or gradient (last at step "
                f"{self.step}, limit train.max_bad_steps={self.cfg.train.max_bad_steps}); stopping. "
                f"The last good checkpoint is {self.checkpoints.latest() or 'none (none was saved yet)'}."
            )
        return metrics

    def _plan_checkpointing(self, batch: MultimodalBatch, num_targets: float) -> None:
        """First step of this process: check the recompute (memory.check_checkpointing), profile the
        recomputable parts on ``batch``, choose and apply the plan. Every rank gets here together
        (the forwards below run the model's collectives); training math and RNG are untouched."""
        ckpt, mem = self.checkpointing, self.cfg.memory
        if mem.check_checkpointing:
            def forward_backward() -> None:
                lm_sum, aux = self._forward_loss_sum(batch)
                (lm_sum / max(num_targets, 1) + aux / self.accum).backward()

            # Local gradients only: nothing all-reduced or streamed to the host during the check.
            if self.grad_sync:
                self.grad_sync.enabled = False
            if self.offload:
                self.offload.final_backward = False
            line = check_recompute(ckpt, forward_backward, dict(self.model.named_parameters()), self.device,
                                   self.autocast_dtype, dist.group.WORLD if self.dist else None)
            if self.is_main:
                print(line, flush=True)
        # Profiled on the densest batch of this shape (no padding, a label at every text
        # position): the most a micro-batch can keep, so later batches fit the plan; what routing
        # can still add under expert parallelism (a rank receiving more tokens) the guard handles.
        densest = batch.densest()
        profile = profile_parts(ckpt, lambda: self._forward_loss_sum(densest), self.model.parameters(), self.device)
        if mem.activation_checkpointing == "full":
            plan = full_plan(profile)
            ckpt.apply(plan.recompute)
        else:
            self.budget_guard = ActivationBudgetGuard(ckpt, profile, budget_bytes(mem, profile.saved_bytes(())),
                                                      self.model.parameters(), densest.num_target_tokens)
            plan = self.budget_guard.plan
        self.checkpoint_plan = plan
        if self.is_main:
            print(f"{plan.summary(len(ckpt.parts))} (rank 0, profiled on the densest micro-batch of its shape)",
                  flush=True)

    # ---- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Caption loss on held-out image samples with their true images and with shuffled images.

        A model that uses the image has a clearly lower loss with the true ones.
        """
        self.model.eval()
        gb = self.cfg.train.global_batch_size
        n = min(len(self.eval_set), gb * self.cfg.train.eval_batches) // gb * gb or gb
        gen = torch.Generator().manual_seed(self.cfg.run.seed)
        sums = {"caption_loss": 0.0, "caption_loss_shuffled_images": 0.0}
        count = 0
        if not len(self.eval_set):
            return {}
        for start in range(0, n, gb):
            # Every rank runs every eval batch (the expert all-to-all needs all of them).
            mine = self._rank_slice([i % len(self.eval_set) for i in range(start, start + gb)])
            for i in range(0, len(mine), self.micro_batch):
                batch = self._eval_batch(mine[i:i + self.micro_batch])
                batch.labels[~batch.has_image] = IGNORE_INDEX  # caption loss: image samples only
                sums["caption_loss"] += self._forward_loss_sum(batch)[0].item()
                shuffled = shuffled_images(batch, gen) if int(batch.has_image.sum()) > 1 else batch
                sums["caption_loss_shuffled_images"] += self._forward_loss_sum(shuffled)[0].item()
                count += int((batch.labels != IGNORE_INDEX).sum())
        a, b, count = self._all_reduce_sum([sums["caption_loss"], sums["caption_loss_shuffled_images"], float(count)])
        sums = {"caption_loss": a, "caption_loss_shuffled_images": b}
        self.model.train()
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out["image_gap"] = out["caption_loss_shuffled_images"] - out["caption_loss"]
        return out

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Rank 0 writes one layout-free checkpoint (whole expert tensors); every rank must call it."""
        if self.sharded is not None:
            full = full_model_and_optimizer_state(self.sharded, self.optimizer, self._optimizer_names())
        else:
            full = (self.model.state_dict(), self.optimizer.state_dict())
        skip_reasons = self._skip_reasons()  # a collective: before the rank-0-only part
        path = None
        if self.is_main:
            model_sd, optim_sd = full
            state = {
                "model": model_sd, "optimizer": optim_sd,
                "scheduler": self.scheduler.state_dict(), "step": self.step, "data": self.loader.state_dict(),
                "rng": rng_state(), "config": to_dict(self.cfg), "world_size": self.world_size,
                "counters": {"bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps,
                             "skipped_records": self.skipped_records},
                "skipped_records_by_reason": {r: n - self.data.index_skips.counts.get(r, 0)
                                              for r, n in skip_reasons.items()},
            }
            path = self.checkpoints.save(self.step, state)
        if self.dist:
            dist.barrier()
        return path

    def _optimizer_names(self) -> dict[int, str] | None:
        """Offload: the optimizer updates host masters, named after their model parameters."""
        return self.offload.master_names(self.model) if self.offload else None

    def _restore(self, path: Path) -> None:
        state = self.checkpoints.load(path, map_location="cpu")
        model_sd, optim_sd = state["model"], state["optimizer"]
        if self.sharded is not None:
            model_sd, optim_sd = local_model_and_optimizer_state(self.sharded, self.optimizer, model_sd, optim_sd,
                                                                 self._optimizer_names())
        load_model_state(self.model, model_sd, str(path))
        if self.offload:
            self.offload.pull_masters()
        self.optimizer.load_state_dict(optim_sd)
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.bad_steps = state["counters"]["bad_steps"]
        self.skipped_steps = state["counters"]["skipped_steps"]
        self.skipped_records = state["counters"].get("skipped_records", self.skipped_records)
        self.restored_skip_reasons = {r: n for r, n in state.get("skipped_records_by_reason", {}).items() if n}
        if self.is_main:
            print(f"resumed from {path} at step {self.step} (saved at world size {state.get('world_size', 1)}, "
                  f"now {self.world_size})", flush=True)

    # ---- the loop ---------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        """Train to train.max_steps; returns the per-step metrics of this process's steps."""
        cfg = self.cfg
        try:
            while self.step < cfg.train.max_steps:
                metrics = self.train_step()
                self.history.append({"step": self.step, **metrics})
                last = self.step == cfg.train.max_steps
                if self.step % cfg.logging.every == 0 or last:
                    load_scalars, load_counts = expert_load(self.model.moe_layers())
                    self.logger.log(self.step, {**metrics, **load_scalars})
                    self.logger.log_expert_load(self.step, load_counts)
                if ((cfg.train.eval_every and self.step % cfg.train.eval_every == 0) or last) and len(self.eval_set):
                    self.logger.log_eval(self.step, self.evaluate())
                if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or last:
                    self.save_checkpoint()
            final = self.history[-1] if self.history else {}
            self.logger.summary({"final_loss": final.get("loss"), "steps": self.step,
                                 "skipped_steps": self.skipped_steps, "total_params": self.size.total,
                                 "active_params": self.size.active, "skipped_records": self.skipped_records,
                                 "skipped_records_by_reason": self._skip_reasons()})
        finally:
            self.loader.close()
            self.logger.close()
        return self.history


def train(cfg: Config) -> list[dict]:
    """Build a Trainer for ``cfg`` and run it to completion."""
    return Trainer(cfg).fit()
