"""zero's streamed blocks: the 16-bit gradient lands in the block's 16-bit host home
(``memory.zero_grad_landing``), one host buffer per parameter for its weights and its gradient.

Why it holds. A streamed block's home (m6.memory.offload.ParamStreamer) is read only to copy the
block's weights to the device: before its forward and before its backward, in every micro-batch.
With 16-bit host gradients (``memory.host_grad_dtype: compute``) a gradient is never summed on the
host: with accumulation it adds up on the device and leaves once, in the step's last backward
(ParameterUpdate.backward), after that backward's fetch of its block, the step's last read of the
home (recompute re-runs parts inside a block on the fetched weights, never the block's own
fetch). From then on the home holds the gradient; the clip reads the gradients' norm from it, the
update reads it back in fp32 group by group (HostOffload.materialize_grads, before the group
updates) and then casts the new master into it (HostOffload._copy_back, after the group updates),
so before the next forward fetches it the home holds the weights again. The separate 16-bit host
gradients of the streamed blocks (2 B per streamed parameter) are not allocated.

On CUDA the block's fetch (host -> device) and the gradient's copy (device -> host) both run on
offload's one copy stream, which runs its copies in the order they were issued: the gradient's
copy is issued after the block's backward ran, which waited for the fetch's event, so the fetch
has completed before the gradient overwrites the home; no event or host wait is added. The host
reads the home once ``finish_backward`` has waited for the copy stream (its one wait per step).

A step skipped (non-finite or fp16 overflow) or gradients dropped without an update: the homes
that received a gradient are cast again from their masters (``restore``), which the skipped
update left unchanged; on CUDA after the gradients' copies have landed.

Not with the delayed update (``optim.delayed_update``): step t+1's forward fetches the homes while
step t's gradients wait in them for the update running in the background; config.py refuses
``home`` with it and ``auto`` keeps the separate gradients there. Parameters whose home is fp32
(the MoE routers' gates) keep a separate 16-bit gradient buffer.
"""

from __future__ import annotations

from typing import Mapping

import torch

from m6.config import Config


def grads_land_in_homes(cfg: Config) -> bool:
    """Whether this config's streamed zero blocks take their gradients into their homes:
    ``home``, or ``auto`` where it applies (zero, 16-bit host gradients, no delayed update)."""
    landing = cfg.memory.zero_grad_landing
    if landing == "separate" or cfg.memory.offload != "zero":
        return False
    return landing == "home" or (cfg.memory.host_grad_dtype == "compute" and not cfg.optim.delayed_update)


class HomeGradLanding:
    """The streamed homes that double as their parameters' 16-bit host gradient buffers, and which
    of them hold a gradient now (received since the last cast of their master)."""

    def __init__(self, homes: Mapping[int, torch.Tensor], grad_dtype: torch.dtype) -> None:
        """``homes``: id(param) -> its host home (ParamStreamer.homes); those of ``grad_dtype`` take
        their gradients."""
        self.buffers = {k: h for k, h in homes.items() if h.dtype == grad_dtype}
        self._holding: set[int] = set()  # id(param) of the homes holding a gradient

    def landed(self, param_id: int) -> None:
        """The gradient of ``param_id`` was copied into its home."""
        if param_id in self.buffers:
            self._holding.add(param_id)

    def rewritten(self, param_id: int) -> None:
        """The master of ``param_id`` was cast into its home: it holds the weights again."""
        self._holding.discard(param_id)

    @property
    def holding(self) -> bool:
        return bool(self._holding)

    def restore(self, masters: Mapping[int, torch.Tensor]) -> None:
        """Cast the master (id(param) -> fp32 master) into every home holding a gradient; the caller
        has made sure the gradients' copies have landed."""
        for k in sorted(self._holding):
            self.buffers[k].copy_(masters[k])
        self._holding.clear()

    def nbytes(self) -> int:
        """Host bytes of gradient buffers this saves (the homes taking gradients)."""
        return sum(h.numel() * h.element_size() for h in self.buffers.values())
