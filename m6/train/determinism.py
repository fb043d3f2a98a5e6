"""train.deterministic: the same inputs give bitwise the same run on a GPU too.

On the CPU, m6's steps are bitwise reproducible as they are (resume continues identically). On
CUDA several ops m6 runs every step accumulate with atomics, in an order that changes from run to
run: index_add in the MoE combine, index_select's backward (the dispatch gather), the embedding's
backward and the attention (SDPA) backward; cuBLAS may also pick split reductions. With
``train.deterministic: true`` torch's deterministic algorithms are required
(``torch.use_deterministic_algorithms``: those ops switch to sort-based or fixed-order kernels,
and an op without one raises instead of silently differing), cuDNN is pinned, and cuBLAS gets the
fixed workspace its deterministic mode needs (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts,
so it is set before the first matmul of the process). Costs speed on a GPU; nothing on a CPU.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

CUBLAS_WORKSPACE = ":4096:8"


def use_determinism(enabled: bool) -> Callable[[], None]:
    """Apply ``train.deterministic`` to this process; returns what restores the previous settings."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def restore() -> None:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]

    return restore
