"""Random generator state of one process (python, numpy, torch CPU, CUDA), as a checkpoint holds it."""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch


def rng_state() -> dict:
    """Capture the python, numpy, torch CPU and (when available) all CUDA generator states."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        # numpy's key is a uint32 ndarray, which weights_only loading refuses; a tensor round-trips.
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    """Restore generator states captured by `rng_state` so random draws continue identically."""
    missing = [k for k in ("python", "numpy", "torch", "cuda") if k not in state]
    if missing:
        raise ValueError(f"rng state is missing {missing}; expected the dict returned by rng_state()")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np_state["key"].cpu().numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    # .cpu(): a checkpoint loaded with map_location="cuda" moves these too, but generators want CPU bytes.
    torch.set_rng_state(state["torch"].cpu())
    _set_cuda_rng_state(state["cuda"])


def _set_cuda_rng_state(saved: list[torch.Tensor] | None) -> None:
    """Restore CUDA generators for the devices present both now and at save time."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved is None:
        if available:
            warnings.warn("checkpoint has no CUDA rng state (saved without CUDA); CUDA draws will differ")
        return
    # Resuming on a machine with a different GPU count is legitimate, so warn rather than refuse.
    if len(saved) != available:
        warnings.warn(
            f"checkpoint has CUDA rng state for {len(saved)} device(s) but {available} are visible; "
            f"restoring the first {min(len(saved), available)}"
        )
    for device, device_state in enumerate(saved[:available]):
        torch.cuda.set_rng_state(device_state.cpu(), device)
