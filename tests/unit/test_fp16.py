"""train.precision=fp16 at world size 1: the loss scale follows torch.amp.GradScaler's schedule,
the unscale folded into the clip equals GradScaler's unscale-then-clip, a forced overflow skips
the step and backs the scale off without counting as a bad step (unless at the floor), the scale
resumes exactly, the fp16 run trains like fp32 on CPU, and misused keys are config errors."""

from __future__ import annotations

import contextlib
import io
import math
import random

import pytest
import torch

from m6.config import ConfigError, load
from m6.parallel import clip_grad_norm
from m6.parallel.grad_sync import clip_coefficient
from m6.train.loop import Trainer, TrainingDiverged
from m6.train.loss_scale import BACKOFF_FACTOR, GROWTH_FACTOR, DynamicLossScale

SMALL = [
    "model.d_model=32", "model.num_layers=3", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=256", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0",
    "logging.console=false", "checkpoint.every=0", "memory.host_optimizer=torch",
]
FP16 = ["train.precision=fp16"]
_DEVICE = ["cpu"]  # pytest --device (tests/conftest.py), set once per module below


@pytest.fixture(autouse=True, scope="module")
def _selected_device(device):
    _DEVICE[0] = device.type


def trainer(tmp_path, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"train.device={_DEVICE[0]}", f"run.dir={tmp_path}", *extra]))


def same_loss(got: float, want: float) -> bool:
    """A resumed step's loss: bitwise on the CPU; on CUDA the MoE combine's index_add and the
    embedding backward add with atomics in a run-to-run order (docs/gpu.md), so to fp32 rounding."""
    return got == want if _DEVICE[0] == "cpu" else got == pytest.approx(want, rel=1e-5)


def poison_after_finish(tr: Trainer, steps: set[int]) -> None:
    """At the given steps (counted from 1) put an inf into one gradient after the sync: an overflow."""
    finish = tr.update.finish

    def finish_then_poison() -> None:
        finish()
        if tr.step + 1 in steps:
            target = tr.update.replicated[0]
            target.grad.view(-1)[0] = math.inf
    tr.update.finish = finish_then_poison


def test_scale_schedule_is_grad_scalers():
    """The same overflow sequence drives GradScaler's own update kernel and DynamicLossScale."""
    rng = random.Random(0)
    ours = DynamicLossScale(scale=2.0 ** 10, growth_interval=3, min_scale=2.0 ** -30)
    scale, tracker = torch.full((1,), 2.0 ** 10), torch.zeros(1, dtype=torch.int32)
    for _ in range(200):
        overflow = rng.random() < 0.2
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(overflow)), GROWTH_FACTOR, BACKOFF_FACTOR, 3)
        ours.update(overflow)
        assert ours.scale == scale.item() and ours.growth_tracker == tracker.item()
    floor = DynamicLossScale(scale=4.0, min_scale=2.0)
    floor.update(True)
    floor.update(True)
    assert floor.scale == 2.0 and floor.at_floor and floor.overflow_steps == 2


def test_the_scale_grows_after_a_resume_with_a_smaller_growth_interval(tmp_path):
    """Saved 3 finite steps into an interval of 4, resumed with an interval of 2: the tracker is
    past the new interval, so the next finite step grows the scale (and the one after counts anew)."""
    tr = trainer(tmp_path, *FP16, "train.loss_scale_growth_interval=4", "train.max_steps=6")
    assert [tr.train_step()["loss_scale"] for _ in range(3)] == [2.0 ** 16] * 3
    tr.save_checkpoint(wait=True)
    resumed = trainer(tmp_path, *FP16, "train.loss_scale_growth_interval=2", "train.max_steps=6")
    assert resumed.update.loss_scale.growth_tracker == 3
    assert [resumed.train_step()["loss_scale"] for _ in range(3)] == [2.0 ** 17, 2.0 ** 17, 2.0 ** 18]
    scale = DynamicLossScale(scale=8.0, growth_interval=2, growth_tracker=5)
    scale.update(overflow=False)
    assert scale.scale == 16.0 and scale.growth_tracker == 0


def test_unscale_in_clip_equals_grad_scaler_unscale_then_clip():
    torch.manual_seed(0)
    grads = [torch.randn(5, 7), torch.randn(11)]
    scale = 2.0 ** 12
    for max_norm in (0.5, math.inf):  # clipped, and unscaled only
        ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for q, g in zip(ours, grads):
            q.grad = g * scale
        opt = torch.optim.SGD(ref, lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        scaler.scale(sum((p * g).sum() for p, g in zip(ref, grads))).backward()  # grads: g x scale
        scaler.unscale_(opt)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        norm = clip_grad_norm(ours[:1], ours[1:], max_norm, grad_scale=scale)
        assert norm == pytest.approx(float(ref_norm), rel=1e-6)
        for p, q in zip(ref, ours):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=0)


