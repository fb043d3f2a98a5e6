"""m6.report: the picture and page of a real short run, the edge cases it must still draw, exit 2 without metrics."""

from __future__ import annotations

import base64
import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from m6.config import load
from m6.report.cli import main
from m6.report.figure import (MAX_EXPERT_ROWS, bias_image, build_figure, group_extreme, group_mean, load_image,
                              rank_compute_keys)
from m6.report.page import human_count
from m6.report.run_files import ExpertLoad, RunRecord, read_run
from m6.train.loop import Trainer
from tests.smoke.test_train import SMALL, TINY

ROOT = Path(__file__).resolve().parents[2]
RUN = ["train.max_steps=6", "logging.every=1", "train.eval_every=3", "checkpoint.every=0"]


def train(run_dir: Path, *extra: str) -> Path:
    Trainer(load(TINY, [*SMALL, f"run.dir={run_dir}", *RUN, *extra])).fit()
    return run_dir


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 steps of a 2-layer, 4-expert model on CPU (no device peak: TFLOP/s, no MFU), evals at 3 and 6."""
    return train(tmp_path_factory.mktemp("moe"))


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def copy_run(src: Path, dst: Path, keep=lambda row: row) -> Path:
    """A copy of run dir ``src`` (its files, not checkpoints) whose metrics rows pass through ``keep``."""
    dst.mkdir()
    for name in ("config.yaml", "summary.json"):
        shutil.copy(src / name, dst / name)
    rows = [r for r in map(keep, read_lines(src / "metrics.jsonl")) if r]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dst


def check_outputs(out: Path, run: RunRecord) -> str:
    """The PNG opens and is report-sized; the HTML embeds exactly that PNG; returns the HTML."""
    png = (out / "report.png").read_bytes()
    with Image.open(io.BytesIO(png)) as image:
        image.verify()
    with Image.open(io.BytesIO(png)) as image:
        assert image.format == "PNG" and image.width == 1400 and 800 <= image.height <= 3000, image.size
    page = (out / "report.html").read_text()
    assert f'src="data:image/png;base64,{base64.b64encode(png).decode()}"' in page
    assert str(run.run_dir.resolve()) in page
    return page


def titles(run: RunRecord) -> list[str]:
    return [ax.get_title() for ax in build_figure(run).axes if ax.get_visible()]


def test_report_of_a_real_run(moe_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(moe_run)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{moe_run / 'report.png'} and {moe_run / 'report.html'}")
    run = read_run(moe_run)
    page = check_outputs(moe_run, run)
    summary = json.loads((moe_run / "summary.json").read_text())
    assert f"{summary['final_loss']:.4f} (summary.json)" in page
    assert f"{human_count(summary['total_params'])} total, {human_count(summary['active_params'])} active" in page
    assert "<th>steps</th><td>6 of 6</td>" in page
    assert "4 experts, top-2" in page and "eval at step 6" in page

    rows = read_lines(moe_run / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert run.steps == [1, 2, 3, 4, 5, 6] and [e["step"] for e in run.evals] == [3, 6]
    assert [r["loss"] for r in run.rows] == [r["loss"] for r in train_rows]
    # Heatmap data: the jsonl's counts, shares against a loop over steps and experts.
    assert list(run.expert_load) == ["block0", "block1"]
    for layer, load in run.expert_load.items():
        counts = [r["expert_tokens"][layer] for r in train_rows]
        assert load.tokens.tolist() == counts and load.steps.tolist() == run.steps
        image, x_edges, y_edges, expert_group, step_group = load_image(load)
        assert image.shape == (4, 6) and (expert_group, step_group) == (1, 1)
        assert x_edges.tolist() == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5] and y_edges.tolist() == [0, 1, 2, 3, 4]
        for t, row in enumerate(counts):
            for e, tokens in enumerate(row):
                share = tokens / sum(row)
                assert image[e, t] == pytest.approx(math.log2(max(share * 4, 2.0 ** -4)))
    shown = titles(run)
    assert "model TFLOP/s: no MFU (device peak unknown)" in shown[3]  # CPU: no peak, no MFU
    assert "assignments dropped by the capacity limit (%)" in shown
    assert sum("share of tokens per expert (4 experts)" in t for t in shown) == 2


def test_expert_bias_heatmap_beside_each_load_heatmap(tmp_path: Path) -> None:
    """Aux-free balancing: the jsonl's bias vectors, drawn as they are, one heatmap beside each layer's load."""
    run_dir = train(tmp_path / "run", "model.moe.expert_bias_update_rate=0.01", "train.eval_every=0")
    assert main([str(run_dir)]) == 0
    run = read_run(run_dir)
    check_outputs(run_dir, run)
    train_rows = [r for r in read_lines(run_dir / "metrics.jsonl") if "loss" in r]
    assert list(run.expert_bias) == ["block0", "block1"] and all("expert_bias" not in r for r in run.rows)
    for layer, bias in run.expert_bias.items():
        logged = [r["expert_bias"][layer] for r in train_rows]
        assert bias.steps.tolist() == run.steps and bias.bias.tolist() == logged
        image, x_edges, y_edges, expert_group, step_group = bias_image(bias)
        assert image.shape == (4, 6) and image.T.tolist() == logged and (expert_group, step_group) == (1, 1)
    shown = titles(run)
    # Row by row: a layer's load, then its bias.
    heat = [t for t in shown if t.startswith("block")]
    assert [t.split(":")[0] for t in heat] == ["block0", "block0", "block1", "block1"]
    assert ["expert bias" in t for t in heat] == [False, True, False, True]


def test_mfu_panel_when_the_peak_is_known(tmp_path: Path) -> None:
    run = read_run(train(tmp_path, "train.max_steps=2", "train.peak_tflops=1.0"))
    assert run.has("mfu") and titles(run)[3].startswith("MFU (%)")


def test_each_ranks_compute_time_and_their_spread_when_logged(moe_run: Path, tmp_path: Path) -> None:
    """A run that logged compute_s/rank<r> (multi-rank, parallel.balance) gets a row of two more
    panels: each rank's compute time, and the slowest over the fastest at each step."""
    def with_ranks(row: dict) -> dict:
        if "loss" in row:  # rank 1 twice as slow as rank 0 at odd steps, as fast at even ones
            row = {**row, "compute_s/rank0": 0.2, "compute_s/rank1": 0.4 if row["step"] % 2 else 0.2,
                   "compute_s/rank10": 0.3}
        return row
    run = read_run(copy_run(moe_run, tmp_path / "ranks", with_ranks))
    assert rank_compute_keys(run) == ["compute_s/rank0", "compute_s/rank1", "compute_s/rank10"]
    fig = build_figure(run)
    by_title = {ax.get_title(): ax for ax in fig.axes}
    lines = by_title["step compute time per rank (s)"].get_lines()
    assert [line.get_label() for line in lines] == ["rank0", "rank1", "rank10"]
    spread = by_title["slowest / fastest rank's compute time (median 1.75x)"].get_lines()[0]
    assert spread.get_ydata().tolist() == pytest.approx([2.0 if step % 2 else 1.5 for step in run.steps])
    assert main([str(run.run_dir), "--out", str(tmp_path / "out")]) == 0
    check_outputs(tmp_path / "out", run)
    assert not any("compute time" in t for t in titles(read_run(moe_run)))  # one rank: no such row


