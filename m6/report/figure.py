"""The report's one picture: loss, lr, throughput, grad norm, per-rank compute and MoE panels, drawn with
matplotlib's Agg canvas.

Panels read only a RunRecord; a metric the run did not log gives a panel that says so, and a
dense model gets no MoE rows. No pyplot: a Figure with its own canvas keeps no global state.
"""

from __future__ import annotations

import io
import math

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import Normalize, TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from m6.report.run_files import ExpertBias, ExpertLoad, RunRecord

MAX_EXPERT_ROWS = 64  # above this, neighbouring experts share a heatmap row: ~3 px a row at 100 dpi
MAX_STEP_COLUMNS = 400  # above this, neighbouring logged steps share a heatmap column
LOAD_RANGE_LOG2 = 3  # heatmap colours span 1/8x .. 8x the uniform share (1/E); beyond is clipped
MAX_LEGEND_LAYERS = 8  # more MoE layers (ranks) than this: lines coloured by depth (rank), no legend
RANK_COMPUTE_PREFIX = "compute_s/rank"  # each rank's step compute time (m6.train.balance)
LOG_Y_SPAN = 8.0  # loss and grad norm get a log y axis when they span more than this factor
MARKERS_BELOW = 25  # series with fewer points get a marker on each, so one logged step still shows
PANEL_W, PANEL_H, HEATMAP_H = 7.0, 2.9, 2.4  # inches
DPI = 100


def _no_data(ax: Axes, message: str) -> None:
    """Turn ``ax`` into a framed note saying why it has nothing to show."""
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, color="0.35", fontsize=9,
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _plot(ax: Axes, steps: np.ndarray, values: np.ndarray, **style) -> None:
    style = {"marker": "o" if len(steps) < MARKERS_BELOW else None, "markersize": 3, "linewidth": 1.2, **style}
    ax.plot(steps, values, **style)


def _step_axis(ax: Axes, x_range: tuple[float, float], grid: bool = True) -> None:
    ax.set_xlim(*x_range)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 1.25 on a 3-step run
    if grid:
        ax.grid(True, alpha=0.3)


def _loss_panel(ax: Axes, run: RunRecord) -> None:
    ax.set_title("loss")
    drawn = False
    for key, style in (("lm_loss", {"color": "C0"}), ("loss", {"color": "C1", "linestyle": "--", "linewidth": 1.0})):
        steps, values = run.series(key)
        if len(steps):
            _plot(ax, steps, values, label=key, **style)
            drawn = True
    for key, label, style in (("eval/caption_loss", "eval caption", {"marker": "o", "color": "C2"}),
                              ("eval/caption_loss_shuffled_images", "eval caption, shuffled images",
                               {"marker": "x", "color": "C3"})):
        steps, values = run.eval_series(key)
        if len(steps):
            ax.plot(steps, values, linestyle="none", markersize=7, markeredgewidth=2, label=label, **style)
            drawn = True
    if not drawn:
        _no_data(ax, "no loss in metrics.jsonl")
        return
    ax.legend(fontsize=8, loc="best")
    _log_if_wide(ax, np.concatenate([line.get_ydata() for line in ax.get_lines()]))


