"""What a run tells its user: the start-up banner, checkpoint and end lines, --print-config,
relative data paths in errors, and the Python API with a dataset of one's own."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import yaml

import m6
from m6.train import cli
from tests.smoke.test_train import SMALL, TINY, read_metrics

REPO = Path(TINY).parents[1]
QUICK = [*SMALL, "train.max_steps=4", "train.eval_every=0", "checkpoint.every=2", "checkpoint.keep=1"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["--config", TINY, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_banner_says_what_trains_where_and_on_what(tmp_path, capsys):
    code, out, _ = run_cli(capsys, *QUICK, f"run.dir={tmp_path}")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"m6 {m6.__version__} | torch ") and "1 process on cpu" in lines[0] and "fp32" in lines[0]
    banner = "\n".join(lines[:7])
    # SMALL: 2 blocks of d_model 64, every block MoE with 4 experts; the parameter count is the whole model's.
    assert "model    2 blocks x d_model 64, 2 heads; MoE in every block: 4 experts, top-2, capacity 1.25 per sequence, router GEMM fp32, expert kernel auto -> loop" in banner
    assert "parallel world 1 = expert-parallel 1 x expert-data-parallel 1; batch 8 = micro-batch 8 x accumulation 1" in banner
    assert "!! data: SYNTHETIC" in banner and "512 samples per epoch" in banner
    assert f"run      {tmp_path.resolve()} | fresh start | 4 steps" in banner
    # Each checkpoint in place gets a line with its size; keep=1 leaves only the last on disk.
    saved = [line for line in lines if line.startswith("checkpoint: step ")]
    assert [line.split()[2] for line in saved] == ["2", "4"]
    step4 = tmp_path / "checkpoints" / "step_00000004"
    size = sum(f.stat().st_size for f in step4.rglob("*") if f.is_file())
    assert f"saved to {step4.resolve()} (" in saved[1] and f"{size / 2**20:.1f} MiB" in saved[1]
    done = lines[-1]
    final = [r for r in read_metrics(tmp_path) if "loss" in r][-1]
    assert done.startswith("done: step 4/4, 4 steps run in ") and f"final loss {final['loss']:.4f}" in done
    assert f"checkpoint {step4.resolve()}" in done

    code, out, _ = run_cli(capsys, *QUICK, f"run.dir={tmp_path}", "train.max_steps=6")
    assert code == 0 and f"| resumed from {step4.resolve()} at step 4 (saved at world size 1" in out
    assert "done: step 6/6, 2 steps run in " in out


def test_files_data_is_listed_per_source_with_the_folder_relative_paths_resolve_against(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, out, _ = run_cli(capsys, *QUICK, "train.max_steps=1", f"run.dir={tmp_path}", "data.kind=files",
                           "data.sources=[{path: 'data/sample/sample-{000000..000002}.tar', format: tar, weight: 0.9},"
                           " {path: data/sample/text.txt, format: text, weight: 0.1}]", "data.eval_samples=8")
    assert code == 0
    assert f"data     2 sources, tokenizer byte (vocab 261) (relative paths resolve against the working directory {REPO})" in out
    # The eval hold-out is counted apart from the records that train (1,536 images in the shards).
    assert re.search(r"\n\s+tar\s+data/sample/sample-\{000000\.\.000002\}\.tar\s+weight 0\.9, 1,528 records to "
                     r"train, 8 held out for eval\n", out)
    assert re.search(r"\n\s+text\s+data/sample/text\.txt\s+weight 0\.1, 1,024 records\n", out)
    assert "SYNTHETIC" not in out and "!!" not in out  # the sample corpus with its own image statistics


def test_a_missing_relative_data_path_names_the_folder_it_was_looked_for_in(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, *QUICK, f"run.dir={tmp_path / 'run'}", "data.kind=files",
                           "data.sources.0.path=data/sample/text.txt", "data.sources.0.format=text")
    assert code == 2
    assert "data.sources[0].path" in err and "data/sample/text.txt" in err
    assert f"relative paths resolve against the working directory {tmp_path}" in err
    code, _, err = run_cli(capsys, *QUICK, f"run.dir={tmp_path / 'run'}", "data.tokenizer=tok.json")
    assert code == 2 and "data.tokenizer" in err and f"against the working directory {tmp_path}" in err
    # An absolute path needs no such note.
    code, _, err = run_cli(capsys, *QUICK, f"run.dir={tmp_path / 'run'}", "data.kind=files",
                           f"data.sources.0.path={tmp_path / 'none.tar'}")
    assert code == 2 and "none.tar" in err and "working directory" not in err


def test_print_config_shows_every_key_with_the_overrides_applied(capsys):
    code, out, _ = run_cli(capsys, "data.sources.1.weight=0.2", "model.moe.num_experts=16", "--print-config")
    assert code == 0
    shown = yaml.safe_load(out)
    assert shown["data"]["sources"][1] == {"path": "data/sample/text.txt", "format": "text", "weight": 0.2}
    assert shown["model"]["moe"]["num_experts"] == 16
    assert shown["optim"]["beta2"] == m6.load_config(TINY).optim.beta2  # a default the YAML does not set


def test_help_points_to_the_config_reference(capsys):
    try:
        cli.main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert '"Config reference" table in docs/training.md' in out and "--print-config" in out \
        and "data.sources.0.path=" in out


class ShadeCaptions:
    """A user's dataset: images of one grey level, captioned with it."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> m6.Sample:
        level = i % 4
        return m6.Sample(np.full((3, 32, 32), level / 3, np.float32), "describe:", f"shade {level}")


def test_the_python_api_trains_on_a_dataset_of_ones_own(tmp_path, capsys):
    cfg = m6.load_config(TINY, [*SMALL, "model.image_size=32", f"run.dir={tmp_path}", "train.max_steps=3",
                                "train.eval_every=0"])
    history = m6.Trainer(cfg, dataset=ShadeCaptions(), eval_samples=[ShadeCaptions()[i] for i in range(8)]).fit()
    assert [h["step"] for h in history] == [1, 2, 3]
    out = capsys.readouterr().out
    assert "data     the ShadeCaptions passed to Trainer (48 samples; data.kind and data.sources unused)" in out
    assert "SYNTHETIC" not in out
    rows = read_metrics(tmp_path)
    assert any("eval/caption_loss" in r for r in rows)


def test_a_wrong_item_in_ones_own_dataset_is_named_by_index(tmp_path):
    class WrongShape(ShadeCaptions):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return m6.Sample(sample.image[:, :16], sample.source, sample.target) if i == 5 else sample

    cfg = m6.load_config(TINY, [*SMALL, f"run.dir={tmp_path}", "train.max_steps=3", "train.eval_every=0",
                                "train.global_batch_size=48"])
    try:
        m6.Trainer(cfg, dataset=WrongShape()).fit()
    except ValueError as e:
        assert "dataset[5].image has shape (3, 16, 32); the model takes (3, 32, 32)" in str(e)
    else:
        raise AssertionError("a wrong image shape trained")


def test_importing_m6_does_not_import_the_training_stack():
    import subprocess
    import sys

    code = ("import sys, m6, m6.config; assert 'm6.train.loop' not in sys.modules; "
            "assert 'torch.distributed' not in sys.modules; print(m6.Trainer.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0 and out.stdout.strip() == "m6.train.loop", out.stderr[-1000:]
