"""Tests for m6.train.loggers: jsonl, console line, W&B mode resolution, and an offline W&B round trip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from m6.train import loggers
from m6.train.loggers import MetricsLogger, WandbSettings, format_duration, resolve_wandb_mode

WANDB_EXE = Path(sys.executable).parent / "wandb"
CONFIG = {"model": {"dim": 64, "moe": {"num_experts": 4}}, "optim": {"lr": 0.001}, "run": {"name": "t"}}


@pytest.fixture(autouse=True)
def isolated_wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point HOME at a temp dir and clear W&B env vars so no real credentials or settings are read."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL", "NETRC", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    # wandb stages table files under its data dir (default ~/.local/share/wandb); keep it in tmp.
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    return home


class FakeClock:
    """A perf_counter stand-in whose time the test sets, so s/step and ETA are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_parse_in_order(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path / "run", CONFIG, WandbSettings(), total_steps=100, console=False)
    logger.log(1, {"loss": 4.5, "lr": 1e-4})
    logger.log(2, {"loss": 4.25, "lr": 2e-4, "moe/dropped": 3})
    # The jsonl must be complete before close: a crash after log() may not lose the line.
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1] == {"step": 2, "loss": 4.25, "lr": 2e-4, "moe/dropped": 3}
    logger.log_eval(2, {"loss": 4.0, "ppl": 54.6})
    logger.close()
    logger.close()  # idempotent
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 1, "loss": 4.5, "lr": 1e-4},
        {"step": 2, "loss": 4.25, "lr": 2e-4, "moe/dropped": 3},
        {"step": 2, "eval/loss": 4.0, "eval/ppl": 54.6},
    ]


def test_expert_tokens_ride_on_the_training_row_as_ints(tmp_path: Path) -> None:
    import numpy as np
    import torch

    logger = MetricsLogger(tmp_path, CONFIG, WandbSettings(), total_steps=10, console=False)
    # As m6.train.metrics.expert_load gives them (int64 tensor .tolist()); a numpy int must work too.
    counts = {"block1": torch.tensor([0, 7, 123456, 3]).tolist(), "block3": [np.int64(2), 5, 1, 0]}
    logger.log(5, {"loss": 1.5}, expert_tokens=counts)
    logger.log(6, {"loss": 1.25}, expert_tokens={})  # a dense model: no key at all
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 5, "loss": 1.5, "expert_tokens": {"block1": [0, 7, 123456, 3], "block3": [2, 5, 1, 0]}},
        {"step": 6, "loss": 1.25},
    ]
    # Compact: ints as written by hand, no spaces, the counts after the scalars.
    assert lines[0] == '{"step":5,"loss":1.5,"expert_tokens":{"block1":[0,7,123456,3],"block3":[2,5,1,0]}}'


def test_expert_tokens_line_length_at_scale(tmp_path: Path) -> None:
    """24 MoE layers x 512 experts of 4-digit counts: one line of ~5 bytes a count (~60 KB)."""
    logger = MetricsLogger(tmp_path, CONFIG, WandbSettings(), total_steps=10, console=False)
    counts = {f"block{i}": [1000 + (e * 37 + i) % 9000 for e in range(512)] for i in range(24)}
    logger.log(1, {"loss": 1.0}, expert_tokens=counts)
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line)["expert_tokens"] == counts
    assert len(line) <= 24 * 512 * 5 + 24 * 12 + 100, len(line)


def test_jsonl_appends_on_resume_and_converts_scalars(tmp_path: Path) -> None:
    import numpy as np

    first = MetricsLogger(tmp_path, CONFIG, WandbSettings(), total_steps=10, console=False)
    first.log(1, {"loss": np.float32(2.5)})
    first.close()
    second = MetricsLogger(tmp_path, CONFIG, WandbSettings(), total_steps=10, console=False)
    second.log(2, {"loss": 2.0})
    second.summary({"final_loss": np.float64(2.0), "steps": 2})
    second.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final_loss": 2.0, "steps": 2}