def _log_if_wide(ax: Axes, values: np.ndarray) -> None:
    """Log y when positive values span more than LOG_Y_SPAN: a falling loss keeps its late detail."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) and (values > 0).all() and values.max() > LOG_Y_SPAN * values.min():
        ax.set_yscale("log")
        # Labels at 1-2-5 only: matplotlib's default labels every minor tick of a short decade.
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _single_panel(ax: Axes, run: RunRecord, key: str, title: str, scale: float = 1.0, log_if_wide: bool = False) -> None:
    """One metric over steps, its median in the title; log y when ``log_if_wide`` and it spans widely."""
    steps, values = run.series(key)
    if not len(steps):
        ax.set_title(title)
        _no_data(ax, f"no {key} in metrics.jsonl")
        return
    values = values * scale
    median = float(np.median(values))
    ax.set_title(f"{title} (median {_fmt(median)})")
    _plot(ax, steps, values, color="C0")
    if log_if_wide:
        _log_if_wide(ax, values)


def _throughput_panel(ax: Axes, run: RunRecord) -> None:
    """MFU when the run logged it (the device peak was known), otherwise TFLOP/s and why not MFU."""
    if run.has("mfu"):
        _single_panel(ax, run, "mfu", "MFU (%)", scale=100.0)
    else:
        _single_panel(ax, run, "tflops", "model TFLOP/s: no MFU (device peak unknown)")


def _dropped_panel(ax: Axes, run: RunRecord, layers: list[str]) -> None:
    ax.set_title("assignments dropped by the capacity limit (%)")
    drawn = [(name, *run.series(f"moe/{name}/dropped_fraction")) for name in layers]
    drawn = [(name, s, v) for name, s, v in drawn if len(s)]
    if not drawn:
        _no_data(ax, "no moe/<layer>/dropped_fraction in metrics.jsonl")
        return
    cmap = colormaps["viridis"]
    for i, (name, steps, values) in enumerate(drawn):
        # Beyond the legend's reach, colour runs with depth (dark = first MoE layer).
        color = f"C{i}" if len(drawn) <= MAX_LEGEND_LAYERS else cmap(i / max(1, len(drawn) - 1))
        _plot(ax, steps, values * 100.0, color=color, label=name)
    if len(drawn) <= MAX_LEGEND_LAYERS:
        ax.legend(fontsize=8, loc="best", ncols=2 if len(drawn) > 4 else 1)
    else:
        ax.set_title(f"assignments dropped (%), {len(drawn)} layers: dark {drawn[0][0]} .. light {drawn[-1][0]}")


def rank_compute_keys(run: RunRecord) -> list[str]:
    """The ``compute_s/rank<r>`` metrics a multi-rank run logged (parallel.balance), in rank order."""
    keys = {key for row in run.rows for key in row if key.startswith(RANK_COMPUTE_PREFIX)}
    return sorted(keys, key=lambda key: int(key[len(RANK_COMPUTE_PREFIX):]))


def _rank_compute_panels(ax_time: Axes, ax_spread: Axes, run: RunRecord, keys: list[str]) -> None:
    """Each rank's compute time per step, and the slowest over the fastest at each step: an even
    split on mixed devices shows a wide spread, a balanced one a spread near 1."""
    ax_time.set_title("step compute time per rank (s)")
    series = {key: dict(zip(*run.series(key))) for key in keys}
    cmap = colormaps["viridis"]
    for i, key in enumerate(keys):
        steps, values = run.series(key)
        color = f"C{i}" if len(keys) <= MAX_LEGEND_LAYERS else cmap(i / max(1, len(keys) - 1))
        _plot(ax_time, steps, values, color=color, label=key[len("compute_s/"):])
    if len(keys) <= MAX_LEGEND_LAYERS:
        ax_time.legend(fontsize=8, loc="best", ncols=2 if len(keys) > 4 else 1)
    common = sorted(set.intersection(*(set(v) for v in series.values())))
    spread = [(step, max(v[step] for v in series.values()) / min(v[step] for v in series.values()))
              for step in common if min(v[step] for v in series.values()) > 0]
    if not spread:
        ax_spread.set_title("slowest / fastest rank")
        _no_data(ax_spread, "no step with every rank's compute time")
        return
    steps, ratios = np.array(spread).T
    ax_spread.set_title(f"slowest / fastest rank's compute time (median {np.median(ratios):.3g}x)")
    _plot(ax_spread, steps, ratios, color="C0")


def _bin_edges(steps: np.ndarray) -> np.ndarray:
    """Column edges half-way between logged steps, so uneven logging (a last step off the grid) stays true."""
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5], dtype=np.float64)
    mid = (steps[1:] + steps[:-1]) / 2.0
    return np.concatenate([[steps[0] - (mid[0] - steps[0])], mid, [steps[-1] + (steps[-1] - mid[-1])]])


def group_mean(values: np.ndarray, axis: int, max_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean of consecutive slices along ``axis`` so at most ``max_groups`` remain; returns (means, group
    start indices). The last group may be shorter; its mean divides by its own size."""
    n = values.shape[axis]
    size = max(1, math.ceil(n / max_groups))
    starts = np.arange(0, n, size)
    sums = np.add.reduceat(values, starts, axis=axis)
    lengths = np.diff(np.append(starts, n)).astype(np.float64)
    shape = [1] * values.ndim
    shape[axis] = len(starts)
    return sums / lengths.reshape(shape), starts


def group_extreme(values: np.ndarray, max_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """For [..., N] values, the entry furthest from 0 in each run of consecutive entries along the last
    axis, so at most ``max_groups`` remain; returns (extremes, group start indices)."""
    n = values.shape[-1]
    size = max(1, math.ceil(n / max_groups))
    starts = np.arange(0, n, size)
    padded = np.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, len(starts) * size - n)])  # 0 never wins
    groups = padded.reshape(*values.shape[:-1], len(starts), size)
    pick = np.abs(groups).argmax(axis=-1)[..., None]
    return np.take_along_axis(groups, pick, axis=-1)[..., 0], starts