def test_dense_model_gets_a_page_without_moe_panels(tmp_path: Path) -> None:
    run_dir = train(tmp_path / "dense", "train.max_steps=2", "model.moe.every=0")
    assert main([str(run_dir), "--out", str(tmp_path / "out")]) == 0
    run = read_run(run_dir)
    assert run.moe_layers() == [] and run.expert_load == {}
    page = check_outputs(tmp_path / "out", run)
    assert "dense (no MoE)" in page
    shown = titles(run)
    assert "MoE" in shown and not any("per expert" in t for t in shown)
    assert not (run_dir / "report.png").exists()  # --out: nothing written into the run dir


def _no_eval(row: dict) -> dict | None:
    return None if any(k.startswith("eval/") for k in row) else row


def _old_run(row: dict) -> dict:
    row.pop("expert_tokens", None)  # a run logged before expert_tokens existed
    return row


@pytest.mark.parametrize("case, keep, note", [
    ("no_eval", _no_eval, "no eval rows"),
    ("single_step", lambda row: row if row["step"] == 1 and "loss" in row else None, "no eval rows"),
    ("no_expert_tokens", _old_run, "no expert-load heatmap"),
])
def test_edge_cases_each_get_a_page(moe_run: Path, tmp_path: Path, case: str, keep, note: str) -> None:
    run_dir = copy_run(moe_run, tmp_path / case, keep)
    assert main([str(run_dir)]) == 0
    run = read_run(run_dir)
    page = check_outputs(run_dir, run)
    assert note in page
    shown = titles(run)
    assert shown[0] == "loss" and len(run.evals) == (2 if case == "no_expert_tokens" else 0)
    assert any("per expert" in t for t in shown) == (case != "no_expert_tokens")
    if case == "no_expert_tokens":
        assert "assignments dropped by the capacity limit (%)" in shown  # the moe/ scalars are still there


