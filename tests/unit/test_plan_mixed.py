"""python -m m6.plan with a mixed inventory: shares by each kind's predicted speed, capped by its
memory (Whale's objective), experts by the same weights; bad inventories exit 2."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from m6 import config as m6config
from m6.config import ConfigError
from m6.plan.__main__ import main
from m6.plan.mixed import parse_inventory, plan_mixed, water_fill

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = ["data.kind=synthetic", "data.sources=[]", "data.num_workers=0", "data.seq_len=32", "model.max_text_len=32",
        "model.image_size=16", "train.global_batch_size=32"]


def test_water_fill_is_proportional_under_caps_and_floors():
    assert water_fill(12, [2, 1], [12, 12]) == pytest.approx([8, 4])
    assert water_fill(12, [1, 1, 1], [2, 12, 12]) == pytest.approx([2, 5, 5])  # capped: the rest by speed
    assert water_fill(10, [100, 1], [10, 10], floor=2) == pytest.approx([8, 2])  # every rank runs its micro-batches
    with pytest.raises(ValueError, match="hold at most 4"):
        water_fill(5, [1, 1], [2, 2])


def test_parse_inventory_and_its_errors(tmp_path):
    kinds = parse_inventory("8xh100, 4xv100:16GB")
    assert [(k.count, k.hw.name, k.hw.memory_gib) for k in kinds] == [(8, "H100 SXM 80GB", 80.0),
                                                                       (4, "V100 SXM2 32GB", 16.0)]
    for bad in ("8xa100", "h100", "0xh100", ""):
        with pytest.raises(ConfigError, match="--gpus"):
            parse_inventory(bad)


def test_shares_follow_speed_and_memory_caps_them():
    cfg = m6config.load(CONFIGS / "tiny.yaml", TINY)
    plan = plan_mixed(cfg, parse_inventory("2xh100,2xv100"))
    h100, v100 = plan.kinds
    speed_ratio = v100.seconds_per_sample / h100.seconds_per_sample
    # bf16 at 0.40 of 989 TFLOP/s vs fp16 at 0.40 of 125 (m6 plans V100s in fp16; ASSUMED efficiencies)
    assert speed_ratio == pytest.approx(989.4 / 125)
    assert h100.share == pytest.approx(32 / (2 + 2 / speed_ratio)) and v100.share == pytest.approx(h100.share / speed_ratio)
    assert sum(plan.weights) == pytest.approx(32) and plan.expert_parallel_size == 4
    assert (h100.experts, v100.experts) == ("0-2", "6")  # 8 experts by [14.2, 14.2, 1.8, 1.8]: 3 + 3 + 1 + 1
    # Even: 8 samples on the slow kind; with these shares every device takes as long as the others.
    assert plan.even_step_s == pytest.approx(8 * v100.seconds_per_sample)
    assert plan.step_s == pytest.approx(h100.share * h100.seconds_per_sample) \
        == pytest.approx(v100.share * v100.seconds_per_sample)
    # Same speed, one kind with a memory that holds fewer rows: it keeps what it holds, the other takes the rest.
    # (0.014 GiB holds 6 rows of this model at its even 2 experts: 10 + 10 + 6 + 6 samples lay the 8
    # experts out 3 + 3 + 1 + 1, and the small kind's peak at 6 rows stays within its memory.)
    plan = plan_mixed(cfg, parse_inventory("2xh100,2xh100:0.014GB"))
    big, small = plan.kinds
    assert small.cap == 6 and small.share == pytest.approx(6) and big.share == pytest.approx(10)
    assert (big.experts, small.experts) == ("0-2", "6")  # ranks 0 and 2, the first of each kind
    assert small.peak_bytes <= 0.014 * 2**30 < plan_mixed(cfg, parse_inventory("4xh100")).kinds[0].peak_bytes
    assert not plan.even_fits and math.isclose(plan.step_s, big.share * big.seconds_per_sample)


def test_cli_writes_overrides_train_py_loads(capsys, tmp_path):
    out = tmp_path / "plan.overrides"
    inventory = tmp_path / "gpus.txt"
    inventory.write_text("# the lab's machines\n2xh100\n2xv100\n")
    assert main([str(CONFIGS / "tiny.yaml"), *TINY, "--inventory", str(inventory), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PREDICTED compute per step" in printed and "experts 0-2 on rank 0" in printed and "ASSUMED" in printed
    cfg = m6config.load(CONFIGS / "tiny.yaml", TINY + out.read_text().split())
    weights = plan_mixed(m6config.load(CONFIGS / "tiny.yaml", TINY), parse_inventory("2xh100,2xv100")).weights
    assert cfg.parallel.balance == pytest.approx(weights, rel=1e-3) and cfg.parallel.expert_parallel_size == 4
    assert main([str(CONFIGS / "tiny.yaml"), *TINY, "--gpus", "2xh100,2xa100", "--out", str(out)]) == 2
    assert "config error: --gpus: cannot read '2xa100'" in capsys.readouterr().err
    assert main([str(CONFIGS / "tiny.yaml"), *TINY, "--gpus", "2xh100,2xv100:0.001GB", "--out", str(out)]) == 2
    assert "config error: no split fits the devices' memory" in capsys.readouterr().err