def test_fp16_trains_like_fp32_with_overflow_skips_and_exact_resume(tmp_path):
    fp32 = trainer(tmp_path / "fp32", "train.precision=fp32")
    ref = [fp32.train_step()["loss"] for _ in range(4)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tr = trainer(tmp_path / "fp16", *FP16, "train.loss_scale_growth_interval=2", "train.max_steps=8")
    assert "fp16 (cast-on-use), dynamic loss scale 65536" in out.getvalue()
    rows = [tr.train_step() for _ in range(4)]
    # fp16 products, fp32 masters and accumulation: close to the fp32 run, not equal to it
    assert [r["loss"] for r in rows] == pytest.approx(ref, rel=2e-3)
    assert [r["loss_scale"] for r in rows] == [2.0 ** 16, 2.0 ** 17, 2.0 ** 17, 2.0 ** 18]  # grows every 2

    poison_after_finish(tr, {5, 6})
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    skipped = [tr.train_step() for _ in range(2)]
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, before[k]), k  # no update
    assert [r["loss_scale"] for r in skipped] == [2.0 ** 17, 2.0 ** 16]
    assert [r["skipped_steps"] for r in skipped] == [1, 2] and skipped[-1]["overflow_steps"] == 2
    assert tr.counters.bad_steps == 0  # the scale's search, not divergence (train.max_bad_steps=5 untouched)
    assert not math.isfinite(skipped[0]["grad_norm"]) and math.isfinite(skipped[0]["loss"])

    tr.train_step()  # step 7: finite again, tracker 1
    tr.save_checkpoint(wait=True)
    straight = [tr.train_step()["loss"] for _ in range(1)]
    resumed = trainer(tmp_path / "fp16", *FP16, "train.loss_scale_growth_interval=2", "train.max_steps=8")
    assert resumed.step == 7
    assert resumed.update.loss_scale.state_dict() == {"scale": 2.0 ** 16, "growth_tracker": 1, "overflow_steps": 2}
    m = resumed.train_step()
    assert same_loss(m["loss"], straight[0]) and m["loss_scale"] == 2.0 ** 17  # the growth the straight run made


def test_overflow_at_the_floor_is_a_bad_step(tmp_path):
    tr = trainer(tmp_path, *FP16, "train.loss_scale_init=4", "train.loss_scale_min=2", "train.max_bad_steps=2")
    poison_after_finish(tr, {1, 2, 3})
    tr.train_step()  # 4 -> 2: the floor reached, not a bad step yet
    assert tr.counters.bad_steps == 0 and tr.update.loss_scale.scale == 2.0
    tr.train_step()
    assert tr.counters.bad_steps == 1
    with pytest.raises(TrainingDiverged, match="2 consecutive steps"):
        tr.train_step()


@pytest.mark.parametrize("overrides, message", [
    (["train.precision=bf16", "train.loss_scale_init=1024"],
     r"train.loss_scale_init=1024.0 only apply with train.precision=fp16 \(it is 'bf16'\)"),
    (["train.precision=fp16", "train.loss_scale_min=2048", "train.loss_scale_init=1024"],
     r"train.loss_scale_min \(2048.0\) must not exceed train.loss_scale_init \(1024.0\)"),
    (["train.precision=fp16", "train.loss_scale_growth_interval=0"], r"train.loss_scale_growth_interval must be > 0"),
    (["train.precision=fp16x"], r"train.precision"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, [*SMALL, *overrides])


def test_fp16_resumes_a_checkpoint_without_a_loss_scale(tmp_path):
    """A bf16 run's checkpoint (no loss_scale piece): the fp16 run starts at loss_scale_init and says so."""
    first = trainer(tmp_path, "train.precision=bf16")
    first.train_step()
    first.save_checkpoint(wait=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        resumed = trainer(tmp_path, *FP16, "train.loss_scale_init=1024")
    assert resumed.step == 1 and resumed.update.loss_scale.scale == 1024.0
    assert "the checkpoint holds no loss scale (its run was not fp16): the scale starts at train.loss_scale_init=1024" \
        in out.getvalue()
    assert resumed.train_step()["loss_scale"] == 1024.0


def test_console_line_shows_the_scale(tmp_path, capsys):
    from m6.train.loggers import MetricsLogger, WandbSettings

    logger = MetricsLogger(tmp_path, {"run": {"name": "t"}}, WandbSettings(), total_steps=10)
    logger.log(1, {"loss": 3.0, "grad_norm": 0.5, "loss_scale": 32768.0, "overflow_steps": 1})
    logger.close()
    assert "gnorm 0.500 | scale 32768 (1 overflow skips)" in capsys.readouterr().out


def test_clip_coefficient_is_torchs_and_one_where_nothing_is_clipped():
    """The one coefficient every clip uses (replicated, FSDP2 shards, 16-bit host gradients)."""
    assert clip_coefficient(4.0, 1.0) == pytest.approx(1.0 / (4.0 + 1e-6), rel=1e-12)
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, math.inf) == 1.0
    assert clip_coefficient(math.inf, 1.0) == 1.0 and clip_coefficient(math.nan, 1.0) == 1.0  # left as they are
