"""TensorBoard as a second, optional metrics sink (``logging.tensorboard``): the jsonl file's scalars
under the same names and steps, and each MoE layer's expert load as a histogram over expert ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from m6.config import ConfigError, TensorBoardConfig

DEFAULT_SUBDIR = "tb"
INSTALL_HINT = "pip install tensorboard (or pip install 'm6[tensorboard]')"


def require_tensorboard() -> None:
    """Raise a ConfigError naming logging.tensorboard.enabled unless torch's SummaryWriter can be imported."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (the import is the check)
    except ImportError as e:
        raise ConfigError(f"logging.tensorboard.enabled=true needs the tensorboard package ({e}): "
                          f"{INSTALL_HINT}, or set logging.tensorboard.enabled=false") from e


def tensorboard_dir(settings: TensorBoardConfig, run_dir: Path) -> Path:
    """Where the event files go: logging.tensorboard.dir, or the run dir's tb/ folder."""
    return Path(settings.dir) if settings.dir is not None else run_dir / DEFAULT_SUBDIR


def _scalar(value: Any) -> float | None:
    """A metric as a float for TensorBoard, or None for what the jsonl holds that is not a number."""
    if hasattr(value, "item"):  # 0-d tensor or numpy scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class TensorBoardWriter:
    """Write metrics to TensorBoard event files, flushed after every logged step; main process only."""

    def __init__(self, log_dir: Path, resumed_step: int = 0) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        # A resumed run repeats the steps an earlier attempt logged after its last checkpoint:
        # purge_step makes TensorBoard drop those older events, as the report keeps the last row.
        self._writer = SummaryWriter(str(self.log_dir), purge_step=resumed_step + 1 if resumed_step else None)

    def scalars(self, step: int, metrics: dict[str, Any]) -> None:
        """One scalar per numeric metric, under its jsonl name."""
        for key, value in metrics.items():
            number = _scalar(value)
            if number is not None:
                self._writer.add_scalar(key, number, global_step=step)

    def expert_load(self, step: int, tokens_per_expert: dict[str, list[int]]) -> None:
        """Per MoE layer a histogram over expert ids, each expert's bucket as high as its token count."""
        for layer, counts in tokens_per_expert.items():
            total = sum(counts)
            if not total:
                continue
            ids = range(len(counts))
            used = [e for e in ids if counts[e]]
            self._writer.add_histogram_raw(
                f"expert_load/{layer}", min=float(used[0]), max=float(used[-1]), num=total,
                sum=float(sum(e * c for e, c in zip(ids, counts))),
                sum_squares=float(sum(e * e * c for e, c in zip(ids, counts))),
                bucket_limits=[e + 0.5 for e in ids],  # bucket e holds expert id e: (e - 0.5, e + 0.5]
                bucket_counts=[float(c) for c in counts], global_step=step)

    def expert_bias(self, step: int, biases: dict[str, list[float]]) -> None:
        """Per MoE layer a histogram of its experts' selection biases (aux-free balancing)."""
        for layer, values in biases.items():
            self._writer.add_histogram(f"expert_bias/{layer}", np.asarray(values, dtype=np.float64), global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

