"""``train.compile``: torch.compile of each transformer block's dense parts, applied from outside.

What is compiled (``blocks``), per block, as torchtitan compiles per block:
- the attention sub-block ``TransformerBlock.attention_residual`` (norm, QKV, SDPA, output
  projection, dropout, residual add): one graph;
- the FFN's norm (``block.ffn_norm``: torch.compile skips frames of torch's own modules, so the
  compiled forward is ``_layer_norm_forward`` below, nn.LayerNorm's own one line);
- a dense block's MLP (``DenseMLP.forward``).
The MoE layer (router, dispatch, all-to-all, grouped expert GEMMs, combine) stays eager: its
shapes depend on the routing (host-int splits), its custom autograd Functions and collectives are
not graphs. The embeddings, the final norm and the LM head stay eager too.

How, so that nothing else changes:
- Names: no wrapper module (no ``_orig_mod.`` in any parameter name). A method is compiled by
  giving the module a subclass of its own class whose method is the compiled one (the way FSDP2's
  ``fully_shard`` swaps a module's class). State dict keys, hence checkpoints, are those of the
  eager model, and a module's own attributes (its parameters, hooks) stay where they were.
- Recompute: m6.memory.recompute wraps a part's method *as the class defines it*; with the class
  swapped that is the compiled method, so a recomputed part is ``checkpoint(compiled fn)``: the
  compiled graph runs again in backward, and the plan's per-call escalation stays a Python choice
  outside every graph.
- FSDP2: applied before ``fully_shard`` (which then subclasses the swapped class); its gather and
  reduce-scatter hooks run around the block's eager forward, outside the compiled regions. (Its
  class swap fails dynamo's type guards once, so a sharded model's blocks compile their own graphs.)
- Cast-on-use bf16: its autograd Functions are traced by dynamo (forward and backward), the
  autocast state is the one around the call.
All blocks share one compiled code object per region (the module is an argument, its parameters
graph inputs), so N blocks of one shape compile once, not N times; a new input shape (another
micro-batch size, eval) compiles again, dynamic after the second.

Compilation is lazy (at the first call): ``compile_seconds`` reads torch.compile's own timers, so
the loop can report what the first step spent compiling.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from m6.model.block import DenseMLP, TransformerBlock
from m6.parallel.pipeline import StageGap


def _layer_norm_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """nn.LayerNorm.forward, defined here because dynamo does not trace a frame of torch's own code."""
    return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


# The regions compiled per class: class -> method name -> the function compiled in its place.
_COMPILED_METHODS = {
    TransformerBlock: {"attention_residual": TransformerBlock.attention_residual},
    DenseMLP: {"forward": DenseMLP.forward},
    nn.LayerNorm: {"forward": _layer_norm_forward},
}
_compiled_classes: dict[type, type] = {}


class CompileFailed(RuntimeError):
    """torch.compile could not compile a region (no C++ compiler for inductor on CPU, no Triton
    on a GPU, an inductor bug): the run stops with one line that says so, not the backend's trace."""


def _compiler_failures() -> tuple[type, ...]:
    """Failures of the compiler itself; an error in the traced code (a wrong shape) raises as it
    would eagerly. Imported when needed: torch._dynamo takes seconds to import."""
    from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError
    from torch._inductor.exc import InductorError
    return BackendCompilerFailed, InternalTorchDynamoError, InductorError


def _compiled(fn, region: str):
    """``fn`` under torch.compile; a failure to compile it raises CompileFailed naming ``region``."""
    compiled = torch.compile(fn)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except Exception as e:
            if not isinstance(e, _compiler_failures()):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CompileFailed(f"train.compile=blocks: torch.compile failed on {region} ({first[:300]}); "
                                f"train.compile=false runs eager") from e
    return run


def _compiled_class(cls: type) -> type:
    """A subclass of ``cls`` whose regions are compiled (one per class, so every block of the
    class shares the compiled code and its cache)."""
    if cls not in _compiled_classes:
        methods = {name: _compiled(fn, f"{cls.__name__}.{name}") for name, fn in _COMPILED_METHODS[cls].items()}
        _compiled_classes[cls] = type(f"Compiled{cls.__name__}", (cls,), {"__module__": cls.__module__, **methods})
    return _compiled_classes[cls]


def _swap_class(module: nn.Module) -> None:
    for cls in _COMPILED_METHODS:
        if type(module) is cls:
            module.__class__ = _compiled_class(cls)
            return
    if type(module) not in _compiled_classes.values():
        raise TypeError(f"train.compile=blocks: no compiled regions for {type(module).__name__}")


@dataclass(frozen=True)
class CompiledBlocks:
    """What ``compile_blocks`` compiled: the number of blocks and the regions of each."""

    num_blocks: int  # this rank's (at pipeline parallel: its stages')
    regions: tuple[str, ...]  # e.g. ("attention", "ffn_norm", "mlp")


def compile_blocks(model: nn.Module) -> CompiledBlocks:
    """Compile the dense parts of every block of ``model`` (``model.blocks``) in place; the MoE
    layers stay eager. Call on the model before recompute and FSDP2 wrap it."""
    regions = {"attention", "ffn_norm"}
    num_blocks = 0
    for block in model.blocks:
        if isinstance(block, StageGap):  # another pipeline stage's block: that stage's rank compiles it
            continue
        num_blocks += 1
        if not isinstance(block, TransformerBlock):
            raise TypeError(f"train.compile=blocks expects TransformerBlocks, got {type(block).__name__}")
        _swap_class(block)
        _swap_class(block.ffn_norm)
        if isinstance(block.ffn, DenseMLP):
            _swap_class(block.ffn)
            regions.add("mlp")
    order = ("attention", "ffn_norm", "mlp")
    return CompiledBlocks(num_blocks, tuple(r for r in order if r in regions))


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process so far (dynamo's tracing and the
    backend's compile of forward and backward graphs, by its own timers)."""
    if "torch._dynamo.utils" not in sys.modules:  # nothing compiled yet, and no import of it for nothing
        return 0.0
    from torch._dynamo.utils import compilation_time_metrics
    return float(sum(sum(times) for name, times in compilation_time_metrics.items()
                     if name in _TOP_LEVEL_TIMERS))


def compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far (each region's first compile and
    every recompile; a region run eagerly counts none)."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


# The outermost of torch.compile's timers, so nothing is counted twice: a frame's compile
# (dynamo tracing plus the forward graph's backend compile), and a backward graph compiled lazily.
_TOP_LEVEL_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
