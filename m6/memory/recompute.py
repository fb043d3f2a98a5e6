"""Recompute (activation checkpointing) of a model's declared parts, applied from outside.

The model declares its *recomputable parts* (``model.recomputable_parts()``: regions that run no
collective and make no routing decision, e.g. M6's attention sub-blocks, local expert FFNs and
dense MLPs). The router, the dispatch (permutation, all-to-all) and the combine stay outside every
part, so their results are kept and never recomputed: a recompute cannot route tokens
differently, change how many tokens an all-to-all sends, or issue a collective a second time.
Parts run under torch.utils.checkpoint (non-reentrant, RNG state preserved: dropout masks are
identical). One exception, by construction: under tensor parallel (m6.parallel.tensor_parallel) an
attention sub-block or dense MLP holds its tp group's collectives (the row-parallel all-reduce;
under sequence parallel an all-gather and a reduce-scatter), which its recompute issues again in
backward; every rank recomputes the same parts in the same order (memory.activation_checkpointing
full), so a tp group's ranks reissue them together.

Parts are wrapped by replacing the method on the module *instance*: the model's code, its module
tree and its parameter names (hence checkpoints) stay exactly as they were. (A deep copy of a
wrapped model would call the original's methods: ``apply(())`` before copying.)
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from m6.model import RecomputablePart


class DeclaresRecomputableParts(Protocol):
    """A model that lists the regions memory code may recompute (see m6.model.recomputable)."""

    def recomputable_parts(self) -> list[RecomputablePart]: ...


def checkpointed(fn: Callable) -> Callable:
    """``fn`` run under torch.utils.checkpoint: only its inputs are kept; it runs again in backward."""
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, nothing to recompute
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    return run


Wrapper = Callable[[RecomputablePart, Callable], Callable]
Escalate = Callable[[str], bool]  # part name -> recompute it this call too (asked as the part starts)


def escalating(name: str, fn: Callable, escalate: Escalate) -> Callable:
    """``fn`` recomputed on the calls where ``escalate(name)`` says so, run plainly on the others."""
    recompute = checkpointed(fn)

    def run(*args, **kwargs):
        if torch.is_grad_enabled() and escalate(name):
            return recompute(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


class RecomputeParts:
    """Which recomputable parts of a model are recomputed; ``apply`` switches them at any time."""

    def __init__(self, model: DeclaresRecomputableParts) -> None:
        self.parts = {p.name: p for p in model.recomputable_parts()}
        self.recomputed: tuple[str, ...] = ()
        self.escalate: Optional[Escalate] = None

    @staticmethod
    def _original(part: RecomputablePart) -> Callable:
        """The class's own method bound to the module, whatever is installed on the instance."""
        return getattr(type(part.module), part.method).__get__(part.module)

    @staticmethod
    def _install(part: RecomputablePart, fn: Optional[Callable]) -> None:
        part.module.__dict__.pop(part.method, None)
        if fn is not None:
            part.module.__dict__[part.method] = fn  # an instance attribute shadows the class method

    def apply(self, names: Iterable[str], escalate: Optional[Escalate] = None) -> None:
        """Recompute the parts ``names`` (an empty list turns checkpointing off); with ``escalate``,
        each other part asks it as it starts whether to be recomputed on that call too."""
        names = tuple(names)
        unknown = [n for n in names if n not in self.parts]
        if unknown:
            raise ValueError(f"unknown recomputable parts {unknown}; this model has {list(self.parts)}")
        for name, part in self.parts.items():
            original = self._original(part)
            if name in names:
                self._install(part, checkpointed(original))
            else:
                self._install(part, None if escalate is None else escalating(name, original, escalate))
        self.recomputed = tuple(n for n in self.parts if n in names)
        self.escalate = escalate

    @contextmanager
    def wrapped(self, wrap: Wrapper) -> Iterator[None]:
        """Run every part through ``wrap(part, original_method)`` for a while (profiling)."""
        previous, escalate = self.recomputed, self.escalate
        try:
            for part in self.parts.values():
                self._install(part, wrap(part, self._original(part)))
            yield
        finally:
            self.apply(previous, escalate)


class RecomputeMismatch(RuntimeError):
    """Gradients with activation checkpointing differ from those without it."""


def check_tolerance(compute_dtype: Optional[torch.dtype]) -> float:
    """Largest gradient difference, relative to the largest gradient, that still counts as equal.

    A recompute runs the same kernels on the same inputs; what may differ is the order in which
    autograd adds gradient contributions (and atomics on GPUs): float rounding, ~1e-7 in fp32, a
    few 1e-3 when activation gradients are bf16. A wrong recompute (another dropout mask, another
    routing) is off by the size of the gradient itself.
    """
    return 1e-5 if compute_dtype in (None, torch.float32, torch.float64) else 2e-2


def _rng_snapshot(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _rng_restore(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def gradient_difference(recompute: RecomputeParts, names: Iterable[str],
                        forward_backward: Callable[[], None], parameters: dict[str, nn.Parameter],
                        device: torch.device) -> tuple[float, str]:
    """Run ``forward_backward`` without and with the parts ``names`` recomputed, from the same RNG
    state; returns (max |g_with - g_without| / max |g_without|, the parameter where it is largest).

    Leaves the parameters' gradients, the RNG and the active parts as it found them.
    """
    names = tuple(names)
    stash = {n: p.grad for n, p in parameters.items()}
    previous, escalate = recompute.recomputed, recompute.escalate
    start = _rng_snapshot(device)
    grads = []
    try:
        for chosen in ((), names):
            for p in parameters.values():
                p.grad = None
            _rng_restore(start, device)
            recompute.apply(chosen)
            forward_backward()
            grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in parameters.items()})
    finally:
        recompute.apply(previous, escalate)
        _rng_restore(start, device)
        for n, p in parameters.items():
            p.grad = stash[n]
    plain, recomputed = grads
    scale = max((g.abs().max().item() for g in plain.values() if g is not None and g.numel()), default=0.0)
    worst, where = 0.0, ""
    for n in parameters:
        a, b = plain[n], recomputed[n]
        if (a is None) != (b is None):
            return math.inf, n
        if a is None or not a.numel():
            continue
        diff = (a.double() - b.double()).abs().max().item()
        if not math.isfinite(diff):
            return math.inf, n
        if diff > worst:
            worst, where = diff, n
    return (worst / scale if scale > 0 else worst), where


def check_recompute(recompute: RecomputeParts, forward_backward: Callable[[], None],
                    parameters: dict[str, nn.Parameter], device: torch.device,
                    compute_dtype: Optional[torch.dtype], group=None) -> str:
    """memory.check_checkpointing: gradients of ``forward_backward`` with every part recomputed
    (so any subset a plan picks is covered: parts are independent) against none; raises
    RecomputeMismatch beyond ``check_tolerance``, else returns the line to log.

    ``group``: the processes that must all pass or all raise (the largest difference of all is used).
    """
    diff, where = gradient_difference(recompute, recompute.parts, forward_backward, parameters, device)
    if group is not None:
        t = torch.tensor([diff], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        diff = t.item()
    tol = check_tolerance(compute_dtype)
    if not diff <= tol:
        raise RecomputeMismatch(
            f"memory.check_checkpointing: gradients with activation checkpointing differ from those without by "
            f"{diff:.3e} of the largest gradient (tolerance {tol:.0e}; this process worst at {where}). A "
            f"recomputed part does not reproduce its forward.")
    return (f"checkpointing check: largest gradient difference with vs without recompute {diff:.3e} "
            f"(relative to the largest gradient; tolerance {tol:.0e}), this process worst at {where or '-'}")
