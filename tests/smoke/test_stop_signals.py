"""Stop signals as launchers deliver them: to the whole process group, data-loader workers
included (Slurm's scancel and preemption, a terminal's Ctrl-C, torchrun: its test is in
tests/dist/test_stop_signals_dist.py). The run saves the step it stops at and exits 0; a second
Ctrl-C ends it at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
# The embedded sample corpus through the real loader with 2 worker processes (the workers are what
# a group signal reaches besides the main process).
FILES = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.moe.every=1",
    "model.moe.num_experts=4", "train.global_batch_size=8", "train.eval_every=0", "train.eval_batches=1",
    "data.eval_samples=8", "data.num_workers=2", "logging.every=1", "checkpoint.every=0", "train.max_steps=1000",
    f'data.sources=[{{path: "{REPO}/data/sample/sample-{{000000..000002}}.tar", weight: 0.9}}, '
    f'{{path: "{REPO}/data/sample/text.txt", format: text, weight: 0.1}}]',
]


def start_in_own_group(run_dir: Path) -> subprocess.Popen:
    """train.py as the leader of its own session and process group (as under a launcher), its
    data workers inside that group."""
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", TINY, *FILES, f"run.dir={run_dir}"],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for_step(proc: subprocess.Popen, step: int) -> None:
    for line in proc.stdout:
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= step:
            return
    pytest.fail(f"the run ended before step {step}: {proc.communicate()[1][-2000:]}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_group_saves_the_stop_step_and_exits_0(tmp_path, sig):
    """SIGTERM (scancel, preemption) or SIGINT (Ctrl-C) to every process of the group at once:
    the data workers ignore it, the main process finishes its step, saves it and exits 0."""
    proc = start_in_own_group(tmp_path)
    try:
        wait_for_step(proc, 2)
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    name = signal.Signals(sig).name
    stopped = [line for line in out.splitlines() if line.startswith(f"{name}: stopped after step")]
    assert len(stopped) == 1, out[-2000:]
    step = int(stopped[0].split()[4])
    assert (tmp_path / "checkpoints" / f"step_{step:08d}").is_dir()
    assert "Traceback" not in err and "killed by signal" not in err, err[-3000:]


def test_a_second_ctrl_c_stops_at_once():
    """Ctrl-C twice: the first asks for the stop, the second ends the process at once with one
    line and exit 130 (the handler's own process: two signals sent to a training run would merge
    into one while it is busy, or arrive after its save)."""
    script = ("import os, signal, time\n"
              "from m6.train.preemption import StopOnSignal\n"
              "stop = StopOnSignal()\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "assert stop.requested() and stop.signal_name == 'SIGINT'\n"
              "print('stopping', flush=True)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, text=True, capture_output=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stdout == "stopping\n"
    assert proc.stderr == "SIGINT again: stopped at once, without a checkpoint of the current step\n"


def test_ctrl_c_while_the_run_is_built_is_one_line_and_130(monkeypatch, capsys):
    """Before the first step (building the model, reading a checkpoint) nothing is to be saved:
    one line, exit 130, no KeyboardInterrupt traceback."""
    from m6.train import cli

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "train", interrupted)
    assert cli.main(["--config", TINY, "data.kind=synthetic", "data.sources=[]"]) == 130
    assert capsys.readouterr().err == "SIGINT outside the training steps: stopped without a checkpoint\n"


def test_a_process_that_steps_without_fit_exits_with_its_workers(tmp_path):
    """A script that builds a Trainer and calls train_step (a benchmark, an evaluation) and then
    simply ends: the interpreter's exit stops the data workers, though they ignore SIGTERM (which is
    how multiprocessing ends daemonic children at exit: without the loader's exit handler the process
    waits on them for ever)."""
    script = (
        "import sys\n"
        "from m6.config import load\n"
        "from m6.train.loop import Trainer\n"
        f"cfg = load({TINY!r}, {FILES!r} + ['logging.console=false', 'run.dir=' + sys.argv[1]])\n"
        "Trainer(cfg).train_step()\n"
        "print('stepped', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert proc.returncode == 0 and "stepped" in proc.stdout, proc.stderr[-2000:]
