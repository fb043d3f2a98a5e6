"""Parallelism applied to a model from outside: the job's processes and its device mesh (the only
place m6 creates process groups), the parallel plan (Whale-style scopes: replicate by default, split
experts), building this process's share of the model, gradient sync and clipping."""

from m6.parallel.build import build_parallel
from m6.parallel.grad_sync import GradientLayoutError, GradientSync, clip_grad_norm
from m6.parallel.launch import DistEnv, init_distributed, join_job, launched_distributed
from m6.parallel.layout import LayoutError, ParallelLayout, ProcessGroups, build_layout, create_process_groups
from m6.parallel.plan import (ParallelPlan, ShardedModel, apply_plan, classify_parameters, default_plan,
                             keep_local_experts, shard_model)

__all__ = [
    "DistEnv", "GradientLayoutError", "GradientSync", "LayoutError", "ParallelLayout", "ParallelPlan", "ProcessGroups",
    "ShardedModel", "apply_plan", "build_layout", "build_parallel", "classify_parameters", "clip_grad_norm", "create_process_groups",
    "default_plan", "init_distributed", "keep_local_experts", "join_job", "launched_distributed", "shard_model",
]
