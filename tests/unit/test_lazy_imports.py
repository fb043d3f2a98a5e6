"""Start-up cost: importing the training entry point loads none of torch's subsystems a plain run
does not use. torch.distributed.pipelining pulls in torch._dynamo (about a second of every
process's start, every torchrun rank's and every test's); it is imported where a pipeline is
built (m6.train.loop at parallel.pipeline_parallel_size > 1), compile paths import dynamo where
they compile, FSDP2's fully_shard where units are made (m6.parallel.fsdp).

torch.distributed.fsdp itself is not checked: torch.distributed.checkpoint, which m6.checkpoint
imports at module level, loads it (about 0.03 s once DTensor is loaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each loaded only by the runs that use it.
HEAVY = ("torch.distributed.pipelining", "torch._dynamo", "torch._inductor", "deepspeed", "transformers",
         "torch.utils.tensorboard", "wandb")


def _loaded_after(statement: str) -> set[str]:
    """The HEAVY modules in sys.modules after ``statement`` in a fresh interpreter."""
    probe = f"{statement}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(out.stdout.split())


def test_training_entry_point_loads_no_heavy_subsystem():
    assert _loaded_after("import m6.train.cli") == set()


def test_pipeline_step_still_loads_pipelining():
    """The probe sees the modules it names: the pipeline's own module loads torch's pipelining."""
    assert "torch.distributed.pipelining" in _loaded_after("import m6.train.pipeline_step")
