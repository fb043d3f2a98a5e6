"""Read what a training run left in its directory (metrics.jsonl, summary.json, config.yaml) into a RunRecord.

Only the files are read, never m6's training code: the format is the one docs/metrics.md
documents, so a report can be drawn on a machine without torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"
EXPERT_TOKENS_KEY = "expert_tokens"
EXPERT_BIAS_KEY = "expert_bias"
EVAL_PREFIX = "eval/"
MOE_PREFIX = "moe/"


class RunDirError(ValueError):
    """A run directory the report cannot draw; the message names the file and what is wrong."""


@dataclass
class ExpertLoad:
    """Tokens routed to each expert of one MoE layer at each logged step: steps [T], tokens int64 [T, E]."""

    steps: np.ndarray
    tokens: np.ndarray

    @property
    def num_experts(self) -> int:
        return int(self.tokens.shape[1])

    def shares(self) -> np.ndarray:
        """float64 [T, E]: each expert's share of the layer's tokens at each step (0 where none were routed)."""
        totals = self.tokens.sum(axis=1, keepdims=True)
        return np.divide(self.tokens, totals, out=np.zeros(self.tokens.shape), where=totals > 0)


@dataclass
class ExpertBias:
    """One MoE layer's aux-free balancing bias per expert at each logged step: steps [T], bias float64 [T, E]."""

    steps: np.ndarray
    bias: np.ndarray

    @property
    def num_experts(self) -> int:
        return int(self.bias.shape[1])


@dataclass
class RunRecord:
    """One run's logged rows (one per step: the last written wins) and its end-of-run files."""

    run_dir: Path
    rows: list[dict[str, Any]]  # training rows, ascending step, without expert_tokens
    evals: list[dict[str, Any]]  # eval rows (eval/... keys), ascending step
    expert_load: dict[str, ExpertLoad]  # MoE layer name -> its load, layers in block order
    summary: dict[str, Any] | None  # summary.json, None when the run did not finish
    config: dict[str, Any] | None  # config.yaml as a plain dict
    notes: list[str] = field(default_factory=list)  # what was missing or skipped, for the page
    expert_bias: dict[str, ExpertBias] = field(default_factory=dict)  # layers with aux-free balancing

    @property
    def steps(self) -> list[int]:
        return [row["step"] for row in self.rows]

    def has(self, key: str) -> bool:
        """Whether any training row carries a number under ``key``."""
        return any(_number(row.get(key)) is not None for row in self.rows)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the training rows that carry a finite number under ``key``."""
        return _series(self.rows, key)

    def eval_series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the eval rows that carry a finite number under ``key`` (an ``eval/`` name)."""
        return _series(self.evals, key)

    def moe_layers(self) -> list[str]:
        """MoE layer names seen in expert_tokens or in ``moe/<layer>/...`` scalars, in block order."""
        names = set(self.expert_load)
        for row in self.rows:
            names.update(key.split("/")[1] for key in row if key.startswith(MOE_PREFIX) and key.count("/") == 2)
        return sorted(names, key=layer_order)


def layer_order(name: str) -> tuple:
    """Sort key that puts block2 before block10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(row["step"], v) for row in rows if (v := _number(row.get(key))) is not None]
    steps = np.array([p[0] for p in pairs], dtype=np.int64)
    return steps, np.array([p[1] for p in pairs], dtype=np.float64)


def _read_rows(path: Path) -> tuple[dict[int, dict], dict[int, dict], dict[int, dict], dict[int, dict], list[str]]:
    """Training, eval, expert-token and expert-bias rows by step (the last line written for a step
    wins), and notes."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    tokens: dict[int, dict] = {}
    biases: dict[int, dict] = {}
    notes: list[str] = []
    bad_lines: list[int] = []
    repeated = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad_lines.append(number)  # a line cut by a crash mid-write
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                bad_lines.append(number)
                continue
            counts = row.pop(EXPERT_TOKENS_KEY, None)
            bias = row.pop(EXPERT_BIAS_KEY, None)
            eval_part = {k: v for k, v in row.items() if k.startswith(EVAL_PREFIX)}
            train_part = {k: v for k, v in row.items() if not k.startswith(EVAL_PREFIX)}
            if eval_part:
                evals[step] = {"step": step, **eval_part}
            if len(train_part) > 1:  # more than "step"
                repeated += step in train
                train[step] = train_part
                # A resumed row without counts must not keep the counts of the row it replaces.
                tokens.pop(step, None)
                biases.pop(step, None)
                if isinstance(counts, dict):
                    tokens[step] = _count_arrays(counts)
                if isinstance(bias, dict):
                    biases[step] = _bias_arrays(bias)
    if bad_lines:
        shown = ", ".join(map(str, bad_lines[:5])) + (" ..." if len(bad_lines) > 5 else "")
        notes.append(f"{len(bad_lines)} line(s) of {path.name} are not a JSON object with an integer step "
                     f"and were skipped (line {shown})")
    if repeated:
        notes.append(f"{repeated} step(s) were logged more than once (a resumed run): the last row of each is shown")
    return train, evals, tokens, biases, notes


