"""Does the checkpoint a run resumes from still fit what this run is asked to do: the words for a
checkpoint of another model (which config keys changed, and the two ways out), and for one that
is already at or past train.max_steps (nothing left to train).

With checkpoint.resume=auto (the default) a second command on the same config resumes the first
one's run dir: these messages say so instead of an unexplained shape error or a run of 0 steps.
"""

from __future__ import annotations

from pathlib import Path

from m6.checkpoint.errors import CheckpointMismatch

# The two ways out, for every message here: the run dir is shared by every command on one run.name.
WAYS_OUT = ("give this run a run dir of its own (run.dir=PATH or run.name=NAME), or start over in this one with "
            "checkpoint.resume=none (its saves then replace these checkpoints)")


def model_mismatch_message(path: Path, changed: list[str], diffs: list[str], shown: int = 5) -> str:
    """The error for a checkpoint whose tensors do not fit the model: the config keys that changed
    since the save (``changed``, from m6.checkpoint.compat.changed_keys), what to do, then the
    first ``shown`` tensor differences."""
    keys = ("; changed since the save: " + "; ".join(changed)) if changed else (
        "; no model.* key differs from the saving run's config, so the checkpoint is of another model")
    listed = "\n  ".join(diffs[:shown]) + (f"\n  ... and {len(diffs) - shown} more" if len(diffs) > shown else "")
    return (f"checkpoint {path} was written for a different model shape ({len(diffs)} difference(s)){keys}. "
            f"To train this model, {WAYS_OUT}:\n  {listed}")


def check_steps_left(step: int, max_steps: int, path: Path) -> None:
    """A checkpoint past train.max_steps cannot be continued by this run's schedule: refuse it
    (CheckpointMismatch: exit 2) before the run starts."""
    if step > max_steps:
        raise CheckpointMismatch(
            f"nothing to train: checkpoint {path} is at step {step}, past train.max_steps={max_steps}; raise "
            f"train.max_steps to train on from it, or {WAYS_OUT}")


def nothing_to_train_line(step: int, end: int, path: Path | None) -> str:
    """The one line of a run that resumed at its last step (a finished run started again)."""
    where = f"checkpoint {path} is" if path is not None else "this run is"
    return (f"nothing to train: {where} at step {step}, already train.max_steps={end} (the run is complete); "
            f"raise train.max_steps to train on, or {WAYS_OUT}")
