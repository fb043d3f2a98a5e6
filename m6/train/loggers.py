"""Where training metrics go: a console line, run_dir/metrics.jsonl and (optionally) Weights & Biases
and TensorBoard (m6.train.tensorboard_writer).

Only the main process writes anything; other ranks get a logger whose methods return at once.
The console line recognises these metric keys (all optional): ``loss``, ``lr``, ``tokens_per_s`` and
``step_time_s`` (for its speed: MetricsLogger.speed), ``grad_norm``, ``loss_scale`` with
``overflow_steps`` (fp16); every key, recognised or not, goes to the jsonl file and to W&B unchanged.
The per-expert token counts of a training step ride on its jsonl row as
``"expert_tokens": {"block1": [int, ...], ...}`` (the row's last key) and go to W&B (a table and
histograms) and TensorBoard (histograms). With aux-free balancing the experts' router biases ride
the same way as ``"expert_bias": {"block1": [float, ...], ...}`` (W&B: a table; TensorBoard: a
histogram of the values).
"""

from __future__ import annotations

import atexit
import json
import netrc
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from m6.config import ConfigError, TensorBoardConfig
from m6.train.tensorboard_writer import TensorBoardWriter, require_tensorboard, tensorboard_dir

WANDB_MODES = ("auto", "online", "offline", "disabled")
WANDB_SAAS_HOST = "api.wandb.ai"
FORGE_DEFAULT_HOST = "api.forge.coreweave.com"
FORGE_DOMAIN = "forge.coreweave.com"
# Logged intervals whose median speed the console shows (tok/s, s/step and the ETA alike): short
# enough to follow a change of speed within a few lines, and a stall in one or two of them (a
# checkpoint, an eval, a slow read) moves nothing.
SPEED_WINDOW = 5
WANDB_INIT_TIMEOUT_S = 60.0
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
EXPERT_TOKENS_KEY = "expert_tokens"  # on a training row: {moe layer name: [tokens routed to expert e, ...]}
EXPERT_BIAS_KEY = "expert_bias"  # on a training row: {moe layer name: [selection bias of expert e, ...]}


@dataclass(frozen=True)
class Speed:
    """Wall seconds per training step and real tokens per second, of one logged interval."""

    seconds_per_step: float
    tokens_per_s: float | None


@dataclass
class WandbSettings:
    """The ``logging.wandb`` config section: whether and where to send metrics to W&B."""

    enabled: bool = False
    project: str = "m6"
    name: str | None = None  # run name; None -> the run dir's name
    tags: list[str] = field(default_factory=list)
    mode: str = "auto"  # auto | online | offline | disabled
    entity: str | None = None


def _wandb_hosts() -> list[str]:
    """Return the host names a W&B login may be stored under in netrc, as wandb itself looks them up."""
    base_url = os.environ.get("WANDB_BASE_URL")
    if base_url:
        host = urlsplit(base_url).hostname or ""
        return [host, WANDB_SAAS_HOST] if host.endswith(FORGE_DOMAIN) else [host]
    # wandb >= 0.31 defaults to the CoreWeave Forge proxy and falls back to the api.wandb.ai entry
    # written by older versions' `wandb login`, so either entry means the user is logged in.
    return [FORGE_DEFAULT_HOST, WANDB_SAAS_HOST]


def _netrc_path() -> Path | None:
    """Return the netrc file W&B itself would read ($NETRC, ~/.netrc, ~/_netrc), or None."""
    if os.environ.get("NETRC"):
        return Path(os.environ["NETRC"]).expanduser()
    for candidate in ("~/.netrc", "~/_netrc"):
        path = Path(candidate).expanduser()
        if path.exists():
            return path
    return None


