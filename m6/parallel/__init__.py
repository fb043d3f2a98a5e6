"""Parallelism applied to a model from outside: layout and process groups, Whale-style scopes
(replicate by default, split experts), gradient sync, and layout-free checkpoint state."""

from m6.parallel.grad_sync import GradientSync, clip_grad_norm
from m6.parallel.launch import DistEnv, init_distributed, launched_distributed
from m6.parallel.offload import HostOffload, ParamStreamer, build_offload
from m6.parallel.optimizer_apply import GroupedApply, partition_contiguous, split_apply_groups
from m6.parallel.layout import LayoutError, ParallelLayout, ProcessGroups, build_layout, create_process_groups
from m6.parallel.plan import (ParallelPlan, ShardedModel, apply_plan, classify_parameters, default_plan,
                              shard_model)

__all__ = [
    "DistEnv", "GradientSync", "LayoutError", "ParallelLayout", "ParallelPlan",
    "ProcessGroups", "ShardedModel", "apply_plan", "classify_parameters", "shard_model", "build_layout", "clip_grad_norm", "create_process_groups",
    "default_plan", "init_distributed", "launched_distributed",
    "GroupedApply", "HostOffload", "ParamStreamer", "build_offload", "partition_contiguous", "split_apply_groups",
]
