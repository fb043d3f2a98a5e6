"""SIGTERM under torchrun, as a user, Slurm or a cluster scheduler stops a job: torchrun sends SIGTERM
to each worker's process group (the worker and its data-loader workers), waits up to 30 s, then
SIGKILLs; Slurm's scancel and preemption signal every process of the step. Every rank must save
the same step and exit 0, with data workers on."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
from dist_helpers import REPO, free_port

TINY = str(REPO / "configs" / "tiny.yaml")
ARGS = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.moe.every=1",
    "model.moe.num_experts=4", "parallel.expert_parallel_size=2", "train.global_batch_size=8",
    "train.eval_every=0", "train.eval_batches=1", "data.eval_samples=8", "data.num_workers=2", "logging.every=1",
    "checkpoint.every=0", "train.max_steps=1000",
    f'data.sources=[{{path: "{REPO}/data/sample/sample-{{000000..000002}}.tar", weight: 0.9}}, '
    f'{{path: "{REPO}/data/sample/text.txt", format: text, weight: 0.1}}]',
]
# torchrun reports only its own exit (1 after a signal): each worker records its exit code.
RECORD_EXIT = """import os, sys
from m6.train.cli import main
code = main(sys.argv[1:])
with open(os.path.join(os.environ["M6_TEST_EXITS"], "rank" + os.environ["RANK"]), "w") as f:
    f.write(str(code))
sys.exit(code)
"""


def signal_every_process(agent_pid: int) -> None:
    """SIGTERM as Slurm's scancel or preemption sends it: to every process of the job step (here
    each worker's process group, its data workers included), then to torchrun, which forwards it
    again: each worker receives it twice."""
    for worker in pathlib.Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split():
        os.killpg(int(worker), signal.SIGTERM)  # torchrun starts each worker in its own session
    os.kill(agent_pid, signal.SIGTERM)


@pytest.mark.parametrize("deliver", ["to torchrun", "to every process"])
def test_sigterm_saves_the_agreed_step_on_every_rank_and_exits_0(tmp_path, deliver):
    """2 ranks (expert-parallel 2), 2 data workers each; SIGTERM after the first logged step, to
    torchrun (which forwards it to each worker's process group) or to every process at once.
    Every rank records exit code 0, the stop step's checkpoint is complete, nothing died of the
    signal."""
    script = tmp_path / "record_exit.py"
    script.write_text(RECORD_EXIT)
    exits = tmp_path / "exits"
    exits.mkdir()
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), M6_TEST_EXITS=str(exits))
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(free_port()), str(script), "--config", TINY, *ARGS,
                              f"run.dir={run}"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        for line in agent.stdout:
            if line.startswith("step"):
                if deliver == "to torchrun":
                    agent.send_signal(signal.SIGTERM)
                else:
                    signal_every_process(agent.pid)
                break
        out, err = agent.communicate(timeout=120)
    finally:
        agent.kill()
    assert sorted(p.name for p in exits.iterdir()) == ["rank0", "rank1"], err[-3000:]
    assert [(exits / f"rank{r}").read_text() for r in (0, 1)] == ["0", "0"], err[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("SIGTERM: stopped after step")]
    assert len(stopped) == 1, out[-2000:]
    step = int(stopped[0].split()[4])
    step_dir = run / "checkpoints" / f"step_{step:08d}"
    assert (step_dir / ".metadata").is_file(), sorted(p.name for p in step_dir.parent.iterdir())
    assert "killed by signal" not in err and "exited unexpectedly" not in err, err[-3000:]