def has_wandb_credentials() -> bool:
    """Return True if WANDB_API_KEY (or WANDB_IDENTITY_TOKEN_FILE) is set or netrc holds a W&B key; never prompts."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = _netrc_path()
    if path is None or not path.is_file():
        return False
    try:
        entries = netrc.netrc(str(path))
    except (netrc.NetrcParseError, OSError):
        # An unreadable netrc means wandb could not log in either, so treat it as no credentials.
        return False
    return any((entry := entries.authenticators(host)) is not None and bool(entry[2]) for host in _wandb_hosts())


def resolve_wandb_mode(mode: str) -> str:
    """Turn ``logging.wandb.mode`` into a concrete W&B mode: auto -> online with credentials, else offline."""
    if mode not in WANDB_MODES:
        raise ConfigError(f"logging.wandb.mode must be one of {', '.join(WANDB_MODES)}; got {mode!r}")
    if mode == "auto":
        return "online" if has_wandb_credentials() else "offline"
    if mode == "online" and not has_wandb_credentials():
        # Online without credentials would make wandb prompt for a key (or hang on a headless node).
        raise ConfigError(
            "logging.wandb.mode=online but no W&B credentials were found (WANDB_API_KEY or a netrc entry "
            f"for {' or '.join(_wandb_hosts())}); run `wandb login`, or set logging.wandb.mode=offline or auto"
        )
    return mode


def format_duration(seconds: float) -> str:
    """Format a duration as h:mm:ss (hours may exceed 24)."""
    total = max(0, int(round(seconds)))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def _json_value(value: Any) -> Any:
    """Convert a 0-d tensor or numpy scalar to a Python number so json can write it."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metric value of type {type(value).__name__} is not JSON serialisable")


