"""State on disk: everything m6 writes and reads as a checkpoint. Imports no m6.train: the training
loop hands in what to save (its Stateful pieces, see ``stateful.py``) and calls in here.

- ``manager.py``: CheckpointManager, owner of ``run_dir/checkpoints``: sharded saves (optionally in
  the background), atomic step directories, the ``latest`` pointer, retention
- ``step_dirs.py``: step-directory names, the pointer, discovery of complete checkpoints
- ``sharded_io.py``: sharded read/write over torch.distributed.checkpoint (DCP): expert rows as
  chunks of global tensors (reshardable), metadata read without unpickling code
- ``state_tree.py``: nested state <-> DCP's flat keys; what ``torch.load(weights_only=True)`` accepts
- ``reader.py``: which step directory a path names; reading its metadata and state
- ``rng.py``: the generator states of one process (CUDA: its own device's only)
- ``staging.py``: the host buffer an asynchronous save copies the state into (allocated once, reused)
- ``resume.py``: config key checkpoint.resume -> a path, agreed by every rank
- ``compat.py``: does a checkpoint fit this run (shapes, changed config keys)
- ``init_from.py``: weights-only start from another run's checkpoint, dense -> MoE upcycling
- ``errors.py``: the errors a user sees
- tools (``python -m m6.checkpoint``): ``info.py`` and ``export.py``
- Hugging Face: ``hf_families.py`` (config translation and one name map per family),
  ``safetensors_reader.py`` (shards read tensor by tensor), ``hf_import.py`` (``import-hf``),
  ``hf_export.py`` (``export --format hf``)
- ``load_model.py``: ``load_model(DIR)`` -> (model, config) for evaluation scripts

    python -m m6.checkpoint info PATH
    python -m m6.checkpoint export PATH OUT.safetensors [--dtype fp32|bf16]

PATH is a step directory, its ``.metadata`` file, or a run directory / its ``checkpoints``
directory (then the latest complete checkpoint there).
"""

from m6.checkpoint.errors import CheckpointDamaged, CheckpointError, CheckpointMismatch, RunDirNotShared
from m6.checkpoint.export import export_safetensors
from m6.checkpoint.info import checkpoint_info
from m6.checkpoint.hf_export import export_hf
from m6.checkpoint.hf_import import import_hf
from m6.checkpoint.init_from import init_from_checkpoint
from m6.checkpoint.load_model import load_model
from m6.checkpoint.manager import CheckpointManager, SavedCheckpoint
from m6.checkpoint.reader import find_checkpoint, read_checkpoint
from m6.checkpoint.resume import agree_on_resume, resolve_resume

__all__ = ["CheckpointDamaged", "CheckpointError", "CheckpointManager", "CheckpointMismatch", "RunDirNotShared",
           "SavedCheckpoint", "agree_on_resume",
           "checkpoint_info", "export_hf", "export_safetensors", "import_hf", "load_model", "find_checkpoint", "init_from_checkpoint", "read_checkpoint",
           "resolve_resume"]
