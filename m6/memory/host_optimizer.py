"""Which optimizer runs the offloaded host update (``memory.host_optimizer``), and DeepSpeed's
cpu_adam op behind it: built once per machine into a per-user cache, loaded by every later run.

    auto       DeepSpeed's CPU Adam when its op builds or loads, else torch's AdamW with one line
               saying why and what it costs
    deepspeed  DeepSpeed's CPU Adam; an op that cannot be built is a config error (exit 2)
    torch      torch's foreach AdamW, the optimizer of a run without offload

The op is a C++ extension that DeepSpeed compiles on first use (~1-2 min). ``TORCH_EXTENSIONS_DIR``
decides where; unset, m6 sets it to a cache directory named after the python, torch and deepspeed
versions (torch's own default names only the python version, so a torch upgrade could load an
extension built against the old one).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from m6.config import ConfigError
from m6.memory.cpu_info_once import install as install_cpu_info_once

HOST_OPTIMIZERS = ("auto", "deepspeed", "torch")
OP_NAME = "cpu_adam"
# What the fallback costs, as measured in bench/results/host_optimizer-cpu-2core.md (docs/memory.md: Host optimizer).
FALLBACK_COST = ("its host update takes about 4x as long as DeepSpeed's CPU Adam (4.1x at 25M, 4.5x at 100M "
                 "parameters, measured on 2 CPU cores)")

Log = Callable[[str], None]


def default_extensions_dir() -> Path:
    """``$XDG_CACHE_HOME/m6/torch_extensions/<python>-torch<version>-deepspeed<version>`` (``~/.cache``
    without XDG_CACHE_HOME): stable per user and machine, and new for each torch / deepspeed version."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    try:
        deepspeed_version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed_version = "none"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}-deepspeed{deepspeed_version}"
    return cache / "m6" / "torch_extensions" / tag


def extensions_dir() -> Path:
    """Where the op is (or will be) built: ``TORCH_EXTENSIONS_DIR``, set to the default if unset
    (torch reads the variable itself when it builds, so it is set, not passed)."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(default_extensions_dir())
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def _is_built(root: Path) -> bool:
    """Whether loading the op will not compile it: loaded in this process already, installed
    prebuilt (DS_BUILD_CPU_ADAM=1), or in the cache."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    return (OP_NAME in OpBuilder._loaded_ops or bool(installed_ops.get(OP_NAME))
            or (root / OP_NAME / f"{OP_NAME}.so").exists())


def load_cpu_adam(log: Log) -> ModuleType:
    """DeepSpeed's cpu_adam op, compiled into ``extensions_dir()`` on first use (one line said then).

    Raises whatever importing deepspeed or building the op raises (no compiler, no ninja, ...).
    """
    root = extensions_dir()
    # Imported here: importing deepspeed takes ~2 s, which a run without offload does not pay.
    from deepspeed.ops.op_builder import CPUAdamBuilder

    install_cpu_info_once()  # DeepSpeed asks py-cpuinfo (~1 s each) at every op load and optimizer

    if not _is_built(root):
        log(f"building DeepSpeed's {OP_NAME} op into {root} (once per machine and torch/deepspeed version, ~1-2 min)")
    return CPUAdamBuilder().load(verbose=False)


_ERROR_LINE = re.compile(r"\berror\b|not found|no such file|fatal|cannot", re.IGNORECASE)


def error_gist(error: BaseException) -> str:
    """One line out of a failed load: the message's head and, when it carries a build log (torch:
    "Error building extension 'cpu_adam': <log>"), the log's first error line, not a command line."""
    text = str(error).strip() or type(error).__name__
    first, _, rest = text.partition("\n")
    head, sep, tail = first.partition(": ")
    lines = [tail, *rest.splitlines()] if sep else rest.splitlines()
    detail = next((line.strip() for line in lines if _ERROR_LINE.search(line) and " -c " not in line
                   and not line.lstrip().startswith(("[", "FAILED"))), None)
    gist = f"{type(error).__name__}: " + (f"{head}: {detail}" if detail else first)
    return gist if len(gist) <= 300 else gist[:297] + "..."


def probe_cpu_adam(log: Log, load: Callable[[Log], ModuleType] | None = None) -> str | None:
    """None when the op loads (building it if needed), else the gist of why not."""
    try:
        (load or load_cpu_adam)(log)
    except Exception as e:  # noqa: BLE001 - any failure of a third-party build means: not available
        return error_gist(e)
    return None


def choose_host_optimizer(choice: str, failures: dict[int, str], log: Log) -> str:
    """"deepspeed" or "torch" for ``memory.host_optimizer`` = ``choice``, given the ranks whose op
    failed (rank -> gist; every rank passes the same, so every rank chooses the same)."""
    if choice not in HOST_OPTIMIZERS:
        raise ConfigError(f"memory.host_optimizer must be one of {HOST_OPTIMIZERS}, got {choice!r}")
    if choice == "torch":
        return "torch"
    if not failures:
        return "deepspeed"
    where = "" if list(failures) == [0] else f" on rank{'s' if len(failures) > 1 else ''} " \
        f"{', '.join(map(str, sorted(failures)))}"
    rank, gist = min(failures.items())
    why = f"DeepSpeed's {OP_NAME} op could not be built or loaded{where} ({'' if where == '' else f'rank {rank}: '}{gist})"
    if choice == "deepspeed":
        raise ConfigError(f"memory.host_optimizer=deepspeed: {why}. Building it needs a C++ compiler and ninja; "
                          "or set memory.host_optimizer=torch (or auto) to run the host update with torch's AdamW")
    log(f"memory.host_optimizer=auto: {why}; the offloaded update uses torch's AdamW instead: {FALLBACK_COST}")
    return "torch"


def thread_note(local_world_size: int) -> str | None:
    """A hint when the offloaded update (the host's gradient clip and optimizer step, DeepSpeed's or
    torch's) would run on one thread although the node has cores to spare (torchrun sets
    OMP_NUM_THREADS=1 when it starts several processes per node)."""
    spare = (os.cpu_count() or 1) // max(1, local_world_size)
    if torch.get_num_threads() == 1 and spare > 1:
        return (f"the offloaded update (host gradient clip and optimizer) runs on 1 thread "
                f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); "
                f"OMP_NUM_THREADS={spare} (cores per process on this node) makes the offloaded update faster")
    return None