def test_unfinished_run_with_a_torn_last_line(moe_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "running"
    run_dir.mkdir()
    text = (moe_run / "metrics.jsonl").read_text()
    (run_dir / "metrics.jsonl").write_text(text + text.splitlines()[0][:40])  # a crash mid-write
    assert main([str(run_dir)]) == 0
    run = read_run(run_dir)
    page = check_outputs(run_dir, run)
    assert "1 line(s) of metrics.jsonl" in page and "the run has not finished" in page
    last = [r for r in read_lines(moe_run / "metrics.jsonl") if "loss" in r][-1]
    assert f"{last['loss']:.4f} (last logged step 6)" in page


def test_expert_tokens_that_do_not_fit_are_left_out_with_a_note(tmp_path: Path) -> None:
    rows = [{"step": 1, "loss": 1.0, "expert_tokens": {"block1": [1, 2, 3], "block3": [1.5, 2, 3]}},
            {"step": 2, "loss": 0.9, "expert_tokens": {"block1": [1, 2], "block3": ["a"]}},
            {"step": 3, "loss": 0.8, "expert_tokens": {"block1": [4, 5, 6], "block3": [1, 1, 1]}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = read_run(tmp_path)
    assert run.expert_load["block1"].steps.tolist() == [1, 3]
    assert run.expert_load["block1"].tokens.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert run.expert_load["block3"].steps.tolist() == [3]
    assert "block1: 1 logged step(s) with another number of experts than the last (3) left out" in " ".join(run.notes)
    assert "block3: 2 logged step(s) whose expert_tokens are not a list of integers" in " ".join(run.notes)
    assert main([str(tmp_path)]) == 0
    check_outputs(tmp_path, run)


def test_resumed_run_shows_the_last_row_of_each_step(tmp_path: Path) -> None:
    """A real resume from step 2 after a first attempt logged steps 1-4: steps 3 and 4 appear twice."""
    run_dir = train(tmp_path / "r", "train.max_steps=4", "checkpoint.every=2", "train.eval_every=0")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # as if it died before saving step 4
    train(run_dir, "train.max_steps=5", "checkpoint.every=2", "train.eval_every=0")
    lines = read_lines(run_dir / "metrics.jsonl")
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4, 3, 4, 5]
    run = read_run(run_dir)
    assert run.steps == [1, 2, 3, 4, 5]
    last_written = {r["step"]: r for r in lines if "loss" in r}
    assert [r["step_time_s"] for r in run.rows] == [last_written[s]["step_time_s"] for s in run.steps]
    assert run.expert_load["block0"].tokens.tolist() == [last_written[s]["expert_tokens"]["block0"] for s in run.steps]
    assert any("logged more than once" in n for n in run.notes)
    assert main([str(run_dir)]) == 0
    check_outputs(run_dir, run)


def test_many_experts_and_steps_are_grouped_into_a_legible_heatmap() -> None:
    """512 experts x 1000 logged steps: 64 rows of 8 experts, columns of 3 steps; one hot and one idle
    expert each keep their row's colour (the row shows its least even expert)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(50, 150, size=(1000, 512))
    tokens[:, 300] *= 8
    tokens[:, 17] = 0
    load = ExpertLoad(np.arange(10, 10010, 10), tokens)
    image, x_edges, y_edges, expert_group, step_group = load_image(load)
    assert image.shape == (MAX_EXPERT_ROWS, 334) and (expert_group, step_group) == (8, 3)
    assert y_edges[0] == 0 and y_edges[-1] == 512 and x_edges[0] == 5 and x_edges[-1] == 10005
    assert image.mean(axis=1).argmax() == 300 // 8 and (image[300 // 8] > 2.0).all()  # ~8x even: log2 ~ 3
    assert (image[17 // 8] == -4).all()  # idle: the floor of the scale
    shares = tokens / tokens.sum(axis=1, keepdims=True)
    column = np.log2(np.maximum(shares[3:6].mean(axis=0) * 512, 2.0 ** -4))  # logged steps 3..5, per expert
    for row in range(64):
        reference = max(column[8 * row:8 * row + 8], key=abs)
        assert image[row, 1] == pytest.approx(reference), row
    means, starts = group_mean(np.arange(10.0).reshape(1, 10), axis=1, max_groups=4)
    assert starts.tolist() == [0, 3, 6, 9] and means.tolist() == [[1.0, 4.0, 7.0, 9.0]]  # a short last group
    extremes, starts = group_extreme(np.array([[0.5, -2.0, 1.0, 3.0, -0.1]]), max_groups=2)
    assert starts.tolist() == [0, 3] and extremes.tolist() == [[-2.0, 3.0]]


def test_no_metrics_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "m6.report", str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: {tmp_path / 'metrics.jsonl'} not found: is {tmp_path} a run.dir of m6 "
                                   "training? (it writes metrics.jsonl at the first logged step)")
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "eval/caption_loss": 1.0}\n')
    assert main([str(tmp_path)]) == 2
    assert main([str(tmp_path / "missing")]) == 2
    assert not (tmp_path / "report.png").exists()


def test_an_output_folder_that_cannot_be_written_is_exit_2(moe_run: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a_file").write_text("in the way")
    assert main([str(moe_run), "--out", str(tmp_path / "a_file" / "report")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot write the report into {tmp_path / 'a_file' / 'report'}: ")
    assert len(err.splitlines()) == 1
