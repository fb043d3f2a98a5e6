"""Builds the preload library (fakecuda.cpp) once per torch version and source, and starts
scenario processes under it.

The library is compiled with g++ against the headers that ship in torch's CPU wheel, into a cache
outside the repository (``$M6_SIMCUDA_CACHE``, else ``$XDG_CACHE_HOME/m6-simcuda`` or
``~/.cache/m6-simcuda``), one folder per torch version and source hash: a fresh CI checkout pays the
~30 s build once. What cannot work here (no compiler, no headers, a CUDA build of torch) is a
``SimulationUnavailable`` with the reason, which the tests turn into a skip; a compiler that is
present and fails is an error, not a skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SOURCE = HERE / "fakecuda.cpp"


class SimulationUnavailable(RuntimeError):
    """Simulated CUDA cannot be built on this machine (the reason says what is missing)."""


def _torch_facts() -> tuple[str, Path, bool, str | None]:
    """(torch version, torch package dir, C++11 ABI, torch's CUDA version), read in a child
    process so this process never imports torch before the preload would have to be in place."""
    code = ("import json, os, torch; print(json.dumps([torch.__version__, os.path.dirname(torch.__file__), "
            "bool(torch._C._GLIBCXX_USE_CXX11_ABI), torch.version.cuda]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    version, root, abi, cuda = json.loads(out.strip().splitlines()[-1])
    return version, Path(root), abi, cuda


def cache_root() -> Path:
    if os.environ.get("M6_SIMCUDA_CACHE"):
        return Path(os.environ["M6_SIMCUDA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "m6-simcuda"


def build_preload() -> Path:
    """The path of the compiled preload library (built now if the cache has none for this torch)."""
    version, torch_dir, abi, cuda = _torch_facts()
    if cuda is not None:
        raise SimulationUnavailable(f"torch {version} is a CUDA build (CUDA {cuda}); simulated CUDA needs a "
                                    "CPU-only torch (on a GPU machine run the real-device tests instead)")
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise SimulationUnavailable(f"no C++ compiler: {os.environ.get('CXX', 'g++')} is not on PATH (set CXX)")
    include, libdir = torch_dir / "include", torch_dir / "lib"
    needed = [include / "c10/core/impl/FakeGuardImpl.h", include / "ATen/detail/CUDAHooksInterface.h"]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise SimulationUnavailable(f"torch {version} ships without the C++ headers this needs: {', '.join(missing)}")
    flags = ["-shared", "-fPIC", "-O1", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={int(abi)}",
             f"-I{include}", f"-I{include / 'torch/csrc/api/include'}", f"-L{libdir}", "-lc10", "-ltorch_cpu",
             f"-Wl,-rpath,{libdir}"]
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    out = cache_root() / f"torch-{version}" / key / "libm6simcuda.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_lib = Path(tmp) / out.name
        result = subprocess.run([compiler, str(SOURCE), *flags, "-o", str(tmp_lib)], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building the simulated-CUDA preload library failed ({compiler}, torch {version}):\n"
                               f"{result.stderr[-4000:]}")
        os.replace(tmp_lib, out)  # atomic: a concurrent build never sees half a library
    return out


class ScenarioRun:
    """``scenarios.py GROUP`` running in a fresh process with the library preloaded (started at
    construction, so several groups run side by side); ``report()`` waits and returns its JSON."""

    def __init__(self, group: str, library: Path, timeout_s: float = 600.0) -> None:
        self.group, self.timeout_s = group, timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix=f"m6-simcuda-{group}-")
        tmp = Path(self._tmp.name)
        self._report_path, self._log_path = tmp / "report.json", tmp / "output.log"
        env = dict(os.environ, LD_PRELOAD=str(library), PYTHONPATH=os.pathsep.join(
            [str(REPO), str(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
        # One thread each: the scenarios are many small ops, and the groups run side by side.
        env["OMP_NUM_THREADS"] = "1"
        self._log = open(self._log_path, "w")
        (tmp / "work").mkdir()
        self._proc = subprocess.Popen([sys.executable, str(HERE / "scenarios.py"), group, str(self._report_path),
                                       str(tmp / "work")], cwd=REPO, env=env, stdout=self._log,
                                      stderr=subprocess.STDOUT, text=True)
        self._report: dict | None = None

    def report(self) -> dict:
        if self._report is None:
            try:
                code = self._proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                code = "killed after the timeout"
            self._log.close()
            tail = self._log_path.read_text()[-6000:]
            if code != 0 or not self._report_path.is_file():
                written = "its report written" if self._report_path.is_file() else "no report written"
                raise RuntimeError(f"simulated-CUDA scenario group {self.group!r} exited with {code} ({written}):\n{tail}")
            data = json.loads(self._report_path.read_text())
            if not data.get("complete"):
                raise RuntimeError(f"simulated-CUDA scenario group {self.group!r} wrote an incomplete report:\n{tail}")
            data["output_tail"] = tail
            self._report = data
            self._tmp.cleanup()
        return self._report


def scenario_result(report: dict, name: str) -> dict:
    """One scenario's result from a group's report (a scenario function's, or one variant of it);
    raises with the traceback when the scenario crashed."""
    for key, result in report["scenarios"].items():
        if "crashed" in result:
            raise RuntimeError(f"scenario {key!r} of group {report['group']!r} crashed:\n{result['crashed']}")
        if key == name:
            return result
        if name in result:
            return result[name]
    raise KeyError(f"no scenario {name!r} in group {report['group']!r}")
