"""Damaged checkpoints, tried as a new user would: each class gives one line naming the file and
what is wrong, exit code 2, from train.py and from ``python -m m6.checkpoint info``; train.py with
checkpoint.resume=auto (the default) passes over a checkpoint whose metadata or files are damaged
for the newest readable one and says which it skipped and why. No code planted in a checkpoint
ever runs."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

import train as train_entry
from m6.checkpoint import sharded_io
from m6.checkpoint.__main__ import main as checkpoint_tool
from test_train import SMALL, TINY


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run with two checkpoints (steps 2 and 4, ``latest`` -> step 4)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    assert train_entry.main(_args(run, "train.max_steps=4", "checkpoint.every=2")) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000002", "step_00000004"]
    return run


def _args(run: Path, *extra: str) -> list[str]:
    return ["--config", TINY, *SMALL, f"run.dir={run}", "train.eval_every=0", "checkpoint.async_save=false", *extra]


class _Planted:
    """Runs a shell command when unpickled by plain pickle (what DCP itself would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _damage(run: Path, kind: str, marker: Path) -> Path:
    """Damage ``run``'s newest checkpoint (or its pointer) one way; returns the file damaged."""
    step = run / "checkpoints" / "step_00000004"
    metadata = step / ".metadata"
    if kind == "truncated metadata":
        metadata.write_bytes(metadata.read_bytes()[:60])
        return metadata
    if kind == "garbage metadata":
        metadata.write_bytes(b"\x00\x01 not a pickle at all")
        return metadata
    if kind == "latest garbage":
        (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00garbage")
        return run / "checkpoints" / "latest"
    if kind == "missing shard":
        (step / "__0_0.distcp").unlink()
        return step / "__0_0.distcp"
    if kind == "planted metadata":
        metadata.write_bytes(pickle.dumps(_Planted(marker)))
        return metadata
    if kind == "planted value":
        # A python value's bytes replaced by a same-length pickle that would run a command.
        md = sharded_io.read_metadata(step)
        index = next(i for i in md.storage_data if i.fqn == "meta/world_size")
        info = md.storage_data[index]
        payload = pickle.dumps(_Planted(marker), protocol=2)
        assert len(payload) <= info.length
        data = bytearray((step / info.relative_path).read_bytes())
        data[info.offset:info.offset + info.length] = payload.ljust(info.length, b"\0")
        (step / info.relative_path).write_bytes(bytes(data))
        return step / info.relative_path
    raise AssertionError(kind)


# What the one line says, for each class (after the file's path).
EXPECTED = {
    "truncated metadata": "is truncated (60 bytes)",
    "garbage metadata": "is corrupt: not DCP checkpoint metadata",
    "latest garbage": "holds 10 bytes of binary data, not a step directory name",
    "missing shard": "is missing: rank 0's data file",
    "planted metadata": "holds a pickle that would load posix.system",
    "planted value": "the value meta/world_size cannot be read as plain data",
}


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_a_damaged_checkpoint_is_one_line_exit_2_and_auto_resume_skips_it(saved_run, tmp_path, capsys, kind):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    marker = tmp_path / "planted-code-ran"
    damaged = _damage(run, kind, marker)
    capsys.readouterr()

    # python -m m6.checkpoint info on the run dir (its latest checkpoint)
    assert checkpoint_tool(["info", str(run)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: ") and str(damaged) in line and EXPECTED[kind] in line, line

    # train.py naming the damaged checkpoint (the pointer: a run dir given to checkpoint.init_from)
    named = ([f"checkpoint.init_from={run}", "checkpoint.resume=none"] if kind == "latest garbage"
             else [f"checkpoint.resume={run / 'checkpoints' / 'step_00000004'}"])
    assert train_entry.main(_args(tmp_path / "elsewhere", "train.max_steps=6", *named)) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: ") and str(damaged) in line and EXPECTED[kind] in line, line

    # train.py with checkpoint.resume=auto: the newest readable checkpoint, and why the other was passed over
    code = train_entry.main(_args(run, "train.max_steps=4", "checkpoint.resume=auto"))
    captured = capsys.readouterr()
    if kind == "planted value":
        # Found only when the value is read: its metadata and files are whole, so auto picked it,
        # and the load stops cleanly (auto checks what it can without reading the data).
        assert code == 2 and str(damaged) in _one_line(captured.err) and not marker.exists()
        return
    assert code == 0, captured.err
    assert "Traceback" not in captured.err
    notes = [line for line in captured.out.splitlines() if line.startswith("checkpoint.resume=auto: ")]
    if kind == "latest garbage":  # the pointer passed over; step 4 itself is fine
        assert len(notes) == 2 and "ignored the pointer" in notes[0] and EXPECTED[kind] in notes[0], notes
        assert "resumed from" in captured.out and "step_00000004 at step 4" in captured.out
    else:
        assert len(notes) == 2 and notes[0].startswith("checkpoint.resume=auto: skipped step_00000004: "), notes
        assert str(damaged) in notes[0] and EXPECTED[kind] in notes[0], notes
        assert notes[1] == (f"checkpoint.resume=auto: resuming from {run / 'checkpoints' / 'step_00000002'}, "
                            f"the newest readable checkpoint")
        assert "step_00000002 at step 2" in captured.out
    assert not marker.exists()  # no code planted in the checkpoint ran


def test_auto_resume_with_no_readable_checkpoint_stops_instead_of_starting_over(saved_run, tmp_path, capsys):
    """Every checkpoint damaged: a fresh start would prune them; exit 2 naming each instead."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    for step in ("step_00000002", "step_00000004"):
        (run / "checkpoints" / step / "__0_0.distcp").unlink()
    capsys.readouterr()
    assert train_entry.main(_args(run, "train.max_steps=6")) == 2
    line = _one_line(capsys.readouterr().err)
    assert "checkpoint.resume=auto: no checkpoint in" in line and "checkpoint.resume=none" in line
    assert line.count("is missing: rank 0's data file") == 2
    assert (run / "checkpoints" / "step_00000002").is_dir()  # nothing was replaced
