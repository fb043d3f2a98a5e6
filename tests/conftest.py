"""Session-wide test setup: one build cache for DeepSpeed's cpu_adam op (memory.host_optimizer).

The op compiles on first use (~1-2 min on 2 cores). Unless TORCH_EXTENSIONS_DIR is set already,
every test, and every process a test starts (they inherit the environment), builds into and loads
from the pytest cache: a fresh CI checkout pays the build once, later runs none.
"""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    if not os.environ.get("TORCH_EXTENSIONS_DIR") and getattr(config, "cache", None) is not None:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(config.cache.mkdir("torch_extensions"))