def _bias_arrays(biases: dict[str, Any]) -> dict[str, np.ndarray | None]:
    """A row's expert_bias as float64 arrays; None where a layer's value is not a list of numbers."""
    arrays: dict[str, np.ndarray | None] = {}
    for name, values in biases.items():
        ok = isinstance(values, list) and all(_number(v) is not None for v in values)
        arrays[name] = np.asarray(values, dtype=np.float64) if ok else None
    return arrays


def _expert_bias(bias_by_step: dict[int, dict], notes: list[str]) -> dict[str, ExpertBias]:
    """Per layer, the logged steps whose bias vector has the layer's expert count (that of its last step)."""
    layers = sorted({name for values in bias_by_step.values() for name in values}, key=layer_order)
    out: dict[str, ExpertBias] = {}
    for name in layers:
        steps = sorted(s for s, values in bias_by_step.items() if bias_by_step[s].get(name) is not None)
        if not steps:
            notes.append(f"{name}: no logged expert_bias is a list of numbers; no bias heatmap")
            continue
        num_experts = len(bias_by_step[steps[-1]][name])
        kept = [s for s in steps if len(bias_by_step[s][name]) == num_experts]
        if len(kept) < len(steps):
            notes.append(f"{name}: {len(steps) - len(kept)} logged step(s) with another number of expert biases "
                         f"than the last ({num_experts}) left out of the bias heatmap")
        if num_experts:
            out[name] = ExpertBias(np.array(kept, dtype=np.int64), np.stack([bias_by_step[s][name] for s in kept]))
    return out


def _count_arrays(counts: dict[str, Any]) -> dict[str, np.ndarray | None]:
    """A row's expert_tokens as int64 arrays at once: 8 bytes a count, not a Python int's 28 and a
    list slot's 8, so 24 layers x 512 experts x 10,000 logged steps stay ~1 GB. None: not integers."""
    arrays: dict[str, np.ndarray | None] = {}
    for name, values in counts.items():
        array = np.asarray(values) if isinstance(values, list) else None
        ok = array is not None and array.ndim == 1 and (array.size == 0 or array.dtype.kind in "iu")
        arrays[name] = array.astype(np.int64) if ok else None
    return arrays


def _expert_load(tokens_by_step: dict[int, dict], notes: list[str]) -> dict[str, ExpertLoad]:
    """Per layer, the steps whose counts have the layer's expert count (that of its last logged step)."""
    layers = sorted({name for counts in tokens_by_step.values() for name in counts}, key=layer_order)
    out: dict[str, ExpertLoad] = {}
    for name in layers:
        logged = sorted(s for s, counts in tokens_by_step.items() if name in counts)
        steps = [s for s in logged if tokens_by_step[s][name] is not None]
        if len(steps) < len(logged):
            notes.append(f"{name}: {len(logged) - len(steps)} logged step(s) whose expert_tokens are not a "
                         f"list of integers left out of the heatmap")
        if not steps:
            continue
        num_experts = len(tokens_by_step[steps[-1]][name])
        kept = [s for s in steps if len(tokens_by_step[s][name]) == num_experts]
        if len(kept) < len(steps):
            notes.append(f"{name}: {len(steps) - len(kept)} logged step(s) with another number of experts "
                         f"than the last ({num_experts}) left out of the heatmap")
        if num_experts:
            matrix = np.stack([tokens_by_step[s][name] for s in kept])
            out[name] = ExpertLoad(np.array(kept, dtype=np.int64), matrix)
    return out


def _read_optional(path: Path, parse, notes: list[str], missing: str) -> Any:
    if not path.is_file():
        notes.append(f"no {path.name}: {missing}")
        return None
    try:
        value = parse(path.read_text(encoding="utf-8"))
    except (ValueError, yaml.YAMLError) as e:
        notes.append(f"{path.name} could not be read ({type(e).__name__}); left out")
        return None
    if not isinstance(value, dict):
        notes.append(f"{path.name} does not hold a mapping; left out")
        return None
    return value


def read_run(run_dir: str | Path) -> RunRecord:
    """Read ``run_dir``; RunDirError when it has no metrics.jsonl or no training row in it."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory (expected a run.dir of m6 training)")
    if not path.is_file():
        raise RunDirError(f"{path} not found: is {run_dir} a run.dir of m6 training? (it writes "
                          f"{METRICS_FILE} at the first logged step)")
    train, evals, tokens, biases, notes = _read_rows(path)
    if not train:
        raise RunDirError(f"{path} holds no training rows yet (the first is written at step logging.every)")
    summary = _read_optional(run_dir / SUMMARY_FILE, json.loads, notes,
                             "the run has not finished (figures below are from the last logged step)")
    config = _read_optional(run_dir / CONFIG_FILE, yaml.safe_load, notes, "model details unknown")
    if not evals:
        notes.append("no eval rows in metrics.jsonl (train.eval_every=0, or no eval hold-out)")
    record = RunRecord(run_dir=run_dir, rows=[train[s] for s in sorted(train)], evals=[evals[s] for s in sorted(evals)],
                       expert_load=_expert_load(tokens, notes), summary=summary, config=config, notes=notes,
                       expert_bias=_expert_bias(biases, notes))
    if record.moe_layers() and not record.expert_load:
        notes.append("no expert_tokens in metrics.jsonl (written by runs of m6 since the report was added): "
                     "no expert-load heatmap")
    return record