def test_console_line_format(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(loggers, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    logger = MetricsLogger(tmp_path, CONFIG, WandbSettings(), total_steps=200)
    # The first log: the step's own time (0.50 s/step; 190 steps left -> 95 s) and tokens.
    logger.log(10, {"loss": 3.5, "lr": 5e-4, "tokens_per_s": 999.6, "step_time_s": 0.5})
    clock.now = 20.0  # 40 steps in 20 s -> 0.50 s/step; 150 steps left -> 75 s
    logger.log(50, {"loss": 3.21449, "lr": 1e-3, "tokens_per_s": 12345.4, "step_time_s": 0.5})
    clock.now = 45.0  # steps 50..100 in 25 s -> 0.50 s/step; 100 left -> 50 s
    logger.log(100, {"loss": 3.0, "lr": 1e-3, "grad_norm": 0.75, "tokens_per_s": 12345.4, "step_time_s": 0.5})
    logger.log_eval(100, {"loss": 2.98765, "tokens": 4096})
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step    10/200 | loss 3.5000 | lr 5.00e-04 | 1,000 tok/s | 0.50 s/step | eta 0:01:35",
        "step    50/200 | loss 3.2145 | lr 1.00e-03 | 12,345 tok/s | 0.50 s/step | eta 0:01:15",
        "step   100/200 | loss 3.0000 | lr 1.00e-03 | gnorm 0.750 | 12,345 tok/s | 0.50 s/step | eta 0:00:50",
        "eval step   100/200 | loss 2.988 | tokens 4096",
    ]


def test_console_off_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    logger = MetricsLogger(tmp_path, CONFIG, WandbSettings(), total_steps=10, console=False)
    logger.log(1, {"loss": 1.0})
    logger.log_eval(1, {"loss": 1.0})
    logger.close()
    assert capsys.readouterr().out == ""


def test_speed_is_one_window_for_tokens_seconds_and_eta_and_ignores_a_stall(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """tok/s, s/step and the ETA come from the same logged interval, the median of the last
    SPEED_WINDOW: one stalled interval (a save, a slow read) moves none of them; a lasting change
    of speed shows within a few logs."""
    clock = FakeClock()
    monkeypatch.setattr(loggers, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    logger = MetricsLogger(tmp_path, CONFIG, WandbSettings(), total_steps=10_000)
    assert logger.speed() is None

    def log(step: int, seconds: float) -> str:  # 10 steps of `seconds` each, 1,000 tokens per step
        clock.now += 10 * seconds
        logger.log(step, {"loss": 1.0, "tokens_per_s": 1000 / seconds, "step_time_s": seconds})
        return capsys.readouterr().out.strip()

    for step in range(10, 60, 10):
        log(step, 1.0)
    stalled = log(60, 30.0)  # one interval 30x slower
    assert stalled.endswith("| 1,000 tok/s | 1.00 s/step | eta 2:45:40"), stalled
    assert logger.speed() == loggers.Speed(1.0, 1000.0)
    lines = [log(step, 2.0) for step in range(70, 70 + 10 * loggers.SPEED_WINDOW, 10)]
    settled = loggers.SPEED_WINDOW // 2  # the median moves once half the window is slower
    assert all("| 1.00 s/step |" in line for line in lines[:settled - 1]), lines
    assert all(line.endswith(f"| 500 tok/s | 2.00 s/step | eta {loggers.format_duration(2.0 * (10_000 - step))}")
               for line, step in zip(lines[settled:], range(70 + 10 * settled, 200, 10))), lines
    logger.close()


@pytest.mark.parametrize(
    "seconds, text", [(0, "0:00:00"), (62.4, "0:01:02"), (3725, "1:02:05"), (90_000, "25:00:00"), (-3, "0:00:00")]
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_resolve_wandb_mode_from_credentials(isolated_wandb_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_wandb_mode("auto") == "offline"
    assert resolve_wandb_mode("offline") == "offline"
    assert resolve_wandb_mode("disabled") == "disabled"
    with pytest.raises(ValueError, match="logging.wandb.mode=online"):
        resolve_wandb_mode("online")  # would prompt or hang without credentials

    netrc_file = isolated_wandb_env / ".netrc"
    netrc_file.write_text("machine example.com\n  login user\n  password secret\n")
    netrc_file.chmod(0o600)
    assert resolve_wandb_mode("auto") == "offline"  # an entry for another host is not a W&B login
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    assert resolve_wandb_mode("auto") == "online"
    assert resolve_wandb_mode("online") == "online"
    # wandb 0.31's own `wandb login` stores the key under its new default host.
    netrc_file.write_text("machine api.forge.coreweave.com\n  login user\n  password " + "a" * 40 + "\n")
    assert resolve_wandb_mode("auto") == "online"
    netrc_file.unlink()

    elsewhere = isolated_wandb_env / "creds" / "netrc"
    elsewhere.parent.mkdir()
    elsewhere.write_text("machine wandb.example.com\n  login user\n  password " + "c" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(elsewhere))
    assert resolve_wandb_mode("auto") == "offline"  # default hosts have no entry there
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert resolve_wandb_mode("auto") == "online"
    monkeypatch.delenv("WANDB_BASE_URL")
    monkeypatch.delenv("NETRC")

    monkeypatch.setenv("WANDB_API_KEY", "b" * 40)
    assert resolve_wandb_mode("auto") == "online"
    assert resolve_wandb_mode("offline") == "offline"  # an explicit mode wins over credentials


@pytest.mark.parametrize("bad", ["", "Online", "dryrun", "shared"])
def test_resolve_wandb_mode_rejects_invalid(bad: str) -> None:
    with pytest.raises(ValueError, match=r"logging\.wandb\.mode must be one of auto, online, offline, disabled"):
        resolve_wandb_mode(bad)


def test_invalid_mode_raises_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"logging\.wandb\.mode"):
        MetricsLogger(tmp_path / "run", CONFIG, WandbSettings(enabled=True, mode="cloud"), total_steps=10)
    assert not (tmp_path / "run").exists()


def test_non_main_process_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    settings = WandbSettings(enabled=True, mode="offline")
    logger = MetricsLogger(run_dir, CONFIG, settings, total_steps=10, is_main_process=False)
    logger.log(1, {"loss": 1.0}, expert_tokens={"layer0": [1, 2]})
    logger.log_eval(1, {"loss": 1.0})
    logger.summary({"loss": 1.0})
    logger.close()
    assert not run_dir.exists()
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("settings", [WandbSettings(enabled=False, mode="offline"), WandbSettings(enabled=True, mode="disabled")])
def test_wandb_off_writes_no_wandb_dir(tmp_path: Path, settings: WandbSettings) -> None:
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, CONFIG, settings, total_steps=10, console=False)
    logger.log(1, {"loss": 1.0}, expert_tokens={"layer0": [1, 2]})
    logger.summary({"loss": 1.0})
    logger.close()
    assert logger.wandb_mode is None
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "summary.json"]
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith("wandb")]


def test_wandb_init_failure_says_how_to_disable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    def broken_init(**kwargs):
        raise TimeoutError("no response from wandb-core")

    monkeypatch.setattr(wandb, "init", broken_init)
    with pytest.raises(RuntimeError, match=r"logging\.wandb\.enabled=false.*logging\.wandb\.mode=offline"):
        MetricsLogger(tmp_path, CONFIG, WandbSettings(enabled=True, mode="offline"), total_steps=10)


def leet(args: list[str], path: Path, home: Path) -> str:
    """Run `wandb leet inspect` on a run dir and return stdout."""
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [str(WANDB_EXE), "leet", "inspect", *args, str(path)], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_offline_wandb_round_trip(tmp_path: Path, isolated_wandb_env: Path) -> None:
    run_dir = tmp_path / "my-run"
    settings = WandbSettings(enabled=True, mode="offline", project="m6-test", tags=["unit", "cpu"])
    logger = MetricsLogger(run_dir, CONFIG, settings, total_steps=30, console=False)
    assert logger.wandb_mode == "offline"
    losses = {10: 3.5, 20: 3.25, 30: 3.125}
    loads = {"layer0": [5, 0, 7, 4], "layer2": [1, 1, 1, 13]}
    for step, loss in losses.items():
        logger.log(step, {"loss": loss, "lr": 1e-3}, expert_tokens=loads if step == 30 else None)
    logger.log_eval(30, {"loss": 3.0})
    logger.summary({"final_loss": 3.125, "tokens_seen": 12345})
    logger.close()
    logger.close()

    run_dirs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, "W&B files must land in run_dir/wandb/"
    summary = json.loads(leet(["--summary", "--json"], run_dirs[0], isolated_wandb_env))
    assert summary["state"] == "finished"
    assert summary["config"] == CONFIG
    assert summary["name"] == "my-run"  # name None -> the run dir's name
    assert summary["project"] == "m6-test"
    assert summary["tags"] == ["unit", "cpu"]
    assert summary["summary"]["final_loss"] == 3.125
    assert summary["summary"]["tokens_seen"] == 12345
    assert summary["summary"]["eval/loss"] == 3.0
    assert summary["summary"]["expert_load/table"]["nrows"] == 8
    assert summary["summary"]["expert_load/layer2"]["values"] == [1, 1, 1, 13]

    records = [json.loads(line) for line in leet(["--json"], run_dirs[0], isolated_wandb_env).splitlines()]
    history = [r["history"] for r in records if r["type"] == "history"]
    logged_loss = {h["step"]["num"]: h["item"]["loss"] for h in history if "loss" in h["item"]}
    assert logged_loss == losses
    last = history[-1]["item"]
    # Histogram bins are expert ids and heights are token counts.
    assert last["expert_load/layer0.values"] == [5, 0, 7, 4]
    assert last["expert_load/layer0.bins"] == [0, 1, 2, 3, 4]
    assert json.loads((run_dir / "summary.json").read_text()) == {"final_loss": 3.125, "tokens_seen": 12345}
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 4 and rows[2]["expert_tokens"] == loads  # the jsonl keeps the same counts
