"""Unit tests for m6.checkpoint (manager, reader, rng, resume): round trips, retention, crash safety and clear errors."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from m6.checkpoint import CheckpointDamaged, CheckpointError, CheckpointManager, resolve_resume
from m6.checkpoint.compat import load_model_state
from m6.checkpoint.rng import rng_state, set_rng_state
from m6.checkpoint.sharded_io import METADATA_FILE
from m6.checkpoint.step_dirs import POINTER_FILE, step_of


def _model(hidden: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


def _trained(hidden: int = 8, device: torch.device = torch.device("cpu")) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and AdamW that have taken two steps, so the optimizer holds exp_avg/exp_avg_sq."""
    model = _model(hidden).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 4).to(device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(step: int, model: torch.nn.Module | None = None) -> dict:
    model = model or _model()
    return {"model": model.state_dict(), "step": step, "data": {"epoch": 0, "offset": step * 4}}


def _draws() -> tuple:
    return torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)], np.random.randn(3)


def test_round_trip_model_optimizer_rng(tmp_path: Path, device: torch.device) -> None:
    torch.manual_seed(0)
    model, opt = _trained(device=device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    opt.step()  # no grads, so parameters stay put; keeps the scheduler's step-order check quiet
    sched.step()
    np.random.randn()  # leave numpy holding a cached gaussian, which is part of its state
    manager = CheckpointManager(tmp_path, keep=3)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": 7,
        "data": {"epoch": 1, "offset": 28},
        "rng": rng_state(),
        "config": {"model": {"dim": 8}, "lr": 1e-2, "betas": (0.9, 0.95)},
    }
    path = manager.save(7, state)
    expected = _draws()

    assert path == tmp_path / "checkpoints" / "step_00000007"
    loaded = manager.load()
    set_rng_state(loaded["rng"])
    for got, want in zip(_draws(), expected):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    fresh, fresh_opt = _trained(device=device)
    load_model_state(fresh, loaded["model"], str(path))
    fresh_opt.load_state_dict(loaded["optimizer"])
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], fresh_opt.state[q][key], rtol=0, atol=0)
    assert loaded["scheduler"] == sched.state_dict()
    assert loaded["step"] == 7 and loaded["data"] == {"epoch": 1, "offset": 28}
    assert loaded["config"]["betas"] == (0.9, 0.95)
    # The same checkpoint loads given its metadata file instead of its directory.
    assert manager.load(path / METADATA_FILE)["step"] == 7


