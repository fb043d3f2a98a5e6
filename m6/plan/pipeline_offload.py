"""Pipeline parallel with m6's CPU offload in the planner (memory.offload=optimizer at
parallel.pipeline_parallel_size > 1, unsharded; what m6 runs: docs/parallelism.md, Pipeline parallel).

A pipeline rank offloads the parameters of its own stages: the fp32 masters and the optimizer
state on the host, the weights on the device. Unlike offload without a pipeline, a stage's
gradients do not leave the device in every micro-batch's backward: the schedule runs the step's
micro-batches' backwards one after another and a gradient is final (and streams to the host)
only in the stage's last one (m6.train.pipeline_step). So every gradient of the rank's stages is
on the device, in fp32, from its stage's first backward to the step's end, as
m6.plan.pipeline_memory counts them without offload; ``offloaded_states`` moves the optimizer
state and the update off the device and adds the host's masters and gradients.

ASSUMED: the delayed update (which m6 runs with a pipeline) is not searched with one: its overlap
with a schedule's bubble is not modelled.
"""

from __future__ import annotations

from m6.config import Config
from m6.memory.estimate import ModelFacts, compute_bytes

PP_OFFLOAD = ("none", "optimizer")  # memory.offload settings the search combines with a pipeline


def offloaded_states(cfg: Config, facts: ModelFacts, states: dict[str, float], device_type: str
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """A pipeline rank's (device states, host states) under ``cfg.memory.offload`` from its
    unoffloaded ``states`` (params, grads, optimizer state, optimizer step temporaries of the
    rank's own parameters ``facts``); unchanged, with nothing on the host, without offload."""
    if cfg.memory.offload == "none":
        return states, {}
    assert cfg.memory.offload in PP_OFFLOAD, f"memory.offload={cfg.memory.offload} is not planned with a pipeline"
    half_grads = cfg.memory.host_grad_dtype == "compute"
    device = {"params": states["params"], "grads": states["grads"], "optimizer state": 0.0,
              "optimizer step temporaries": 0.0}
    host = {"params": 4.0 * facts.numel,  # the fp32 masters
            # the gradients streamed out (fp32, or 16-bit), a second set under the delayed update
            "grads": (compute_bytes(cfg, device_type) if half_grads else 4.0) * facts.numel
            * (2 if cfg.optim.delayed_update else 1),
            "optimizer state": states["optimizer state"],
            # DeepSpeed's CPU Adam updates in place; torch's foreach calls need their temporaries,
            # and 16-bit host gradients are read back in fp32 one apply group at a time.
            "optimizer step temporaries": (0.0 if cfg.memory.host_optimizer == "deepspeed"
                                           else states["optimizer step temporaries"])
            + (4.0 * facts.largest_group(cfg.optim.apply_groups) if half_grads else 0.0)}
    return device, host
