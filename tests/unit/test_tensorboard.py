"""logging.tensorboard: a real run's event files read back with TensorBoard's own reader equal metrics.jsonl;
a missing tensorboard package is a config error before any work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, SCALARS, EventAccumulator

from m6.config import ConfigError, load
from m6.train.loggers import MetricsLogger, WandbSettings
from m6.train.loop import Trainer
from m6.train.tensorboard_writer import require_tensorboard
from tests.smoke.test_train import SMALL, TINY

ROOT = Path(__file__).resolve().parents[2]


def last_rows(path: Path) -> dict[int, dict]:
    """metrics.jsonl by step, train and eval keys merged, the last line written for a step winning per key."""
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


def events(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0, HISTOGRAMS: 0})  # 0 = keep every event
    acc.Reload()
    return acc


def test_event_files_hold_the_jsonl_values_across_a_resume(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Steps 1-4 logged, step 4's checkpoint lost, resumed from 2 to 5: TensorBoard, like the jsonl's last
    rows, holds the second attempt's steps 3 and 4 (purge_step), and every scalar equals the jsonl's."""
    common = [*SMALL, f"run.dir={tmp_path}", "logging.every=1", "checkpoint.every=2", "train.eval_every=2",
              "logging.tensorboard.enabled=true"]
    Trainer(load(TINY, [*common, "train.max_steps=4"])).fit()
    assert f"metrics.jsonl, TensorBoard {(tmp_path / 'tb').resolve()} | checkpoint every" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")
    Trainer(load(TINY, [*common, "train.max_steps=5"])).fit()

    rows = last_rows(tmp_path / "metrics.jsonl")
    acc = events(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    jsonl_keys = {k for row in rows.values() for k, v in row.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert tags == jsonl_keys and {"loss", "eval/caption_loss", "moe/block1/dropped_fraction"} <= tags
    for tag in tags:
        logged = {e.step: e.value for e in acc.Scalars(tag)}
        expected = {step: float(row[tag]) for step, row in rows.items() if tag in row}
        # Each step once: the first attempt's events after the resumed step are purged, not shadowed.
        assert [e.step for e in acc.Scalars(tag)] == sorted(expected), tag
        for step, value in expected.items():  # TensorBoard keeps float32
            assert logged[step] == pytest.approx(value, rel=1e-6, abs=1e-30), (tag, step)
    # step_time_s differs between the two attempts at step 3: TensorBoard must hold the second.
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first_attempt = next(r for r in lines if r["step"] == 3 and "loss" in r)
    assert first_attempt["step_time_s"] != rows[3]["step_time_s"]

    for layer in ("block0", "block1"):
        hists = {e.step: e.histogram_value for e in acc.Histograms(f"expert_load/{layer}")}
        assert [e.step for e in acc.Histograms(f"expert_load/{layer}")] == [1, 2, 3, 4, 5]
        for step, hist in hists.items():
            counts = rows[step]["expert_tokens"][layer]
            assert hist.bucket == [float(c) for c in counts] and hist.num == sum(counts)
            assert hist.bucket_limit == [0.5, 1.5, 2.5, 3.5]


def test_tensorboard_dir_setting_and_main_process_only(tmp_path: Path) -> None:
    settings = load(TINY, [f"logging.tensorboard.dir={tmp_path / 'elsewhere'}",
                           "logging.tensorboard.enabled=true"]).logging.tensorboard
    logger = MetricsLogger(tmp_path / "run", {}, WandbSettings(), 10, console=False, tensorboard=settings)
    logger.log(1, {"loss": 2.5, "lr": 1e-3}, expert_tokens={"block1": [3, 0, 1]})
    logger.log_eval(1, {"caption_loss": 2.0})
    logger.close()
    acc = events(tmp_path / "elsewhere")
    assert sorted(acc.Tags()["scalars"]) == ["eval/caption_loss", "loss", "lr"]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 2.5)]
    assert not (tmp_path / "run" / "tb").exists()
    other = MetricsLogger(tmp_path / "rank1", {}, WandbSettings(), 10, tensorboard=settings, is_main_process=False)
    other.log(1, {"loss": 1.0})
    other.close()
    assert not (tmp_path / "rank1").exists() and len(list((tmp_path / "elsewhere").iterdir())) == 1


def test_empty_dir_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"logging\.tensorboard\.dir"):
        load(TINY, ["logging.tensorboard.dir=' '"])


def test_missing_package_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what `import` sees without the package
    with pytest.raises(ConfigError, match=r"logging\.tensorboard\.enabled=true needs the tensorboard package .*"
                                          r"pip install tensorboard"):
        require_tensorboard()
    settings = load(TINY, ["logging.tensorboard.enabled=true"]).logging.tensorboard
    with pytest.raises(ConfigError, match=r"logging\.tensorboard"):
        MetricsLogger(tmp_path / "run", {}, WandbSettings(), 10, tensorboard=settings)
    assert not (tmp_path / "run").exists()


def test_train_without_the_package_exits_2_before_any_work(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code = ("import sys; sys.modules['tensorboard'] = None; sys.modules['torch.utils.tensorboard'] = None; "
            "from m6.train.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "--config", TINY, *SMALL, f"run.dir={run_dir}",
                           "logging.tensorboard.enabled=true"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: logging.tensorboard.enabled=true needs")
    assert "pip install tensorboard" in lines[0]
    assert not run_dir.exists()  # stopped before the run dir, the data and the model


def test_expert_bias_reaches_every_sink_and_resumes_exactly(tmp_path: Path) -> None:
    """Aux-free balancing in a real run: the bias vector and its max |bias| in metrics.jsonl and
    TensorBoard at every logged step; a run resumed from step 2 continues the same bias and losses."""
    common = [*SMALL, "logging.every=1", "checkpoint.every=2", "train.eval_every=0", "logging.tensorboard.enabled=true",
              "model.moe.expert_bias_update_rate=0.01", "train.max_steps=4"]
    straight = Trainer(load(TINY, [*common, f"run.dir={tmp_path / 'a'}"])).fit()
    rows = last_rows(tmp_path / "a" / "metrics.jsonl")
    acc = events(tmp_path / "a" / "tb")
    for layer in ("block0", "block1"):
        hists = acc.Histograms(f"expert_bias/{layer}")
        assert [e.step for e in hists] == [1, 2, 3, 4]
        for e in hists:
            bias = rows[e.step]["expert_bias"][layer]
            assert e.histogram_value.num == len(bias) and e.histogram_value.sum == pytest.approx(sum(bias), abs=1e-6)
            assert rows[e.step][f"moe/{layer}/expert_bias_max_abs"] == max(abs(b) for b in bias)
        assert rows[4]["expert_bias"][layer] != rows[1]["expert_bias"][layer]
        assert any(rows[2]["expert_bias"][layer])  # what the resume must restore is not the initial zeros

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_00000004")
    (tmp_path / "b" / "checkpoints" / "latest").unlink(missing_ok=True)
    resumed = Trainer(load(TINY, [*common, f"run.dir={tmp_path / 'b'}"])).fit()
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]
    assert last_rows(tmp_path / "b" / "metrics.jsonl")[4]["expert_bias"] == rows[4]["expert_bias"]
