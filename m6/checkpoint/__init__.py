"""Tools for training checkpoints on disk (an entry point: it may import m6.train).

    python -m m6.checkpoint info PATH
    python -m m6.checkpoint export PATH OUT.safetensors [--dtype fp32|bf16]

PATH is a step directory, its ``.metadata`` file, or a run directory / its ``checkpoints``
directory (then the latest complete checkpoint there).
"""

from m6.checkpoint.export import export_safetensors
from m6.checkpoint.info import checkpoint_info

__all__ = ["checkpoint_info", "export_safetensors"]
