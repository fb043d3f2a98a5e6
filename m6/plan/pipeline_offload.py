"""Pipeline parallel with m6's CPU offload in the planner (memory.offload=optimizer at
parallel.pipeline_parallel_size > 1, unsharded; what m6 runs: docs/parallelism.md, Pipeline parallel).

A pipeline rank offloads the parameters of its own stages: the fp32 masters and the optimizer
state on the host, the weights on the device. Unlike offload without a pipeline, a stage's
gradients do not leave the device in every micro-batch's backward: the schedule runs the step's
micro-batches' backwards one after another and a gradient is final (and streams to the host)
only in the stage's last one (m6.train.pipeline_step). So every gradient of the rank's stages is
on the device, in fp32, from the step's first backward to its last, as the shared (all-reduced)
ones are at any layout: ``pipeline_offload_memory`` adds the unshared ones to the estimate of
the rank model, which counts them as leaving one at a time.

ASSUMED: the host holds the masters and state of the rank model of m6.plan.pipeline (its blocks
with both ends), an upper bound on every rank's host bytes; the delayed update (which m6 runs
with a pipeline) is not searched with one: its overlap with a schedule's bubble is not modelled.
"""

from __future__ import annotations

import dataclasses

from m6.config import Config
from m6.memory.estimate import MemoryReport, ModelFacts, compute_bytes

PP_OFFLOAD = ("none", "optimizer")  # memory.offload settings the search combines with a pipeline


def pipeline_offload_memory(cfg: Config, report: MemoryReport, facts: ModelFacts, world_size: int,
                            expert_parallel_size: int, device_type: str) -> MemoryReport:
    """``report`` (m6.memory.estimate of a pipeline rank's model at the stage's data-parallel
    ``world_size``; the caller plans pp > 1) with the gradients that m6's offload streams per
    micro-batch without a pipeline kept on the device over the step instead (see the module
    docstring)."""
    if cfg.memory.offload != "optimizer":
        return report
    edp = world_size // expert_parallel_size
    unshared = sum(p.numel() for p in facts.params
                   if world_size == 1 or (id(p) in facts.expert_ids and edp == 1))
    if cfg.memory.host_grad_dtype == "compute" and compute_bytes(cfg, device_type) < 4:
        unshared = 0  # 16-bit host gradients wait on the device for the last backward at any layout (counted)
    extra = 4.0 * unshared
    if extra == 0:
        return report
    device = {**report.device, "grads": report.device["grads"] + extra}
    return dataclasses.replace(report, device=device, peak_device=report.peak_device + extra,
                               peak_shared=report.peak_shared + extra)
