"""Pretrain an M6 MoE model from a YAML config (the repository's entry point; installed, the same
command is ``m6-train`` or ``python -m m6.train``).

    python train.py --config configs/tiny.yaml [key=value ...]
    python train.py --config configs/tiny.yaml run.name=tiny-e16 model.moe.num_experts=16 train.max_steps=50
"""

import sys

from m6.train.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
