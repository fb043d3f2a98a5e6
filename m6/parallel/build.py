"""build_parallel: the M6 model of this process, built on ``meta``, split by the parallel plan,
then materialised, so no process ever allocates the experts it does not hold."""

from __future__ import annotations

import torch

from m6.config import Config, fsdp_shards, pipeline_stages_per_rank
from m6.model import M6Model
from m6.parallel.compile import compile_blocks
from m6.parallel.fsdp import apply_sharding
from m6.parallel.launch import DistEnv
from m6.parallel.layout import LayoutError, build_layout, create_process_groups
from m6.parallel.node_groups import check_node_aware_dispatch, check_node_groups
from m6.parallel.pipeline import materialize_stages, rank_stage_indices, stage_first_blocks
from m6.parallel.plan import ShardedModel, classify_parameters, default_plan, shard_model
from m6.parallel.sequence_parallel import apply_sequence_parallel
from m6.parallel.tensor_parallel import apply_tensor_parallel
from m6.parallel.tp_regions import SequenceShape
from m6.parallel.tp_rng import fork_split_region_dropout


def build_parallel(cfg: Config, device: torch.device, env: DistEnv,
                   init_device: torch.device | None = None, param_dtype: torch.dtype | None = None) -> ShardedModel:
    """This process's share of the model for ``cfg`` on the job ``env`` (one process: the trivial
    layout, every expert local, nothing to communicate).

    Same seed everywhere: replicated weights come out identical on every rank, and every
    expert's weights depend only on (seed, layer, global expert id), not on the layout.
    ``init_device``: where the weights are first allocated (default ``device``; CPU offload of
    the parameters initialises them on the host so the device never holds the whole model).
    With parallel.shard optimizer or full the materialised model is then cut into FSDP2 units
    (m6.parallel.fsdp) whose parameters are gathered in ``param_dtype`` (None: as stored).
    With train.compile=blocks each block's dense parts are compiled first (m6.parallel.compile).
    With parallel.pipeline_parallel_size > 1 the rank keeps its pipeline stages' modules only
    (m6.parallel.pipeline; ``ShardedModel.stages`` holds one module per stage it runs).
    """
    m = cfg.model
    with torch.device("meta"):
        model = M6Model(m)
    # parallel.balance as weights also sizes each expert-parallel rank's range of experts (auto at
    # expert parallelism arrives here as the measured speeds: m6.parallel.speed_probe).
    weights = cfg.parallel.balance if isinstance(cfg.parallel.balance, list) else None
    layout = build_layout(env.world_size, env.rank, cfg.parallel.expert_parallel_size, m.moe.num_experts,
                          env.local_world_size, rank_weights=weights,
                          tensor_parallel_size=cfg.parallel.tensor_parallel_size,
                          pipeline_parallel_size=cfg.parallel.pipeline_parallel_size)
    check_node_groups(layout, m.moe.node_groups, m.moe.max_nodes_per_token)  # before any collective
    check_node_aware_dispatch(layout, m.moe.a2a_dispatch)
    if layout.uneven_experts and cfg.parallel.shard != "none":
        raise LayoutError(f"parallel.shard={cfg.parallel.shard} with uneven experts per rank (parallel.balance="
                          f"{cfg.parallel.balance} at parallel.expert_parallel_size={layout.expert_parallel_size}) "
                          f"is not supported: use parallel.shard=none or parallel.balance=even")
    if layout.uneven_experts and m.moe.a2a_overlap_degree != 1 and m.moe.a2a_dispatch == "flat":
        raise LayoutError(f"model.moe.a2a_overlap_degree={m.moe.a2a_overlap_degree} with uneven experts per rank "
                          f"(parallel.balance={cfg.parallel.balance} at parallel.expert_parallel_size="
                          f"{layout.expert_parallel_size}): the chunked exchange needs the same experts on every "
                          f"rank; use model.moe.a2a_overlap_degree=1, model.moe.a2a_dispatch=node_aware or "
                          f"parallel.balance=even")
    p = cfg.parallel
    # Tied head at pipeline parallel: the pipeline position of the last stage (V order: the first rank's).
    tied_last_stage = None if layout.pipeline_parallel_size == 1 or not m.tie_embeddings else (
        0 if p.pipeline_schedule == "zero_bubble" else layout.pipeline_parallel_size - 1)
    groups = create_process_groups(layout, p.timeout_s, node_aware=m.moe.a2a_dispatch == "node_aware",
                                   tied_last_stage=tied_last_stage)
    plan = default_plan(model)
    a2a_dtype = torch.bfloat16 if m.moe.a2a_dtype == "bf16" else None
    shard_model(model, plan, groups, a2a_dtype, m.moe.aux_loss_scope, m.moe.a2a_overlap_degree, m.moe.a2a_dispatch)
    stages = []
    if layout.pipeline_parallel_size > 1:  # this rank's stages only, each weight as the whole model draws it
        stages = materialize_stages(model, rank_stage_indices(layout.pp_rank, p.pipeline_parallel_size,
                                                              pipeline_stages_per_rank(p), p.pipeline_schedule),
                                    stage_first_blocks(p, m.num_layers), init_device or device, cfg.run.seed)
    else:
        model.materialize(init_device or device, cfg.run.seed)
    # Tensor parallel: whole weights first (the same on every rank, from the seed), then each tp
    # rank keeps its heads' and FFN columns' share (m6.parallel.tensor_parallel).
    sequence = SequenceShape() if cfg.parallel.sequence_parallel and layout.tensor_parallel_size > 1 else None
    tp = apply_tensor_parallel(model, layout.tensor_parallel_size, layout.tp_rank, groups.tensor_mesh, sequence)
    if sequence is not None:
        apply_sequence_parallel(model, groups.tensor_mesh, sequence)
    if layout.tensor_parallel_size > 1 and m.dropout > 0:  # per-rank masks off the shared stream (m6.parallel.tp_rng)
        fork_split_region_dropout(model, layout.tp_rank, sequence is not None)
    if cfg.train.compile == "blocks":
        # Before FSDP2 wraps the blocks (as torchtitan compiles each block before fully_shard); the
        # recompute wrappers come later and wrap the compiled regions (m6.parallel.compile).
        compile_blocks(model)
    sharded = classify_parameters(model, plan, groups)
    sharded.tensor_split = tp.split
    sharded.stages = stages
    if fsdp_shards(cfg):  # memory.offload=zero partitions its own states (m6.memory.zero_partition)
        apply_sharding(sharded, cfg.parallel.shard, param_dtype, offload=cfg.memory.offload != "none")
    return sharded
