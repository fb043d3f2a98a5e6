"""parallel.pipeline_parallel_size: sizes and boundaries that cannot cut the model and the
combinations not built with pipelining are config errors naming their keys; the pp layout's
groups and the stage cut (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from m6.config import ConfigError, ParallelConfig, load
from m6.model import M6Model
from m6.parallel import LayoutError, build_layout
from m6.parallel.layout import data_parallel_coordinates
from m6.parallel.pipeline import StageGap, materialize_stages, rank_stage_indices, stage_first_blocks
from m6.parallel.tensor_parallel import apply_tensor_parallel

TINY = ["model.d_model=32", "model.num_layers=4", "model.num_heads=4", "model.ffn_dim=64", "model.max_text_len=40",
        "model.image_size=16", "model.patch_size=8", "model.moe.num_experts=2", "model.moe.every=2",
        "data.kind=synthetic", "data.num_samples=16", "data.eval_samples=0", "data.seq_len=32",
        "data.num_workers=0", "train.global_batch_size=2", "train.max_steps=1", "logging.console=false",
        "checkpoint.enabled=false"]
PP2 = [*TINY, "parallel.pipeline_parallel_size=2"]


def test_pp2_config_loads():
    cfg = load(None, [*PP2, "parallel.pipeline_stages=[0,3]"])
    assert cfg.parallel.pipeline_parallel_size == 2 and cfg.parallel.pipeline_stages == [0, 3]
    assert load(None, [*PP2, "parallel.shard=full"]).parallel.shard == "full"  # FSDP2 inside each stage
    assert load(None, [*PP2, "memory.activation_checkpointing=full"]).memory.activation_checkpointing == "full"
    assert load(None, [*PP2, "memory.activation_checkpointing=auto"]).memory.activation_checkpointing == "auto"
    assert load(None, [*PP2, "train.compile=blocks"]).train.compile == "blocks"
    for offload in ("optimizer", "optimizer+params", "zero"):  # m6's offload of each rank's stages
        precision = "train.precision=bf16" if offload == "zero" else "train.precision=fp32"
        assert load(None, [*PP2, f"memory.offload={offload}", precision]).memory.offload == offload
    assert load(None, [*PP2, "memory.offload=optimizer", "parallel.pipeline_schedule=zero_bubble"]).memory.offload \
        == "optimizer"
    assert load(None, [*PP2, "memory.offload=optimizer", "optim.delayed_update=true"]).optim.delayed_update


@pytest.mark.parametrize("extra, reason", [
    (["parallel.shard=full", "memory.offload=optimizer+params"], "FSDP2's CPU offload of the stages' units"),
    (["memory.offload=optimizer+params", "memory.offload_blocks=auto"], "the whole model's memory estimate"),
    (["memory.offload=optimizer+params", "parallel.pipeline_schedule=zero_bubble"],
     "zero_bubble splits that backward into input- and weight-gradient passes"),
])
def test_offload_that_does_not_compose_is_refused_with_its_reason(extra, reason):
    with pytest.raises(ConfigError) as e:
        load(None, [*PP2, *extra])
    assert "parallel.pipeline_parallel_size=2" in str(e.value) and reason in str(e.value), str(e.value)


@pytest.mark.parametrize("extra, message", [
    (["parallel.pipeline_parallel_size=0"], "parallel.pipeline_parallel_size must be a positive integer"),
    (["parallel.pipeline_parallel_size=5"], "needs model.num_layers >= 5"),
    (["parallel.pipeline_schedule=interleaved", "parallel.pipeline_parallel_size=3"], "needs model.num_layers >= 6"),
    (["parallel.pipeline_stages=[0,2,3]"], "one first block per stage"),
    (["parallel.pipeline_stages=[1,3]"], "must start at block 0 and increase strictly"),
    (["parallel.pipeline_stages=[0,0]"], "must start at block 0 and increase strictly"),
    (["parallel.pipeline_stages=[0,4]"], "must be below model.num_layers (4)"),
    (["parallel.pipeline_stages_per_rank=2"], "parallel.pipeline_schedule=1f1b runs one stage per rank"),
    (["parallel.pipeline_schedule=interleaved", "parallel.pipeline_stages_per_rank=1"], "needs parallel.pipeline_stages_per_rank >= 2"),
    (["parallel.pipeline_schedule=zero_bubble", "parallel.pipeline_stages_per_rank=3"], "runs exactly 2 stages per rank"),
])
def test_bad_sizes_and_boundaries_name_their_keys(extra, message):
    with pytest.raises(ConfigError) as e:
        load(None, [*PP2, *extra])
    assert message in str(e.value), str(e.value)


def test_zero_bubble_refuses_the_caption_eval():
    with pytest.raises(ConfigError, match="parallel.pipeline_schedule=zero_bubble with data.eval_samples=4"):
        load(None, [*PP2, "parallel.pipeline_schedule=zero_bubble", "data.eval_samples=4"])
    assert load(None, [*PP2, "parallel.pipeline_schedule=interleaved", "data.eval_samples=4"]).data.eval_samples == 4


def test_stages_need_a_pipeline():
    with pytest.raises(ConfigError, match=r"parallel.pipeline_stages=\[0, 2\] needs parallel.pipeline_parallel_size > 1"):
        load(None, [*TINY, "parallel.pipeline_stages=[0,2]"])


@pytest.mark.parametrize("extra, key", [
    (["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"], "parallel.sequence_parallel=true"),
    (["parallel.balance=auto"], "parallel.balance=auto"),
    (["model.share_layers=2", "model.moe.every=1"], "model.share_layers=2"),
    (["memory.activation_checkpointing=full", "memory.check_checkpointing=true"], "memory.check_checkpointing=true"),
    (["train.precision=bf16", "train.weight_copy=per_step"], "train.weight_copy=per_step"),
    (["checkpoint.init_from=/tmp/x"], "checkpoint.init_from=/tmp/x"),
])
def test_combinations_not_built_are_refused_by_name(extra, key):
    with pytest.raises(ConfigError) as e:
        load(None, [*PP2, *extra])
    assert "parallel.pipeline_parallel_size=2" in str(e.value) and key in str(e.value), str(e.value)


def test_pp_outermost_groups():
    """World 8 = pp 2 x edp 2 x ep 2: stage 0 is ranks 0-3, stage 1 ranks 4-7; EP and EDP groups
    are taken inside a stage; a pipeline is one rank of each stage at the same place."""
    layout = build_layout(8, 6, 2, 4, local_world_size=8, pipeline_parallel_size=2)
    assert layout.data_group_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.ep_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.edp_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (layout.pp_rank, layout.dp_rank, layout.ep_rank) == (1, 2, 0)
    assert (layout.data_parallel_size, layout.expert_data_parallel_size) == (4, 2)
    assert layout.expert_ranges_by_rank() == ["0-1", "2-3"] * 4
    assert data_parallel_coordinates(8, 6, 1, 2) == (2, 4)


def test_pp_by_tp_groups():
    """World 8 = pp 2 x edp 1 x ep 2 x tp 2: a stage's ranks are consecutive, its tp pairs
    consecutive inside it; a pipeline, a data-parallel group and an EP group hold one tp coordinate."""
    layout = build_layout(8, 6, 2, 4, local_world_size=8, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert layout.tp_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.data_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.ep_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert (layout.pp_rank, layout.dp_rank, layout.ep_rank, layout.tp_rank) == (1, 1, 1, 0)
    assert data_parallel_coordinates(8, 6, 2, 2) == (1, 2)
    with pytest.raises(LayoutError, match=r"parallel.tensor_parallel_size \(4\) must divide the ranks of a "
                                          r"pipeline stage \(2"):
        build_layout(4, 0, 1, 4, local_world_size=4, pipeline_parallel_size=2, tensor_parallel_size=4)


def test_pp_must_divide_the_world_and_ep_the_stage():
    with pytest.raises(LayoutError, match=r"parallel.pipeline_parallel_size \(2\) must divide the number of processes \(3\)"):
        data_parallel_coordinates(3, 0, 1, 2)
    with pytest.raises(LayoutError, match=r"parallel.pipeline_parallel_size \(4\) must divide the number of processes \(6\)"):
        build_layout(6, 0, 1, 4, local_world_size=6, pipeline_parallel_size=4)
    with pytest.raises(LayoutError, match=r"parallel.expert_parallel_size \(4\) must divide the data-parallel "
                                          r"ranks of a pipeline stage"):
        build_layout(4, 0, 4, 4, local_world_size=4, pipeline_parallel_size=2)
    assert build_layout(4, 0, "auto", 4, local_world_size=4, pipeline_parallel_size=2).expert_parallel_size == 2


def test_stage_cut_and_rank_order():
    p = ParallelConfig(pipeline_parallel_size=2)
    assert stage_first_blocks(p, 5) == [0, 3, 5]
    assert stage_first_blocks(ParallelConfig(pipeline_parallel_size=2, pipeline_schedule="interleaved"), 6) == [0, 2, 4, 5, 6]
    assert stage_first_blocks(ParallelConfig(pipeline_parallel_size=2, pipeline_stages=[0, 1]), 4) == [0, 1, 4]
    assert rank_stage_indices(1, 4, 2, "interleaved") == [1, 5]
    assert rank_stage_indices(1, 4, 2, "zero_bubble") == [1, 6]


@pytest.mark.parametrize("tied", [False, True])
def test_stage_weights_equal_the_whole_models_and_keep_their_names(tied):
    """A stage's rank keeps its modules under the whole model's names, with the whole model's
    values (the other stages' draws are made and dropped), and nothing else; with a tied head the
    last stage keeps a copy of the token embedding (not the positions)."""
    cfg = load(None, [*PP2, f"model.tie_embeddings={str(tied).lower()}"]).model
    torch.manual_seed(123)
    with torch.device("meta"):
        whole = M6Model(cfg)
    whole.materialize(torch.device("cpu"), seed=7)
    reference = dict(whole.named_parameters())
    for stage, (first, end) in enumerate([(0, 2), (2, 4)]):
        with torch.device("meta"):
            model = M6Model(cfg)
        modules = materialize_stages(model, [stage], [0, 2, 4], torch.device("cpu"), seed=7)
        names = dict(model.named_parameters())
        kept = {n for n in reference if any(n.startswith(f"blocks.{i}.") for i in range(first, end))
                or (stage == 0 and n.split(".")[0] in ("text_embed", "patch_embed", "modality"))
                or (stage == 1 and n.split(".")[0] in ("final_norm", "lm_head"))
                or (stage == 1 and tied and n == "text_embed.tokens.weight")}
        assert set(names) == kept
        for n, p in names.items():
            torch.testing.assert_close(p, reference[n], rtol=0, atol=0, msg=n)
        assert all(isinstance(model.blocks[i], StageGap) for i in range(4) if not first <= i < end)
        assert {n for n, _ in modules[0].named_parameters()} and len(modules) == 1
        assert model.tied_embedding_copy == (tied and stage == 1)


def test_a_stage_declares_its_blocks_recomputable_parts_under_the_whole_models_names():
    """The stage's recompute (memory.activation_checkpointing=full at pipeline parallel) covers its
    own blocks' parts, named as the whole model names them, and none of another stage's."""
    cfg = load(None, PP2).model
    with torch.device("meta"):
        whole, model = M6Model(cfg), M6Model(cfg)
    (stage,) = materialize_stages(model, [1], [0, 2, 4], torch.device("cpu"), seed=7)
    names = [p.name for p in stage.recomputable_parts()]
    assert names == [p.name for p in whole.recomputable_parts() if p.name.startswith(("blocks.2.", "blocks.3."))]
    assert names == ["blocks.2.attention", "blocks.2.mlp", "blocks.3.attention", "blocks.3.experts"]


def test_tensor_parallel_splits_a_stages_own_blocks_only():
    """pp x tp: a stage's rank splits its own blocks' attention and dense MLP (half the rows of
    qkv and fc_in for tp rank 1 of 2) and passes over the other stage's placeholders."""
    cfg = load(None, PP2).model
    with torch.device("meta"):
        whole, model = M6Model(cfg), M6Model(cfg)
    materialize_stages(model, [1], [0, 2, 4], torch.device("cpu"), seed=7)
    plan = apply_tensor_parallel(model, 2, 1, None)
    assert {n.split(".")[1] for n in plan.split} == {"2", "3"}
    assert "blocks.2.ffn.fc_in.weight" in plan.split and "blocks.3.attn.qkv.weight" in plan.split
    assert model.blocks[2].attn.qkv.weight.shape[0] == whole.blocks[2].attn.qkv.weight.shape[0] // 2
    assert model.blocks[2].ffn.fc_in.weight.shape[0] == whole.blocks[2].ffn.fc_in.weight.shape[0] // 2