def load_image(load: ExpertLoad) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """What a heatmap draws: log2(share x E) [rows of experts, columns of steps], the column edges
    (steps), the row edges (expert ids), and the expert and step group sizes.

    Neighbouring logged steps share a column by their mean share; neighbouring experts share a row
    by the one furthest from an even share, so one hot or idle expert among 512 stays visible.
    """
    by_step, step_starts = group_mean(load.shares(), axis=0, max_groups=MAX_STEP_COLUMNS)  # [T', E]
    relative = np.log2(np.maximum(by_step * load.num_experts, 2.0 ** (-LOAD_RANGE_LOG2 - 1)))  # 0 = even
    image, expert_starts = group_extreme(relative, max_groups=MAX_EXPERT_ROWS)  # an idle expert: darkest blue
    return (image.T, *_grid(load.steps, step_starts, expert_starts, load.num_experts))


def _grid(steps: np.ndarray, step_starts: np.ndarray, expert_starts: np.ndarray,
          num_experts: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """A grouped heatmap's column and row edges and its step and expert group sizes."""
    edges = _bin_edges(steps.astype(np.float64))
    x_edges = np.append(edges[step_starts], edges[-1])
    y_edges = np.append(expert_starts, num_experts).astype(np.float64)
    expert_group = int(expert_starts[1] - expert_starts[0]) if len(expert_starts) > 1 else num_experts
    step_group = int(step_starts[1] - step_starts[0]) if len(step_starts) > 1 else 1
    return x_edges, y_edges, expert_group, step_group


def _expert_axis(ax: Axes, title: str, num_experts: int, x_range: tuple[float, float]) -> None:
    """Steps along x, experts down y (expert 0 at the top, as a table reads), and the title."""
    _step_axis(ax, x_range, grid=False)
    ax.set_ylim(num_experts, 0)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("expert")
    ax.yaxis.set_major_locator(FixedLocator(_expert_ticks(num_experts)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: str(int(v))))  # a row's centre names its expert


def _grouping(expert_group: int, step_group: int, row_rule: str) -> str:
    """The title's note on grouped rows and columns ('' when none are grouped)."""
    note = f"; a row: {row_rule} of {expert_group} experts" if expert_group > 1 else ""
    return note + (f"; a column: mean of {step_group} logged steps" if step_group > 1 else "")


def _heatmap(ax: Axes, name: str, load: ExpertLoad, x_range: tuple[float, float], norm: Normalize):
    image, x_edges, y_edges, expert_group, step_group = load_image(load)
    mesh = ax.pcolormesh(x_edges, y_edges, image, cmap="RdBu_r", norm=norm, shading="flat")
    grouped = _grouping(expert_group, step_group, "the least even")
    _expert_axis(ax, f"{name}: share of tokens per expert ({load.num_experts} experts{grouped})",
                 load.num_experts, x_range)
    return mesh


def bias_image(bias: ExpertBias) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """What a bias heatmap draws: bias [rows of experts, columns of steps], column and row edges, and
    the expert and step group sizes (steps share a column by their mean, experts a row by the bias
    furthest from 0, as the load heatmap groups them)."""
    by_step, step_starts = group_mean(bias.bias, axis=0, max_groups=MAX_STEP_COLUMNS)
    image, expert_starts = group_extreme(by_step, max_groups=MAX_EXPERT_ROWS)
    return (image.T, *_grid(bias.steps, step_starts, expert_starts, bias.num_experts))


def _bias_heatmap(ax: Axes, name: str, bias: ExpertBias, x_range: tuple[float, float], norm: Normalize):
    image, x_edges, y_edges, expert_group, step_group = bias_image(bias)
    mesh = ax.pcolormesh(x_edges, y_edges, image, cmap="PuOr_r", norm=norm, shading="flat")
    grouped = _grouping(expert_group, step_group, "the largest |bias|")
    _expert_axis(ax, f"{name}: expert bias (aux-free balancing{grouped})", bias.num_experts, x_range)
    return mesh


def _expert_ticks(num_experts: int) -> list[float]:
    """At most ~8 integer expert ids, centred on their row when each expert has one."""
    step = max(1, math.ceil(num_experts / 8))
    ids = list(range(0, num_experts, step))
    return [i + 0.5 for i in ids] if num_experts <= MAX_EXPERT_ROWS else [float(i) for i in ids]


def build_figure(run: RunRecord) -> Figure:
    """The whole picture of ``run``: six panels over steps (eight when it logged each rank's compute
    time), then one expert-load heatmap per MoE layer."""
    layers = run.moe_layers()
    loads = [(name, run.expert_load[name]) for name in layers if name in run.expert_load]
    # Aux-free balancing: each layer's bias heatmap beside its load heatmap (one layer a row).
    biases = [run.expert_bias.get(name) for name, _ in loads] if run.expert_bias else []
    heat_cols = 2 if biases else (1 if len(loads) == 1 else 2)
    heat_rows = len(loads) if biases else math.ceil(len(loads) / heat_cols)
    rank_keys = rank_compute_keys(run)
    panel_rows = 4 if rank_keys else 3
    height = panel_rows * PANEL_H + heat_rows * HEATMAP_H + (0.9 if loads else 0.0) + 0.6
    fig = Figure(figsize=(2 * PANEL_W, height), dpi=DPI, layout="constrained")
    steps = np.array(run.steps, dtype=np.float64)
    # A margin so the markers of the first and last step (the final eval) are not cut by the frame.
    pad = max(1.0, 0.015 * (steps.max() - steps.min()))
    x_range = (steps.min() - pad, steps.max() + pad)
    name = run.run_dir.resolve().name
    fig.suptitle(f"m6 run {name}: steps {int(steps.min())}..{int(steps.max())} ({len(steps)} logged)",
                 fontsize=13, fontweight="bold")

    top, bottom = (fig.subfigures(2, 1, height_ratios=[panel_rows * PANEL_H, heat_rows * HEATMAP_H + 0.9])
                   if loads else (fig, None))
    axes = top.subplots(panel_rows, 2)
    _loss_panel(axes[0, 0], run)
    _single_panel(axes[0, 1], run, "lr", "learning rate")
    axes[0, 1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    _single_panel(axes[1, 0], run, "tokens_per_s", "tokens/s")
    axes[1, 0].yaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt(v)))  # 1,050,000 rather than 1.05 x 1e6
    _throughput_panel(axes[1, 1], run)
    _single_panel(axes[2, 0], run, "grad_norm", "grad norm (before clipping)", log_if_wide=True)
    if layers:
        _dropped_panel(axes[2, 1], run, layers)
    else:
        axes[2, 1].set_title("MoE")
        _no_data(axes[2, 1], "dense model: no MoE layers logged")
    if rank_keys:
        _rank_compute_panels(axes[3, 0], axes[3, 1], run, rank_keys)
    for ax in axes.flat:
        if ax.get_xticks().size:  # a no-data note keeps no axis
            _step_axis(ax, x_range)

    if bottom is not None:
        num_experts = max(load.num_experts for _, load in loads)
        # White at an even share; red runs to 8x even or to 100% of the layer, whichever is less.
        top = min(LOAD_RANGE_LOG2, max(1, int(math.log2(num_experts))))
        norm = TwoSlopeNorm(vcenter=0.0, vmin=-LOAD_RANGE_LOG2, vmax=top)
        heat_axes = bottom.subplots(heat_rows, heat_cols, squeeze=False)
        load_axes = heat_axes[:, 0] if biases else heat_axes
        mesh = None
        for ax, (layer, load) in zip(load_axes.flat, loads):
            mesh = _heatmap(ax, layer, load, x_range, norm)
        for ax in list(load_axes.flat)[len(loads):]:
            ax.set_visible(False)
        if biases:
            _bias_column(heat_axes[:, 1], bottom, [name for name, _ in loads], biases, x_range, heat_rows)
        # One bar for all heatmaps, at most ~4 inches tall however many layers there are.
        bar = bottom.colorbar(mesh, ax=load_axes, shrink=min(0.9, 4.0 / (heat_rows * HEATMAP_H)), aspect=20,
                              pad=0.01)
        ticks = list(range(-LOAD_RANGE_LOG2, top + 1))
        bar.set_ticks(ticks)
        bar.set_ticklabels([f"{100.0 * 2.0 ** t / num_experts:.3g}%" + (" (1/E)" if t == 0 else "") for t in ticks])
        bar.set_label(f"share of the layer's tokens (E={num_experts})")
        bottom.suptitle("Expert load: each expert's share of its layer's tokens at each logged step, log colour "
                        "scale; white = even (1/E), red = overloaded, blue = underused", fontsize=11)
    return fig


def _bias_column(axes: np.ndarray, fig, names: list[str], biases: list[ExpertBias | None],
                 x_range: tuple[float, float], heat_rows: int) -> None:
    """The bias heatmaps, one beside each load heatmap, on one colour scale centred at 0."""
    largest = max((float(np.abs(b.bias).max()) for b in biases if b is not None), default=0.0) or 1.0
    norm = Normalize(vmin=-largest, vmax=largest)
    mesh = None
    for ax, name, bias in zip(axes, names, biases):
        if bias is None:
            ax.set_title(f"{name}: expert bias")
            _no_data(ax, "no expert_bias logged for this layer")
            continue
        mesh = _bias_heatmap(ax, name, bias, x_range, norm)
    if mesh is not None:
        bar = fig.colorbar(mesh, ax=axes, shrink=min(0.9, 4.0 / (heat_rows * HEATMAP_H)), aspect=20, pad=0.01)
        bar.set_label("bias added to the scores for choosing (orange > 0: favoured)")


def render_png(run: RunRecord) -> bytes:
    """``run``'s picture as PNG bytes."""
    buffer = io.BytesIO()
    build_figure(run).savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()
