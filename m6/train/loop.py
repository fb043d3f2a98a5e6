"""The pretraining loop on one process: data -> forward/backward (with accumulation) -> clip ->
AdamW -> metrics, eval, checkpoints. Readable top to bottom in ``Trainer.fit``."""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from m6.config import Config, accumulation_steps, dump_yaml, micro_batch_size, num_patches, run_dir, to_dict
from m6.data.batch import IGNORE_INDEX, MultimodalBatch, collate
from m6.data.sampler import ResumableSampler
from m6.data.synthetic import SyntheticImageCaptionDataset, shuffled_images
from m6.data.tokenizer import ByteTokenizer
from m6.model import M6Model
from m6.model.flops import count_parameters, training_flops_per_token
from m6.train.checkpoint import CheckpointManager, load_model_state, resolve_resume, rng_state, set_rng_state
from m6.train.loggers import MetricsLogger
from m6.train.metrics import device_peak_tflops, expert_load, peak_memory_gb
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
    return torch.bfloat16 if precision == "bf16" else None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Owns the model, optimizer, data position and outputs of one run."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.train.device)
        self.autocast_dtype = resolve_precision(cfg.train.precision, self.device)
        seed_everything(cfg.run.seed)
        self.run_dir = Path(run_dir(cfg))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, self.run_dir / "config.yaml")

        m, d = cfg.model, cfg.data
        self.tokenizer = ByteTokenizer()
        self.image_shape = (m.image_channels, m.image_size, m.image_size)
        self.train_set = SyntheticImageCaptionDataset(d.num_samples, m.image_size, seed=cfg.run.seed,
                                                      text_only_fraction=d.text_only_fraction)
        # A different seed: held-out samples drawn from the same distribution.
        self.eval_set = SyntheticImageCaptionDataset(max(d.eval_samples, 1), m.image_size, seed=cfg.run.seed + 7919,
                                                     text_only_fraction=0.0)
        self.sampler = ResumableSampler(len(self.train_set), seed=cfg.run.seed)

        self.model = M6Model(m).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
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
                                    console=cfg.logging.console)
        self.history: list[dict] = []

    # ---- data -------------------------------------------------------------------------------
    def _collate(self, dataset, indices: list[int]) -> MultimodalBatch:
        samples = [dataset[i] for i in indices]
        return collate(samples, self.tokenizer, self.cfg.data.seq_len, self.image_shape).to(self.device)

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _forward_loss_sum(self, batch: MultimodalBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of target-token cross-entropy, summed MoE aux loss) for one micro-batch."""
        with self._autocast():
            hidden, aux = self.model(batch.images, batch.has_image, batch.text_ids, batch.segment_ids)
            return self.model.target_loss_sum(hidden, batch.labels), aux

    # ---- one optimizer step -------------------------------------------------------------------
    def train_step(self) -> dict:
        """Forward/backward over the accumulation micro-batches, clip, and update (unless non-finite)."""
        t0 = time.perf_counter()
        self.model.train()
        accum, mb = accumulation_steps(self.cfg.train), micro_batch_size(self.cfg.train)
        batches = [self._collate(self.train_set, self.sampler.take(mb)) for _ in range(accum)]
        # Normalise by the target tokens of the whole step, not per micro-batch: the loss is then
        # the same however the batch is split.
        num_targets = sum(b.num_target_tokens for b in batches)
        lm_total = aux_total = 0.0
        balance = z = 0.0
        positions = tokens = 0
        for batch in batches:
            lm_sum, aux = self._forward_loss_sum(batch)
            loss = lm_sum / max(num_targets, 1) + aux / accum
            loss.backward()
            lm_total += lm_sum.item()
            aux_total += aux.item() / accum
            layers = self.model.moe_layers().values()
            balance += sum(l.stats.aux_loss.item() for l in layers) / accum
            z += sum(l.stats.z_loss.item() for l in layers) / accum
            positions += batch.segment_ids.numel() + batch.images.shape[0] * num_patches(self.cfg.model)
            tokens += int((batch.segment_ids != 0).sum()) + int(batch.has_image.sum()) * num_patches(self.cfg.model)
        lm_loss = lm_total / max(num_targets, 1)
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        finite = math.isfinite(lm_loss) and math.isfinite(aux_total) and math.isfinite(grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        if finite:
            self.optimizer.step()
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # lr follows the step count, skipped steps included
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        # Model FLOPs of every position computed (padding included: the hardware did that work).
        tflops = self.flops_per_position * positions / dt / 1e12
        metrics = {
            "loss": lm_loss + aux_total, "lm_loss": lm_loss, "aux_loss": aux_total,
            "balance_loss": balance, "z_loss": z, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens / dt, "samples_per_s": self.cfg.train.global_batch_size / dt,
            "step_time_s": dt, "tflops": tflops, "peak_mem_gb": peak_memory_gb(self.device),
            "skipped_steps": self.skipped_steps,
        }
        if self.peak_tflops:
            metrics["mfu"] = tflops / self.peak_tflops
        if not finite and self.bad_steps >= self.cfg.train.max_bad_steps:
            raise TrainingDiverged(
                f"{self.bad_steps} consecutive steps had a non-finite loss or gradient (last at step "
                f"{self.step}, limit train.max_bad_steps={self.cfg.train.max_bad_steps}); stopping. "
                f"The last good checkpoint is {self.checkpoints.latest() or 'none (none was saved yet)'}."
            )
        return metrics

    # ---- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Caption loss on held-out image samples with their true images and with shuffled images.

        A model that uses the image has a clearly lower loss with the true ones.
        """
        self.model.eval()
        mb = micro_batch_size(self.cfg.train)
        n = min(len(self.eval_set), mb * self.cfg.train.eval_batches)
        gen = torch.Generator().manual_seed(self.cfg.run.seed)
        sums = {"caption_loss": 0.0, "caption_loss_shuffled_images": 0.0}
        count = 0
        for start in range(0, n, mb):
            batch = self._collate(self.eval_set, list(range(start, min(n, start + mb))))
            batch.labels[~batch.has_image] = IGNORE_INDEX  # caption loss: image samples only
            targets = int((batch.labels != IGNORE_INDEX).sum())
            if targets == 0:
                continue
            sums["caption_loss"] += self._forward_loss_sum(batch)[0].item()
            sums["caption_loss_shuffled_images"] += self._forward_loss_sum(shuffled_images(batch, gen))[0].item()
            count += targets
        self.model.train()
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out["image_gap"] = out["caption_loss_shuffled_images"] - out["caption_loss"]
        return out

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        state = {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "step": self.step, "data": self.sampler.state_dict(),
            "rng": rng_state(), "config": to_dict(self.cfg),
            "counters": {"bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps},
        }
        return self.checkpoints.save(self.step, state)

    def _restore(self, path: Path) -> None:
        state = self.checkpoints.load(path, map_location=self.device)
        load_model_state(self.model, state["model"], str(path))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.bad_steps = state["counters"]["bad_steps"]
        self.skipped_steps = state["counters"]["skipped_steps"]
        print(f"resumed from {path} at step {self.step}", flush=True)

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
                if (cfg.train.eval_every and self.step % cfg.train.eval_every == 0) or last:
                    self.logger.log_eval(self.step, self.evaluate())
                if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or last:
                    self.save_checkpoint()
            final = self.history[-1] if self.history else {}
            self.logger.summary({"final_loss": final.get("loss"), "steps": self.step,
                                 "skipped_steps": self.skipped_steps, "total_params": self.size.total,
                                 "active_params": self.size.active})
        finally:
            self.logger.close()
        return self.history


def train(cfg: Config) -> list[dict]:
    """Build a Trainer for ``cfg`` and run it to completion."""
    return Trainer(cfg).fit()
