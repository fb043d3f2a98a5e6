"""parallel.tensor_parallel_size: sizes it cannot split and combinations not built with it are
config errors naming their keys; the tp layout's groups (no processes needed)."""

from __future__ import annotations

import pytest

from m6.config import ConfigError, load
from m6.parallel import LayoutError, build_layout
from m6.parallel.layout import data_parallel_coordinates

TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.ffn_dim=64", "model.max_text_len=40",
        "model.image_size=16", "model.patch_size=8", "model.moe.num_experts=2", "data.kind=synthetic",
        "data.num_samples=16", "data.eval_samples=4", "data.seq_len=32", "data.num_workers=0",
        "train.global_batch_size=2", "train.max_steps=1", "logging.console=false", "checkpoint.enabled=false"]
TP2 = [*TINY, "parallel.tensor_parallel_size=2"]


def test_tp2_config_loads():
    assert load(None, TP2).parallel.tensor_parallel_size == 2


@pytest.mark.parametrize("extra, key", [
    (["model.num_heads=3", "model.d_model=30", "model.head_dim=10"], "model.num_heads (3)"),
    (["model.num_kv_heads=1"], "model.num_kv_heads (1)"),
    (["model.ffn_dim=63"], "model.ffn_dim (63)"),
    (["model.d_model=31", "model.head_dim=8"], "model.d_model (31)"),
])
def test_sizes_that_do_not_split_name_their_keys(extra, key):
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_size") as e:
        load(None, [*TP2, *extra])
    assert key in str(e.value), str(e.value)


@pytest.mark.parametrize("extra, key", [
    (["memory.offload=optimizer"], "memory.offload=optimizer"),
    (["parallel.balance=auto"], "parallel.balance=auto"),
    (["model.share_layers=2"], "model.share_layers=2"),
    (["model.moe.a2a_dispatch=node_aware"], "model.moe.a2a_dispatch=node_aware"),
    (["model.moe.aux_loss_scope=local"], "model.moe.aux_loss_scope=local"),
    (["memory.activation_checkpointing=auto"], "memory.activation_checkpointing=auto"),
    (["model.qk_norm=full"], "model.qk_norm=full"),
    (["checkpoint.init_from=/tmp/x"], "checkpoint.init_from=/tmp/x"),
])
def test_combinations_not_built_are_refused_by_name(extra, key):
    with pytest.raises(ConfigError) as e:
        load(None, [*TP2, *extra])
    assert "parallel.tensor_parallel_size=2" in str(e.value) and key in str(e.value), str(e.value)


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_shard_composes_with_tp(shard):
    """FSDP2 over each tp coordinate's data-parallel ranks, on top of the tp split."""
    assert load(None, [*TP2, f"parallel.shard={shard}"]).parallel.shard == shard


def test_dropout_composes_with_tp():
    assert load(None, [*TP2, "model.dropout=0.1"]).model.dropout == 0.1


def test_fp16_composes_with_tp():
    assert load(None, [*TP2, "train.precision=fp16"]).train.precision == "fp16"


def test_recompute_full_composes_with_tp():
    """Every rank recomputes the same parts (so each tp group reissues its collectives together)."""
    assert load(None, [*TP2, "memory.activation_checkpointing=full"]).memory.activation_checkpointing == "full"


def test_sequence_parallel_needs_tensor_parallel():
    with pytest.raises(ConfigError, match="parallel.sequence_parallel=true needs parallel.tensor_parallel_size > 1"):
        load(None, [*TINY, "parallel.sequence_parallel=true"])
    assert load(None, [*TP2, "parallel.sequence_parallel=true"]).parallel.sequence_parallel


def test_non_positive_size_is_refused():
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_size must be a positive integer"):
        load(None, [*TINY, "parallel.tensor_parallel_size=0"])


def test_tp_innermost_groups():
    """World 8 = tp 2 x ep 2 x edp 2: tp groups are consecutive ranks, EP and EDP groups are taken
    among the ranks of one tp coordinate, and rank 5 sits at tp 1, data-parallel rank 2, EP rank 0."""
    layout = build_layout(8, 5, 2, 4, local_world_size=8, tensor_parallel_size=2)
    assert layout.tp_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data_group_ranks() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.ep_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.edp_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (layout.tp_rank, layout.dp_rank, layout.ep_rank) == (1, 2, 0)
    assert (layout.data_parallel_size, layout.expert_data_parallel_size) == (4, 2)
    assert layout.expert_ranges_by_rank() == ["0-1", "0-1", "2-3", "2-3", "0-1", "0-1", "2-3", "2-3"]
    assert data_parallel_coordinates(8, 5, 2) == (2, 4)


def test_tp_must_divide_the_world_and_ep_the_data_ranks():
    with pytest.raises(LayoutError, match=r"parallel.tensor_parallel_size \(2\) must divide the number of processes \(3\)"):
        data_parallel_coordinates(3, 0, 2)
    with pytest.raises(LayoutError, match=r"parallel.tensor_parallel_size \(4\)"):
        build_layout(6, 0, 1, 4, local_world_size=6, tensor_parallel_size=4)
    with pytest.raises(LayoutError, match=r"parallel.expert_parallel_size \(4\) must divide the data-parallel ranks"):
        build_layout(4, 0, 4, 4, local_world_size=4, tensor_parallel_size=2)
    assert build_layout(4, 0, "auto", 4, local_world_size=4, tensor_parallel_size=2).expert_parallel_size == 2


def test_the_planner_plans_a_tensor_parallel_config_with_its_split(capsys):
    """A config at tensor parallel 2 is planned as such (m6.plan.tensor_parallel), not as tp 1."""
    from m6.plan.__main__ import main

    assert main(["configs/tiny.yaml", *TP2, "data.sources=[]", "--gpus", "2", "--gpu-memory", "80GB", "--gpu", "h100",
                 "--top", "50"]) == 0
    assert "TP 2" in capsys.readouterr().out
