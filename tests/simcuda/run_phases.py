"""What a simulated Trainer run is doing when a host sync happens, and how often it did each thing.

The host-sync allow-list is written per event: per MoE layer forward, per training step, per
logging step, per checkpoint save, per evaluation, per resume from a checkpoint, once per recompute
plan, once per run (a Trainer's start-up and the end of its ``fit``). ``install()`` wraps the m6 methods that are those events: each call counts
one event and, while it runs, is the *phase* every sync of the training thread is attributed to
(the innermost one: a MoE layer's forward inside an evaluation is ``moe_forward``), except that
the recompute plan's profiling owns everything inside it, its MoE forwards included (they are not
training forwards, and happen once). Autograd's
device thread works for the training thread (which waits in ``backward``), so it shares its phase;
the checkpoint writer thread's syncs belong to ``save``, and the delayed update's worker's to
``step`` (it runs a step's update beside whatever the training thread does next, an evaluation
or a save included, so the training thread's phase would be a race), as do zero's copy-back
thread's (it copies a step's weights back beside the next forward).
"""

from __future__ import annotations

import threading
from collections import Counter

PHASES = ("run", "step", "moe_forward", "logging_step", "save", "eval", "resume", "recompute_plan")
_STICKY = {"recompute_plan"}
# A thread's name, or a ThreadPoolExecutor's prefix (its threads are "<prefix>_<n>"), -> its phase.
THREAD_PHASES = {"m6-checkpoint-writer": "save", "m6-delayed-update": "step", "m6-copy-back": "step"}

events: Counter = Counter()
_stack: list[str] = []


def current() -> str:
    """The phase a sync happening now belongs to."""
    name = threading.current_thread().name
    for prefix, phase in THREAD_PHASES.items():
        if name == prefix or name.startswith(prefix + "_"):
            return phase
    return _stack[-1] if _stack else "run"


def reset() -> None:
    events.clear()
    _stack.clear()


def _phase_of(owner, name: str, phase: str) -> None:
    real = getattr(owner, name)

    def in_phase(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread() or (_stack and _stack[-1] in _STICKY):
            return real(*args, **kwargs)  # only the training thread's calls are events
        events[phase] += 1
        if _stack:
            events[f"{phase} in {_stack[-1]}"] += 1  # e.g. the MoE forwards of training steps
        _stack.append(phase)
        try:
            return real(*args, **kwargs)
        finally:
            _stack.pop()
    setattr(owner, name, in_phase)


def install() -> None:
    import m6.train.loop as loop
    from m6.moe import MoELayer

    real_init = loop.Trainer.__init__

    def trainer_init(self, *args, **kwargs):  # a run: its start-up, and the end of its fit, are phase "run"
        events["run"] += 1
        real_init(self, *args, **kwargs)
    loop.Trainer.__init__ = trainer_init
    _phase_of(MoELayer, "forward", "moe_forward")
    _phase_of(loop.Trainer, "train_step", "step")
    _phase_of(loop, "expert_load", "logging_step")  # the loop calls it on logging steps only
    _phase_of(loop.Trainer, "save_checkpoint", "save")
    _phase_of(loop.Trainer, "evaluate", "eval")
    _phase_of(loop.Trainer, "_restore", "resume")
    import m6.memory.activation_memory as activation_memory
    _phase_of(activation_memory, "profile_parts", "recompute_plan")  # the plan's profiling forwards, once
