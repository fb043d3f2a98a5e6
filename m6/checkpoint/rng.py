"""Random generator state of one process (python, numpy, torch CPU, CUDA), as a checkpoint holds it.

CUDA: the generator of this process's own device only (the current device, which m6.parallel sets
to the rank's local device at start-up). A rank's stream is its own: resumed at another split of
GPUs per node the rank's device index changes, and its stream goes onto its new device; the
generators of other devices this process can see are never saved nor restored (with all of them
saved per rank, a resume restored another device's stream onto this rank's device).
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch


def _cuda_device() -> int | None:
    """This process's CUDA device, or None when it does not use CUDA (never initialised it)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def rng_state() -> dict:
    """Capture the python, numpy, torch CPU and (when this process uses CUDA) its own device's
    CUDA generator states."""
    device = _cuda_device()
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
        "cuda": torch.cuda.get_rng_state(device) if device is not None else None,
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


def _set_cuda_rng_state(saved: torch.Tensor | list | None) -> None:
    """Restore this rank's CUDA stream onto this process's device (see the module docstring)."""
    device = _cuda_device()
    if device is None:
        return
    if saved is None:
        warnings.warn("checkpoint has no CUDA rng state (saved without CUDA); CUDA draws restart from the run seed")
        return
    if isinstance(saved, (list, tuple)):
        # Older m6 saved every visible device's generator per rank without saying which was the
        # rank's own; restoring a guess could put another device's stream here.
        warnings.warn(f"checkpoint holds the CUDA rng state of {len(saved)} device(s) without naming this rank's "
                      f"own (saved by an older m6); CUDA draws restart from the run seed")
        return
    torch.cuda.set_rng_state(saved.cpu(), device)
