"""The training command: ``m6-train``, ``python -m m6.train`` and the repository's train.py.

    m6-train --config configs/tiny.yaml [--overrides FILE] [key=value ...]
    m6-train --config configs/tiny.yaml run.name=tiny-e16 model.moe.num_experts=16 train.max_steps=50

--overrides FILE reads key=value lines (blank lines and # comments skipped), such as the file
``python -m m6.plan --out FILE`` writes; overrides on the command line come after them and win.

Config keys: the "Config reference" table in docs/training.md (defaults and comments in
m6/config.py); every key with the value this command line gives it: add --print-config.

Exit codes: 0 trained (or stopped cleanly on SIGTERM or Ctrl-C with a checkpoint), 1 a failure
during training (named), 2 bad input (a config error; a checkpoint that cannot continue the run or
whose files are damaged; a run.dir the nodes do not share, found at the first save; data whose every
record is skipped, found after a few steps with no target token), 130 Ctrl-C outside the training
steps (building the run) or a second Ctrl-C while stopping.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from m6.config import ConfigError, ParallelConfig, load
from m6.config_loader import dumps_yaml
from m6.parallel import LayoutError
from m6.parallel.compile import CompileFailed
from m6.parallel.peer_check import describe_peer_failure, is_peer_failure, report_once
from m6.checkpoint.errors import CheckpointError, CheckpointMismatch
from m6.train.loop import TrainingDiverged, train
from m6.train.preemption import EXIT_AT_ONCE
from m6.train.no_target_steps import NoTrainingTargets


def read_overrides_file(path: str) -> list[str]:
    """The ``key=value`` lines of an overrides file (blank lines and ``#`` comments skipped), or a
    ConfigError naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"--overrides {path}: cannot read it ({reason})") from e
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ConfigError(f"--overrides {path}:{number}: {line!r} is not a key=value override")
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m6-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
    parser.add_argument("overrides_on_command_line", nargs="*", metavar="key=value", help="dotted overrides such as train.max_steps=50 or "
                        "data.sources.0.path=/data/shards-{000..099}.tar (list elements by index)")
    parser.add_argument("--overrides", metavar="FILE", action="append", default=[],
                        help="a file of key=value lines (as python -m m6.plan --out writes), applied before the "
                        "command line's overrides; may be given more than once")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (every key, defaults filled in) as YAML and exit")
    # The deepspeed launcher passes --local_rank; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    rank = os.environ.get("RANK")
    where = f"rank {rank}: " if rank is not None else ""
    cfg = None
    try:
        from_files = [line for path in args.overrides for line in read_overrides_file(path)]
        cfg = load(args.config, from_files + args.overrides_on_command_line)
        if args.print_config:
            print(dumps_yaml(cfg), end="")
            return 0
        train(cfg)
    except (ConfigError, LayoutError) as e:
        print(f"{where}config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C outside the steps (building the model, loading a checkpoint): nothing new to save.
        # While steps run, m6.train.preemption turns SIGINT into a stop with a checkpoint.
        print(f"{where}SIGINT outside the training steps: stopped without a checkpoint", file=sys.stderr)
        return EXIT_AT_ONCE
    except (CheckpointMismatch, NoTrainingTargets) as e:
        print(f"{where}error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, TrainingDiverged, CompileFailed) as e:
        print(f"{where}error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if rank is None or not is_peer_failure(e):
            raise
        # A peer died or a collective timed out (parallel.timeout_s): name it instead of hanging
        # or printing the backend's traceback.
        wait_s = cfg.parallel.peer_wait_s if cfg is not None else ParallelConfig.peer_wait_s
        report_once(f"{where}error: {describe_peer_failure(int(rank), int(os.environ['WORLD_SIZE']), wait_s)}")
        return 1
    finally:
        # Every group torn down before the interpreter exits (a finished run's ranks have all
        # passed its last barrier; the Trainer has finished its saves and stopped its threads).
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def run() -> None:
    """Console-script entry point (``m6-train``): train, then leave with the exit code."""
    sys.exit(main())
