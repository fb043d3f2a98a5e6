"""The one owner of activation memory in training: recompute plan (made once, on the first step),
per-micro-batch metering, and the budget guard's end-of-step accounting.

    memory = ActivationMemory(model, cfg.memory, device, compute_dtype, log=print)
    memory.ensure_plan(batch, forward, forward_backward, group)   # first step only
    with memory.micro_batch(batch.num_target_tokens, measure=logging_step):
        loss = forward(batch)
    ...
    metrics.update(memory.end_step())

``mode="none"`` is the same object doing nothing: no plan, no meter, no metrics.

Metering costs host time on every tensor the forward saves (saved-tensor hooks), so it runs only
where something needs it: with ``full`` only on the steps whose metrics are shown (``measure``);
with ``auto`` on every micro-batch, because the budget guard decides from the meter, as each part
starts, whether to recompute it too (the price of holding a budget on batches it was not profiled on).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from m6.config import MemoryConfig
from m6.memory.activation_meter import SavedActivationMeter
from m6.memory.recompute import RecomputeParts, check_recompute
from m6.memory.recompute_guard import ActivationBudgetGuard
from m6.memory.recompute_plan import RecomputePlan, budget_bytes, full_plan, profile_parts


class ActivationMemory:
    """Which parts are recomputed (``memory.activation_checkpointing``) and what each step kept."""

    def __init__(self, model: nn.Module, memory: MemoryConfig, device: torch.device,
                 compute_dtype: Optional[torch.dtype], log: Callable[[str], None] = lambda line: None) -> None:
        """``model``: an nn.Module that declares its recomputable parts
        (m6.memory.recompute.DeclaresRecomputableParts); ``log``: where the plan's one-line
        summary goes (rank 0's console)."""
        self.cfg, self.device, self.compute_dtype = memory, device, compute_dtype
        self.model, self.log = model, log
        self.recompute = RecomputeParts(model) if memory.activation_checkpointing != "none" else None
        self.plan: Optional[RecomputePlan] = None
        self.guard: Optional[ActivationBudgetGuard] = None  # activation_checkpointing=auto
        self._step_saved_bytes: int | None = None  # most bytes a metered micro-batch of this step kept

    @property
    def enabled(self) -> bool:
        return self.recompute is not None

    def ensure_plan(self, densest_forward: Callable[[], object], forward_backward: Callable[[], None],
                    densest_targets: int, group=None) -> None:
        """First step of this process: check the recompute (memory.check_checkpointing), profile the
        recomputable parts on the densest micro-batch of the run's shape (``densest_forward``: a
        forward of it; ``densest_targets``: its loss targets), choose and apply the plan.

        ``forward_backward`` runs a forward and backward of a real micro-batch with gradients kept
        local (the caller turns communication off). Every rank gets here together (the forwards
        run the model's collectives); training math and RNG are untouched.
        """
        if self.recompute is None or self.plan is not None:
            return
        if self.cfg.check_checkpointing:
            params = dict(self.model.named_parameters())
            self.log(check_recompute(self.recompute, forward_backward, params, self.device, self.compute_dtype, group))
        # The densest batch (no padding, a label at every text position) keeps the most a
        # micro-batch can, so later batches fit the plan; what routing can still add under
        # expert parallelism (a rank receiving more tokens) the guard handles.
        profile = profile_parts(self.recompute, densest_forward, self.model.parameters(), self.device)
        if self.cfg.activation_checkpointing == "full":
            self.plan = full_plan(profile)
            self.recompute.apply(self.plan.recompute)
        else:
            self.guard = ActivationBudgetGuard(self.recompute, profile, budget_bytes(self.cfg, profile.saved_bytes(())),
                                               self.model.parameters(), densest_targets)
            self.plan = self.guard.plan
        self.log(f"{self.plan.summary(len(self.recompute.parts))} (rank 0, profiled on the densest micro-batch "
                 f"of its shape)")

    @contextmanager
    def micro_batch(self, num_targets: int = 0, measure: bool = True) -> Iterator[None]:
        """Around one training forward (enter before it, leave before its backward): the budget
        guard's metering with ``auto``; with ``full`` a meter only when ``measure`` (the step's
        activation_saved_mb is wanted)."""
        if self.recompute is None or (self.guard is None and not measure):
            with nullcontext():
                yield
            return
        meter = self.guard.micro_batch(num_targets) if self.guard else SavedActivationMeter(self.model.parameters())
        with meter as metered:
            yield
        self._step_saved_bytes = max(self._step_saved_bytes or 0, metered.held_bytes())

    def end_step(self, step: int) -> dict[str, float]:
        """The step's activation metrics; re-plans when the guard asks (``step``: for the log line)."""
        if self.recompute is None:
            return {}
        metrics = {} if self._step_saved_bytes is None else {"activation_saved_mb": self._step_saved_bytes / 2**20}
        self._step_saved_bytes = None
        if self.guard:
            metrics["activation_extra_recomputes"] = self.guard.step_extras
            new_plan = self.guard.end_step()
            if new_plan is not None:
                self.plan = new_plan
                self.log(f"{new_plan.summary(len(self.recompute.parts))} (rank 0, re-planned after step {step}: "
                         f"a micro-batch kept x{new_plan.margin:.3f} the predicted bytes)")
        return metrics
