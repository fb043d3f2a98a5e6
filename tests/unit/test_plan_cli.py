"""python -m m6.plan: an infeasible request says what is short and exits 2; the written overrides
load with m6.config.load and train a step; the search over a scale config takes seconds."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

from m6 import config as m6config
from m6.plan.__main__ import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY_SYNTH = ["data.kind=synthetic", "data.sources=[]", "data.num_workers=0", "data.seq_len=32",
              "model.max_text_len=32", "model.image_size=16", "train.global_batch_size=4"]


def test_infeasible_request_names_the_shortfall(capsys, tmp_path):
    rc = main([str(CONFIGS / "m6-base-moe.yaml"), "--gpus", "1", "--gpu", "v100", "--gpu-memory", "4GB",
               "--host-memory", "4GB", "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "no layout fits: the closest plan" in err and "GiB per GPU of 4 GiB" in err and "host memory" in err
    assert "none either with checkpoint.async_save=false or checkpoint.async_save=false optim.name=adafactor" in err
    assert not (tmp_path / "p").exists()


def test_when_nothing_fits_the_plan_says_which_lighter_settings_fit(capsys, tmp_path):
    """The lightest change that fits (here synchronous checkpoint saves) is printed, written with the
    layout and loads."""
    out = tmp_path / "p"
    rc = main([str(CONFIGS / "m6-base-moe.yaml"), "--gpus", "1", "--gpu", "v100", "--gpu-memory", "8GB",
               "--host-memory", "16GB", "--top", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and "NOTE: no layout fits with the config as given" in printed
    assert "these do with checkpoint.async_save=false (synchronous checkpoint saves" in printed
    overrides = out.read_text().split()
    assert overrides[0] == "checkpoint.async_save=false" and "optim.name=adafactor" not in overrides
    assert not m6config.load(CONFIGS / "m6-base-moe.yaml", overrides).checkpoint.async_save


def test_m6_10t_fits_512_v100s_with_1tb_hosts(capsys, tmp_path):
    """#27's figure, and #46's layout: with Adafactor and synchronous saves (what the planner adds by
    itself when the config as given fits nowhere, tested above), ZeRO-Offload's layout with 16-bit
    host gradients (the streamed blocks' landing in their 16-bit homes, without which zero does not
    fit 1 TB), full recompute and the update in groups, each V100 holds its share and each node's
    1 TB the host states."""
    rc = main([str(CONFIGS / "m6-10t.yaml"), "optim.name=adafactor", "checkpoint.async_save=false", "--gpus", "512",
               "--gpu", "v100", "--gpu-memory", "32GB", "--gpus-per-node", "8", "--host-memory", "1TB", "--top", "1",
               "--out", str(tmp_path / "p")])
    printed = capsys.readouterr().out
    assert rc == 0
    device = float(re.search(r"per-GPU device memory peak ([\d.]+) GiB", printed).group(1))
    host = float(re.search(r"per node of 8 ranks ([\d,.]+) GiB", printed).group(1).replace(",", ""))
    assert device <= 32 and host <= 1024
    overrides = (tmp_path / "p").read_text().split()
    assert "memory.host_grad_dtype=compute" in overrides and "memory.offload=zero" in overrides
    assert "optim.delayed_update=true" not in overrides  # its separate gradients would not fit


def test_overrides_round_trip_and_train_one_step(capsys, tmp_path):
    """--out FILE holds the planning command's overrides and the layout's; the printed command
    hands FILE to train.py's --overrides, which reads it."""
    from m6.train.cli import main as train_main, read_overrides_file  # the test may use train; m6.plan may not

    out = tmp_path / "plan.overrides"
    start = time.process_time()  # CPU time: the planner's own work, whatever else the machine runs
    assert main([str(CONFIGS / "tiny.yaml"), *TINY_SYNTH, "--gpus", "1", "--gpu-memory", "1GB", "--gpu", "h100",
                 "--out", str(out)]) == 0
    assert time.process_time() - start < 30
    printed = capsys.readouterr().out
    assert "PREDICTED" in printed and "ASSUMED" in printed
    command = printed.splitlines()[-1].strip()
    assert command == f"torchrun --standalone --nproc_per_node 1 train.py --config {CONFIGS / 'tiny.yaml'} --overrides {out}"
    overrides = read_overrides_file(str(out))
    assert overrides[:len(TINY_SYNTH)] == TINY_SYNTH
    assert train_main(["--config", str(CONFIGS / "tiny.yaml"), "--overrides", str(out), "--print-config"]) == 0
    resolved = capsys.readouterr().out
    cfg = m6config.load(CONFIGS / "tiny.yaml", overrides + [f"run.dir={tmp_path / 'run'}",
                                                          "train.max_steps=1", "train.device=cpu"])
    assert f"train.micro_batch_size={cfg.train.micro_batch_size}" in overrides
    assert f"micro_batch_size: {cfg.train.micro_batch_size}" in resolved and "seq_len: 32" in resolved
    from m6.train.loop import Trainer  # the test may use train; m6.plan may not

    metrics = Trainer(cfg).train_step()
    assert metrics["loss"] > 0