def _fmt_scalar(value: Any) -> str:
    """Format a metric compactly for the console: ints as-is, floats to 4 significant digits."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"{float(value):.4g}"


class MetricsLogger:
    """Send training metrics to the console, run_dir/metrics.jsonl and W&B; a no-op off the main process."""

    def __init__(
        self,
        run_dir: str | Path,
        config_dict: dict,
        wandb: WandbSettings,
        total_steps: int,
        console: bool = True,
        is_main_process: bool = True,
        tensorboard: TensorBoardConfig | None = None,
        resumed_step: int = 0,
    ) -> None:
        """``resumed_step``: the step a resumed run continues from (0 = a fresh start)."""
        self.run_dir = Path(run_dir).resolve()
        self.total_steps = int(total_steps)
        self.console = console
        self.active = is_main_process
        self.wandb_mode: str | None = None  # the resolved mode, or None when W&B is off
        self.tensorboard_dir: Path | None = None  # where TensorBoard's event files go, or None when off
        self._run: Any = None
        self._tb: TensorBoardWriter | None = None
        self._jsonl = None
        self._closed = False
        self._summary: dict[str, Any] = {}
        self._last_log: tuple[int, float] | None = None  # (step, perf_counter) of the previous log
        self._speeds: deque[Speed] = deque(maxlen=SPEED_WINDOW)
        if not self.active:
            return
        # Resolve the W&B mode first so a bad config fails before any file is written.
        if wandb.enabled:
            mode = resolve_wandb_mode(wandb.mode)
            self.wandb_mode = None if mode == "disabled" else mode
        tb_enabled = tensorboard is not None and tensorboard.enabled
        if tb_enabled:
            require_tensorboard()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.wandb_mode is not None:
            self._run = self._init_wandb(wandb, config_dict)
        if tb_enabled:
            self.tensorboard_dir = tensorboard_dir(tensorboard, self.run_dir).resolve()
            self._tb = TensorBoardWriter(self.tensorboard_dir, resumed_step)
        # Append so a resumed run continues the same file.
        self._jsonl = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")
        atexit.register(self._close_at_exit)

    def _init_wandb(self, settings: WandbSettings, config_dict: dict) -> Any:
        """Start the W&B run with its files under run_dir/wandb/."""
        import wandb  # imported lazily: ~1 s, and not needed when W&B is off

        try:
            run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                name=settings.name or self.run_dir.name,
                tags=list(settings.tags),
                config=config_dict,
                dir=str(self.run_dir),
                mode=self.wandb_mode,
                # Several loggers in one process (tests, sweeps) must each get their own run.
                reinit="create_new",
                settings=wandb.Settings(
                    # silent: wandb's own banner would tell users to run `wandb online`, which
                    # our config overrides; we print one accurate line below instead.
                    silent=True,
                    console="off",  # the training log is already ours; no stdout capture
                    init_timeout=WANDB_INIT_TIMEOUT_S,
                ),
            )
        except Exception as e:  # wandb raises many types (CommError, UsageError, timeouts)
            raise RuntimeError(
                f"wandb.init failed in mode {self.wandb_mode!r}: {e}. To train without W&B set "
                "logging.wandb.enabled=false, or logging.wandb.mode=offline to keep a local W&B log"
            ) from e
        if self.console:
            where = run.settings.sync_dir
            extra = f" (upload later with `wandb sync {where}`)" if self.wandb_mode == "offline" else ""
            print(f"W&B {self.wandb_mode}: {where}{extra}", flush=True)
        return run

    def log(self, step: int, metrics: dict[str, float | int],
            expert_tokens: dict[str, list[int]] | None = None,
            expert_bias: dict[str, list[float]] | None = None) -> None:
        """Record one training step's scalar metrics and (optionally) its per-MoE-layer token counts
        per expert and expert biases (aux-free balancing) everywhere, and print the console line."""
        if not self.active:
            return
        self._record_speed(step, metrics)
        row: dict[str, Any] = dict(metrics)
        if expert_tokens:
            # Plain ints: the counts are exact, and "12" is half of "12.0" on a line that holds
            # num_layers x num_experts of them.
            row[EXPERT_TOKENS_KEY] = {layer: [int(c) for c in counts] for layer, counts in expert_tokens.items()}
        if expert_bias:
            row[EXPERT_BIAS_KEY] = {layer: [float(b) for b in bias] for layer, bias in expert_bias.items()}
        self._write_jsonl(step, row)
        if self.console:
            print(self._train_line(step, metrics), flush=True)
        if self._run is not None:
            payload: dict[str, Any] = dict(metrics)
            if expert_tokens:
                payload.update(self._wandb_expert_load(row[EXPERT_TOKENS_KEY]))
            if expert_bias:
                payload.update(self._wandb_expert_bias(row[EXPERT_BIAS_KEY]))
            self._run.log(payload, step=step)
        if self._tb is not None:
            self._tb.scalars(step, metrics)
            if expert_tokens:
                self._tb.expert_load(step, row[EXPERT_TOKENS_KEY])
            if expert_bias:
                self._tb.expert_bias(step, row[EXPERT_BIAS_KEY])
            self._tb.flush()

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Record evaluation metrics under the ``eval/`` prefix and print an eval console line."""
        if not self.active:
            return
        prefixed = {f"eval/{key}": value for key, value in metrics.items()}
        self._write_jsonl(step, prefixed)
        if self.console:
            parts = [f"eval {self._step_str(step)}"]
            parts += [f"{key} {_fmt_scalar(value)}" for key, value in metrics.items()]
            print(" | ".join(parts), flush=True)
        if self._run is not None:
            self._run.log(prefixed, step=step)
        if self._tb is not None:
            self._tb.scalars(step, prefixed)
            self._tb.flush()

    @staticmethod
    def _wandb_expert_load(tokens_per_expert: dict[str, list[int]]) -> dict[str, Any]:
        """Per-MoE-layer token counts per expert as W&B objects: one table and a histogram per layer."""
        import numpy as np
        import wandb

        rows = []
        payload: dict[str, Any] = {}
        for layer, counts in tokens_per_expert.items():
            rows += [[layer, expert, tokens] for expert, tokens in enumerate(counts)]
            # Bins are expert ids weighted by tokens, so a bar's height is that expert's load;
            # above W&B's 512-bin limit neighbouring experts share a bar.
            num_bins = min(len(counts), wandb.Histogram.MAX_LENGTH)
            if num_bins:
                hist = np.histogram(np.arange(len(counts)), bins=num_bins, range=(0, len(counts)), weights=counts)
                payload[f"expert_load/{layer}"] = wandb.Histogram(np_histogram=hist)
        payload["expert_load/table"] = wandb.Table(columns=["layer", "expert", "tokens"], data=rows)
        return payload

    @staticmethod
    def _wandb_expert_bias(biases: dict[str, list[float]]) -> dict[str, Any]:
        """Per-MoE-layer expert biases as one W&B table (layer, expert, bias)."""
        import wandb

        rows = [[layer, expert, bias] for layer, values in biases.items() for expert, bias in enumerate(values)]
        return {"expert_bias/table": wandb.Table(columns=["layer", "expert", "bias"], data=rows)}

    def summary(self, values: dict) -> None:
        """Record end-of-run values in the W&B run summary and in run_dir/summary.json."""
        if not self.active:
            return
        self._summary.update(values)
        path = self.run_dir / SUMMARY_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self._summary, indent=2, default=_json_value) + "\n", encoding="utf-8")
        os.replace(tmp, path)  # atomic: a crash mid-write never leaves a truncated summary
        if self._run is not None:
            self._run.summary.update(dict(values))

    def close(self, exit_code: int | None = None) -> None:
        """Flush and close the jsonl file and TensorBoard's, and finish the W&B run; safe to call more than once."""
        if self._closed or not self.active:
            self._closed = True
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None

    def _close_at_exit(self) -> None:
        """Finish at interpreter exit, marking the W&B run failed if an uncaught exception ended it."""
        # The interpreter sets sys.last_value when it reports an uncaught exception.
        self.close(exit_code=1 if getattr(sys, "last_value", None) is not None else None)

    def _write_jsonl(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one JSON line and flush it, so a crash loses at most the line being written."""
        assert self._jsonl is not None and not self._jsonl.closed, "MetricsLogger used after close()"
        # No spaces after separators: an expert_tokens row of 24 layers x 512 experts stays ~5 bytes a count.
        self._jsonl.write(json.dumps({"step": step, **metrics}, default=_json_value, separators=(",", ":")) + "\n")
        self._jsonl.flush()

    def _step_str(self, step: int) -> str:
        """Return ``step    50/200`` with the step right-aligned so consecutive lines line up."""
        width = max(5, len(str(self.total_steps)))
        return f"step {step:>{width}}/{self.total_steps}"

    def _record_speed(self, step: int, metrics: dict[str, Any]) -> None:
        """One sample of the speed window: the wall time per step since the previous log (evals,
        saves and data waits included, as the ETA needs), or at a run's first log that step's own
        ``step_time_s``; tokens per second = the logged step's tokens (``tokens_per_s`` x
        ``step_time_s``) over that time."""
        now = time.perf_counter()
        previous, self._last_log = self._last_log, (step, now)
        if previous is not None and step > previous[0]:
            seconds = (now - previous[1]) / (step - previous[0])
        elif "step_time_s" in metrics:
            seconds = float(metrics["step_time_s"])
        else:
            return
        tokens_per_s = None
        if "tokens_per_s" in metrics:
            step_time = float(metrics.get("step_time_s", seconds))
            tokens_per_s = float(metrics["tokens_per_s"]) * step_time / seconds if seconds > 0 else None
        self._speeds.append(Speed(seconds, tokens_per_s))

    def speed(self) -> Speed | None:
        """The console's speed: of the last SPEED_WINDOW logged intervals, the one with the median
        time per step (the lower of the two middle ones), so tok/s, s/step and the ETA all come
        from one sample of one window; None before the first log."""
        if not self._speeds:
            return None
        # Ties go to the most recent interval: its tokens per step are the current ones.
        ordered = sorted(enumerate(self._speeds), key=lambda pair: (pair[1].seconds_per_step, -pair[0]))
        return ordered[(len(ordered) - 1) // 2][1]

    def _train_line(self, step: int, metrics: dict[str, Any]) -> str:
        """Build the concise console line for a training step."""
        parts = [self._step_str(step)]
        if "loss" in metrics:
            parts.append(f"loss {float(metrics['loss']):.4f}")
        if "lr" in metrics:
            parts.append(f"lr {float(metrics['lr']):.2e}")
        if "grad_norm" in metrics:
            parts.append(f"gnorm {float(metrics['grad_norm']):.3f}")
        if "loss_scale" in metrics:  # fp16: the scale, and the steps its overflows skipped
            parts.append(f"scale {float(metrics['loss_scale']):g} ({int(metrics.get('overflow_steps', 0))} overflow skips)")
        speed = self.speed()
        if speed is not None:
            if speed.tokens_per_s is not None:
                parts.append(f"{speed.tokens_per_s:,.0f} tok/s")
            parts.append(f"{speed.seconds_per_step:.2f} s/step")
            parts.append(f"eta {format_duration(speed.seconds_per_step * max(0, self.total_steps - step))}")
        return " | ".join(parts)


__all__ = ["MetricsLogger", "Speed", "WandbSettings", "format_duration", "has_wandb_credentials", "resolve_wandb_mode"]
