"""parallel.shard: the combinations that cannot work yet are config errors naming their keys, and
one process without torch.distributed is told to launch with torchrun (exit code 2 paths)."""

from __future__ import annotations

import pytest

from m6.config import ConfigError, load
from m6.parallel import LayoutError
from m6.train.loop import Trainer

TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=40",
        "model.image_size=16", "model.patch_size=8", "model.moe.num_experts=2", "data.kind=synthetic",
        "data.num_samples=16", "data.eval_samples=4", "data.seq_len=32", "data.num_workers=0",
        "train.global_batch_size=2", "train.max_steps=1", "logging.console=false"]


@pytest.mark.parametrize("extra, keys", [
    (["memory.offload=optimizer"], ("parallel.shard=full", "memory.offload=optimizer")),
    (["memory.offload=optimizer+params", "memory.offload_blocks=[0]"],
     ("parallel.shard=full", "memory.offload_blocks=[0]")),
    (["memory.activation_checkpointing=auto"], ("parallel.shard=full", "memory.activation_checkpointing=auto")),
    (["model.num_layers=2", "model.share_layers=2"], ("parallel.shard=full", "model.share_layers=2")),
])
def test_unsupported_combinations_name_their_keys(extra, keys):
    with pytest.raises(ConfigError) as e:
        load(None, [*TINY, "parallel.shard=full", *extra])
    assert all(k in str(e.value) for k in keys), str(e.value)
    load(None, [*TINY, "parallel.shard=none", *extra])  # the same keys without sharding are fine


def test_unknown_mode_is_refused():
    with pytest.raises(ConfigError, match="parallel.shard"):
        load(None, [*TINY, "parallel.shard=zero3"])


def test_one_plain_process_is_told_to_use_torchrun(tmp_path):
    with pytest.raises(LayoutError, match="parallel.shard=optimizer needs torch.distributed.*torchrun"):
        Trainer(load(None, [*TINY, f"run.dir={tmp_path}", "parallel.shard=optimizer"]))
