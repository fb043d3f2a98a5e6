"""Auxiliary-loss-free balancing, the training loop's side: total each MoE layer's routed counts over
the step's micro-batches and over all ranks, then let every layer move its expert bias.

The counts are integers and the update is a sign, so every rank applies the same update to the same
bias: it stays replicated without being synchronised, and at any world size or expert-parallel
layout the same global batch gives the same bias (m6's routing is world-size invariant).

Shape legend: L MoE layers with a bias, E experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from m6.moe import MoELayer


class ExpertBiasUpdate:
    """The step's global expert counts for the layers with ``expert_bias_update_rate > 0``.

        bias.add_micro_batch()      # after each micro-batch's forward (reads layer.stats)
        bias.step(apply=finite)     # after the optimizer step: one all-reduce, then the updates
    """

    def __init__(self, moe_layers: dict[str, MoELayer], group, device: torch.device) -> None:
        """``group``: every rank whose tokens count (all ranks; None for one process)."""
        self.layers = {name: layer for name, layer in moe_layers.items() if layer.expert_bias_update_rate > 0}
        self.group = group
        for layer in self.layers.values():
            # Parameters offloaded to the host initialise there: the bias must meet the scores.
            layer.expert_bias = layer.expert_bias.to(device)
        self.counts_LE: torch.Tensor | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.layers)

    def add_micro_batch(self) -> None:
        """Add the last forward's routed counts of this rank (device tensors: no host sync)."""
        if not self.enabled:
            return
        counts = torch.stack([layer.stats.routed_local for layer in self.layers.values()])
        self.counts_LE = counts if self.counts_LE is None else self.counts_LE + counts

    def add_counts(self, counts_LE: torch.Tensor) -> None:
        """Add routed counts [L, E] (this rank's layers, in ``layers`` order) gathered elsewhere: a
        pipeline stage's micro-batches, recorded by its forward (m6.train.pipeline_step)."""
        self.counts_LE = counts_LE if self.counts_LE is None else self.counts_LE + counts_LE

    def step(self, apply: bool) -> None:
        """Total the step's counts over all ranks and update every bias (``apply=False``: a skipped,
        non-finite step leaves the biases as they were, like the weights). Every rank calls it."""
        if not self.enabled:
            return
        counts, self.counts_LE = self.counts_LE, None
        assert counts is not None, "ExpertBiasUpdate.step before any add_micro_batch"
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)  # int64: the sum is exact
        if apply:
            for layer, counts_E in zip(self.layers.values(), counts):
                layer.update_expert_bias(counts_E)

    def log_values(self) -> tuple[dict[str, float], dict[str, list[float]]]:
        """Per layer the scalar ``moe/<layer>/expert_bias_max_abs`` and the whole bias vector, for
        the metrics loggers (one host copy of all layers' biases, at logging steps only)."""
        if not self.enabled:
            return {}, {}
        biases = torch.stack([layer.expert_bias for layer in self.layers.values()]).double().cpu()
        scalars = {f"moe/{name}/expert_bias_max_abs": float(b.abs().max()) for name, b in zip(self.layers, biases)}
        return scalars, {name: b.tolist() for name, b in zip(self.layers, biases)}
