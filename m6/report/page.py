"""The report's one HTML page: a summary table of the run and its picture, embedded, so the file travels alone."""

from __future__ import annotations

import base64
import html
from typing import Any

import numpy as np

from m6.report.run_files import RunRecord


def human_count(n: float) -> str:
    """12345678 -> 12.35M: parameter counts at a glance."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def _get(tree: dict[str, Any] | None, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _model_line(config: dict[str, Any] | None, num_moe_layers: int) -> str | None:
    model = _get(config, "model")
    if not isinstance(model, dict):
        return None
    line = (f"{model.get('num_layers')} blocks x d_model {model.get('d_model')}, {model.get('num_heads')} heads, "
            f"FFN {model.get('ffn_dim')}")
    moe = model.get("moe") or {}
    if moe.get("every", 0):
        line += (f"; MoE every {moe['every']} block(s): {moe.get('num_experts')} experts, top-{moe.get('top_k')}, "
                 f"capacity factor {moe.get('capacity_factor')}, aux_loss_coef {moe.get('aux_loss_coef')}")
        if num_moe_layers:
            line += f" ({num_moe_layers} MoE layers logged)"
    else:
        line += "; dense (no MoE)"
    return line


def summary_rows(run: RunRecord) -> list[tuple[str, str]]:
    """(label, value) lines of the page's table: model, size, steps, final loss, eval, speed, where."""
    summary, config, last = run.summary or {}, run.config, run.rows[-1]
    rows: list[tuple[str, str]] = [("run directory", str(run.run_dir.resolve()))]
    model = _model_line(config, len(run.moe_layers()))
    if model:
        rows.append(("model", model))
    if isinstance(summary.get("total_params"), int):
        size = human_count(summary["total_params"])
        if isinstance(summary.get("active_params"), int):
            size += f" total, {human_count(summary['active_params'])} active per token"
        rows.append(("parameters", size))
    max_steps = _get(config, "train.max_steps")
    done = summary.get("steps", last["step"])
    steps = f"{done}" + (f" of {max_steps}" if max_steps is not None else "")
    rows.append(("steps", steps + ("" if run.summary else " (run not finished: no summary.json)")))
    batch, seq = _get(config, "train.global_batch_size"), _get(config, "data.seq_len")
    if batch is not None:
        rows.append(("global batch", f"{batch} samples" + (f" x {seq} text positions" if seq is not None else "")))
    final = summary.get("final_loss", last.get("loss"))
    if isinstance(final, (int, float)):
        where = "summary.json" if "final_loss" in summary else f"last logged step {last['step']}"
        rows.append(("final loss", f"{final:.4f} ({where})"))
    if run.evals:
        ev = run.evals[-1]
        parts = [f"{k.removeprefix('eval/')} {v:.4f}" for k, v in ev.items()
                 if k != "step" and isinstance(v, (int, float))]
        rows.append((f"eval at step {ev['step']}", ", ".join(parts)))
    for key, label in (("tokens_per_s", "tokens/s (median)"), ("step_time_s", "s/step (median)"),
                       ("tflops", "TFLOP/s (median)"), ("mfu", "MFU (median)")):
        _, values = run.series(key)
        if len(values):
            value = float(np.median(values))
            shown = f"{100 * value:.2f}%" if key == "mfu" else f"{value:,.0f}" if value >= 1000 else f"{value:.4g}"
            rows.append((label, shown))
    for key in ("skipped_steps", "skipped_records"):
        value = summary.get(key, last.get(key))
        if isinstance(value, int):
            rows.append((key.replace("_", " "), str(value)))
    return rows


def build_page(run: RunRecord, png: bytes) -> str:
    """A self-contained HTML page: the summary table, notes on what is missing, and ``png`` inline."""
    name = html.escape(run.run_dir.resolve().name)
    table = "\n".join(f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>"
                      for label, value in summary_rows(run))
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in run.notes)
    notes_html = f"<ul class=\"notes\">{notes}</ul>" if notes else ""
    image = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>m6 run {name}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ text-align: left; padding: 3px 12px; border-bottom: 1px solid #ddd; vertical-align: top; }}
th {{ font-weight: 600; white-space: nowrap; }}
.notes {{ color: #8a5a00; }}
img {{ max-width: 100%; height: auto; }}
</style>
</head>
<body>
<h1>m6 run {name}</h1>
<table>
{table}
</table>
{notes_html}
<img alt="loss, learning rate, throughput, grad norm and expert load of run {name}" src="data:image/png;base64,{image}">
</body>
</html>
"""
