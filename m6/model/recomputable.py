"""What the model declares recomputable: regions memory code may re-run in backward.

A part runs no collective and makes no routing decision, so recomputing it cannot change how
tokens are routed, how many an all-to-all sends, or issue a collective twice. The model lists its
parts (``M6Model.recomputable_parts``); m6.memory wraps them without knowing the model's internals.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class RecomputablePart:
    """``module.method`` is one region that may be recomputed in backward."""

    name: str
    module: nn.Module
    method: str
