"""Dynamic loss scaling for train.precision=fp16, with torch.amp.GradScaler's semantics.

    loss * scale -> backward -> gradients unscaled inside the global-norm clip -> a step whose
    gradients hold an inf/nan (on any rank) is skipped and the scale backs off (x backoff_factor);
    after growth_interval finite steps in a row it grows (x growth_factor)

Why not torch.amp.GradScaler itself: it unscales and checks one optimizer's gradients per device,
and its ``step`` calls ``optimizer.step()``. m6's gradients are reduced in its own buckets, clipped
to a norm summed over the expert-parallel group, and (memory.offload) held and updated on the
host by a group-wise apply; the inf/nan decision must be the same on every rank. So m6 keeps the
scaler's small state here (a Stateful piece of the checkpoint: the scale resumes exactly), folds
the unscale into the clip's one multiply (m6.parallel.grad_sync.clip_grad_norm, ``grad_scale``; under
parallel.shard m6.parallel.fsdp.clip_sharded_grad_norm, whose sum over every rank's shards makes an
overflow in any shard non-finite on all), and agrees on the overflow with the step's existing
scalar all-reduce (m6.train.loop).

Unlike GradScaler the scale has a floor (``min_scale``): an overflow while the scale sits there is
not the scale's normal search any more but a diverging run, and counts as a bad step
(train.max_bad_steps).
"""

from __future__ import annotations

from dataclasses import dataclass

GROWTH_FACTOR = 2.0  # torch.amp.GradScaler's defaults
BACKOFF_FACTOR = 0.5


@dataclass
class DynamicLossScale:
    """The loss scale of an fp16 run and its schedule; ``state_dict`` / ``load_state_dict`` for checkpoints."""

    scale: float = 2.0 ** 16
    growth_interval: int = 2000
    min_scale: float = 1.0
    growth_tracker: int = 0  # finite steps since the last change of the scale
    overflow_steps: int = 0  # steps skipped because of an inf/nan gradient, over the whole run

    @property
    def at_floor(self) -> bool:
        return self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow (not below the floor), grow after enough finite steps."""
        if overflow:
            self.overflow_steps += 1
            self.scale = max(self.scale * BACKOFF_FACTOR, self.min_scale)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        # >=, not ==: a run resumed with a smaller train.loss_scale_growth_interval restores a
        # tracker that may already be past it (== would then never be met again).
        if self.growth_tracker >= self.growth_interval:
            self.scale *= GROWTH_FACTOR
            self.growth_tracker = 0

    def describe(self) -> str:
        """The banner's words for it."""
        return (f"dynamic loss scale {self.scale:g} (x{BACKOFF_FACTOR:g} on overflow, x{GROWTH_FACTOR:g} after "
                f"{self.growth_interval} finite steps, floor {self.min_scale:g}; {self.overflow_steps} overflow "
                f"steps skipped so far)")

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "overflow_steps": self.overflow_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.overflow_steps = int(state["overflow_steps"])