def test_search_over_m6_100b_takes_seconds(capsys, tmp_path, monkeypatch):
    """The README's planning command: seconds; the top layouts differ in their predictions (the
    same layout under other names, e.g. a bf16 all-to-all of a bf16 model or more update groups,
    is named on the simplest's line); no file in the working directory; the launch command has
    the multi-node rendezvous (store on the first node, one agent per node). "Seconds" is the
    search's CPU time (~20 s on a quiet 2-core machine): its wall time on a shared CI machine grows
    with the load (several times as long under a load average of 10), its CPU time does not."""
    monkeypatch.chdir(tmp_path)
    start = time.process_time()
    assert main([str(CONFIGS / "m6-100b.yaml"), "--gpus", "64", "--gpu-memory", "80GB", "--gpu", "h100",
                 "--top", "5"]) == 0
    assert time.process_time() - start < 60
    printed = capsys.readouterr().out
    assert "MFU" in printed and list(tmp_path.iterdir()) == []
    ranked = [line for line in printed.splitlines() if line.startswith("#")]
    predictions = [line for line in printed.splitlines() if line.startswith("    PREDICTED")]
    layouts = [line.split("  ", 1)[1].split(" (the same prediction")[0] for line in ranked]
    assert len(ranked) == 5 and len(set(zip(layouts, predictions))) == 5
    assert "a2a compute dtype" in ranked[0] and "(the same prediction with a2a bf16; apply_groups 2/4/8" in ranked[0]
    lines = printed.splitlines()
    assert lines[-2] == "  on HEAD, for the life of the job: python -m m6.parallel.rendezvous_store --port 29400"
    assert lines[-1].startswith("  on every node: torchrun --nnodes 8 --nproc_per_node 8 --rdzv_backend c10d "
                                "--rdzv_endpoint HEAD:29400 --rdzv_conf is_host=false --rdzv_id m6-100b train.py "
                                f"--config {CONFIGS / 'm6-100b.yaml'} parallel.expert_parallel_size=")


def test_layouts_of_the_same_prediction_are_collapsed_into_the_simplest():
    from m6.plan.search import search
    from m6.plan.timing import GPUS, HostProfile

    cfg = m6config.load(CONFIGS / "tiny.yaml", ["train.global_batch_size=64", "train.micro_batch_size=2",
                                                "data.seq_len=64", "train.precision=bf16"])
    only = dict(recompute=("none",), offload=("none",), apply_groups=(1, 2), a2a=(None, "bf16"), micro_batches=[2],
                shard=("none",), overlap=(1,), tps=(1,), pps=(1,))
    found = search(cfg, 16, 8, GPUS["h100"], HostProfile(1), 1e6, eps=[8], **only)
    assert found.timed == 4 and len(found.feasible) == 1, [c.equivalents for c in found.feasible]
    best = found.feasible[0]
    assert (best.apply_groups, best.a2a_dtype) == (1, None)
    assert sorted(best.equivalents) == ["a2a bf16", "apply_groups 2"]
    # fp32 compute: a bf16 wire halves the all-to-all bytes, another prediction, kept apart.
    fp32 = dataclasses.replace(GPUS["h100"], precision="fp32")
    found = search(cfg, 16, 8, fp32, HostProfile(1), 1e6, eps=[8], **only)
    assert sorted(c.a2a_dtype or "compute" for c in found.feasible) == ["bf16", "compute"]