def test_keep_two_leaves_last_two_and_latest_tracks(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    assert manager.latest() is None and manager.list() == []
    for step in (10, 20, 30, 40):
        manager.save(step, _state(step))
        assert manager.latest() == manager.step_dir(step)
    assert [p.name for p in manager.list()] == ["step_00000030", "step_00000040"]
    assert sorted(p.name for p in manager.dir.iterdir()) == ["latest", "step_00000030", "step_00000040"]
    assert manager.load()["step"] == 40


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint.keep"):
        CheckpointManager(tmp_path, keep=0)


def test_list_orders_by_step_number_not_name(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=5)
    for step in (5, 100_000_000, 99_999_999):  # a 9-digit name sorts first as text
        manager.save(step, _state(step))
    assert [step_of(p) for p in manager.list()] == [5, 99_999_999, 100_000_000]


def test_latest_falls_back_without_or_with_stale_pointer(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=3)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    (manager.dir / POINTER_FILE).write_text("step_00000002\n")
    assert manager.latest() == manager.step_dir(2)  # the pointer, not the highest step, is authoritative
    (manager.dir / POINTER_FILE).write_text("step_00000009\n")
    assert manager.latest() == manager.step_dir(3)
    (manager.dir / POINTER_FILE).unlink()
    assert manager.latest() == manager.step_dir(3)


def test_crash_before_rename_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(10, _state(10))

    def crash(src, dst):
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        manager.save(20, _state(20))
    monkeypatch.undo()

    leftovers = [p for p in manager.dir.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the crash should leave the half-done temp dir behind"
    assert manager.list() == [manager.step_dir(10)]
    assert manager.latest() == manager.step_dir(10)
    assert manager.load()["step"] == 10
    # keep=1 must not have pruned the previous checkpoint before the new one was in place; the
    # restarted run sweeps the leftovers at start-up.
    manager.sweep_temporaries()
    manager.save(30, _state(30))
    assert not [p for p in manager.dir.iterdir() if p.name.startswith(".tmp-")]
    assert manager.list() == [manager.step_dir(30)]


def test_crash_between_rename_and_pointer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(10, _state(10))
    real_replace = os.replace

    def replace_dirs_only(src, dst):
        if Path(dst).name == POINTER_FILE:
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_dirs_only)
    with pytest.raises(OSError):
        manager.save(20, _state(20))
    monkeypatch.undo()
    assert manager.latest() == manager.step_dir(10)
    assert manager.load()["step"] == 10


def test_partial_temp_dir_is_ignored_then_swept(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(10, _state(10))
    partial = manager.dir / ".tmp-step_00000020"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    incomplete = manager.dir / "step_00000030"  # a step dir without its metadata is not a checkpoint
    incomplete.mkdir()
    (incomplete / "__0_0.distcp").write_bytes(b"a shard")
    assert manager.list() == [manager.step_dir(10)]
    assert manager.latest() == manager.step_dir(10)
    manager.sweep_temporaries()  # what a (re)started run does before its first save
    assert not partial.exists() and manager.list() == [manager.step_dir(10)]
    manager.save(11, _state(11))
    assert manager.latest() == manager.step_dir(11)


def test_resave_same_step_replaces_it(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(10, {"step": 10, "tag": "first"})
    manager.save(10, {"step": 10, "tag": "second"})
    assert manager.list() == [manager.step_dir(10)]
    assert manager.load()["tag"] == "second"


def test_prune_never_removes_the_checkpoint_just_saved(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(200, _state(200))
    manager.save(110, _state(110))  # resumed from an earlier step: 200 sorts after it
    assert manager.latest() == manager.step_dir(110)
    assert manager.step_dir(110) in manager.list()


def test_truncated_file_names_it(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    path = manager.save(10, _state(10))
    for file in (path / "__0_0.distcp", path / METADATA_FILE):
        data = file.read_bytes()
        for size in (0, 10, len(data) // 2, len(data) - 5):
            file.write_bytes(data[:size])
            with pytest.raises(CheckpointDamaged) as info:
                manager.load(path)
            message = str(info.value)
            assert message.startswith(f"{file} is ") and ("truncated" in message or "corrupt" in message), message
            assert "\n" not in message
        file.write_bytes(data)
    assert manager.load(path)["step"] == 10


def test_load_missing_paths(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        manager.load()
    with pytest.raises(CheckpointError, match="does not exist"):
        manager.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=f"has no {METADATA_FILE}"):
        manager.load(tmp_path / "empty")


def test_unloadable_state_value_fails_the_save(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    with pytest.raises(TypeError, match=r"state\['data'\]\['index'\]: numpy.int64"):
        manager.save(1, {"step": 1, "data": {"index": np.int64(3)}})
    assert manager.list() == []
    assert not manager.dir.exists() or not [p for p in manager.dir.iterdir() if p.name.startswith(".tmp-")]


def test_resolve_resume(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    for value in (None, "none", "None", ""):
        assert resolve_resume(value, manager) is None
    assert resolve_resume("auto", manager) is None  # fresh start
    manager.save(5, _state(5))
    manager.save(6, _state(6))
    assert resolve_resume("auto", manager) == manager.step_dir(6)
    assert resolve_resume(str(manager.step_dir(5)), manager) == manager.step_dir(5)
    missing = tmp_path / "elsewhere" / "step_00000001"
    with pytest.raises(CheckpointError, match="checkpoint.resume") as info:
        resolve_resume(str(missing), manager)
    assert str(missing) in str(info.value)
    with pytest.raises(CheckpointError, match="checkpoint.resume.*without"):
        resolve_resume(str(tmp_path), manager)  # the run dir, not a step dir


def test_load_model_state_shape_mismatch_loads_nothing() -> None:
    torch.manual_seed(0)
    saved = _model(hidden=16).state_dict()
    saved["extra.weight"] = torch.zeros(1)
    saved["extra.bias"] = torch.zeros(1)
    model = _model(hidden=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    del saved["2.bias"]
    with pytest.raises(CheckpointError) as info:
        load_model_state(model, saved, "runs/a/checkpoints/step_00000010")
    message = str(info.value)
    assert "runs/a/checkpoints/step_00000010" in message and "different model shape" in message
    assert "0.weight: checkpoint [16, 4] vs model [8, 4]" in message
    assert "2.weight: checkpoint [2, 16] vs model [2, 8]" in message
    assert "missing in checkpoint: 2.bias" in message
    assert "unexpected in checkpoint: extra.weight" in message
    assert "6 difference" in message and "... and 1 more" in message and "extra.bias" not in message
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_load_model_state_matching_loads() -> None:
    src, dst = _model(), _model()
    load_model_state(dst, src.state_dict(), "mem")
    for a, b in zip(src.parameters(), dst.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_async_saves_stage_into_one_reused_buffer(tmp_path: Path, device: torch.device) -> None:
    """Every asynchronous save copies the state into the same staging buffer, and each checkpoint
    holds its own step's values. On CUDA (bench/gpu_suite.py runs this with --device cuda) the
    device tensors' part is page-locked (cudaHostRegister), and this device's generator restored
    from rng_state() draws the same numbers again; on CPU everything is in the pageable part."""
    model, _ = _trained(device=device)
    manager = CheckpointManager(tmp_path, keep=3)
    expected = {}
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        expected[step] = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        manager.save(step, {"model": model.state_dict(), "step": step}, asynchronous=True)
    manager.wait()
    staging = manager.staging
    assert staging.allocations == 1
    if device.type == "cuda":
        assert staging.registered and staging.pinned.is_pinned() and staging.pageable is None
    else:
        assert staging.pinned is None and staging.pageable.numel() == staging.nbytes > 0
    for step in (1, 2):
        loaded = manager.load(manager.step_dir(step))["model"]
        assert all(torch.equal(loaded[k], v) for k, v in expected[step].items()), step
    manager.close()
    assert staging.nbytes == 0 and not staging.registered

    saved = rng_state()
    draws = torch.rand(8, device=device)
    set_rng_state(saved)
    assert torch.equal(torch.rand(8, device=device), draws)
