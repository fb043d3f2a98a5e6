"""The metrics row of one training step, as the loggers write it (docs/training.md lists the keys),
assembled from what the step measured: m6.train.step_scalars' losses and totals, its times, the
update's state."""

from __future__ import annotations

import torch

from m6.train.loss_scale import DynamicLossScale
from m6.train.metrics import peak_memory_gb
from m6.train.step_scalars import LocalLosses, StepTotals


class StepMetrics:
    """What a run's every step reports: the settings that do not change between steps are held here."""

    def __init__(self, global_batch_size: int, device: torch.device, peak_tflops: float | None, world_size: int,
                 has_expert_exchange: bool) -> None:
        self.global_batch_size, self.device, self.world_size = global_batch_size, device, world_size
        self.peak_tflops, self.has_expert_exchange = peak_tflops, has_expert_exchange

    def row(self, local: LocalLosses, totals: StepTotals, num_targets: float, lr: float, grad_norm: float,
            grad_mb: float, seconds: float, data_wait_s: float, skipped_steps: int, skipped_records: int,
            activations: dict, loss_scale: DynamicLossScale | None) -> dict:
        """The row of a step that took ``seconds`` (``data_wait_s`` of them waiting for data) over
        ``num_targets`` target tokens (all ranks); ``lr`` and ``grad_mb`` as the update had them
        before its step, ``activations`` the recompute meter's, ``loss_scale`` fp16's (else None)."""
        lm_loss = totals.lm_sum / max(num_targets, 1)
        metrics = {
            "loss": lm_loss + local.aux, "lm_loss": lm_loss, "aux_loss_weighted": local.aux,
            "balance_loss_unweighted": local.balance, "z_loss_unweighted": local.z, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": totals.tokens / seconds, "samples_per_s": self.global_batch_size / seconds,
            "step_time_s": seconds, "peak_mem_gb": peak_memory_gb(self.device), "grad_mb": grad_mb,
            "skipped_steps": skipped_steps, "data_wait_s": data_wait_s, "skipped_records": skipped_records,
            **self.throughput(totals.flops, seconds), **activations,
            **{f"compute_s/rank{r}": s for r, s in enumerate(totals.rank_compute_s)},
        }
        if self.has_expert_exchange:
            metrics["inter_node_mb"] = totals.inter_node_bytes / 2**20  # all ranks, MiB; 0 inside one node
        if loss_scale is not None:  # the scale the next step uses, and the overflow skips so far
            metrics.update(loss_scale=loss_scale.scale, overflow_steps=loss_scale.overflow_steps)
        return metrics

    def throughput(self, flops: float, seconds: float) -> dict:
        """TFLOP/s of the step's model FLOPs summed over all ranks (m6.model.flops.step_flops: real
        tokens, target positions, kept expert assignments; padding and recompute not counted);
        MFU divides by the peak of all the job's devices."""
        tflops = flops / seconds / 1e12
        out = {"tflops": tflops}
        if self.peak_tflops:
            out["mfu"] = tflops / (self.peak_tflops * self.world_size)
        return out
