"""The run directory, checked before any work: created if missing and proven writable, or a
ConfigError naming run.dir and what is wrong with it (a file in the way, no permission, a
read-only or virtual filesystem)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from m6.config import ConfigError


def _first_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def prepare_run_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) and write a probe file in it; return it resolved."""
    path = Path(path)
    existing = _first_existing(path)
    if not existing.is_dir():
        where = "is" if existing == path else f"is under {existing}, which is"
        raise ConfigError(f"run.dir: {path} {where} a file, not a directory; choose another run.dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run.dir: cannot create {path} ({e.strerror or e} at {e.filename or existing}); "
                          f"choose a run.dir on a writable filesystem") from e
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".m6-write-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"run.dir: {path} exists but this process (uid {os.getuid()}) cannot write in it "
                          f"({e.strerror or e}); fix its permissions or choose another run.dir") from e
    return path
