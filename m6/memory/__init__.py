"""Memory features that let a bigger model fit: recompute (activation checkpointing of the model's
declared parts: meter, planner, budget guard), CPU offload of model states, group-wise optimizer
apply, and the per-process memory estimate. Nothing here creates or looks up a process group."""

from m6.memory.activation_memory import ActivationMemory
from m6.memory.activation_meter import SavedActivationMeter
from m6.memory.estimate import COMPONENTS, MemoryReport
from m6.memory.memory_report import estimate_memory
from m6.memory.grouped_apply import GroupedApply, partition_contiguous, split_apply_groups
from m6.memory.offload import OFFLOAD_MODES, HostOffload, ParamStreamer, build_offload
from m6.memory.recompute import RecomputeMismatch, RecomputeParts, check_recompute, checkpointed
from m6.memory.recompute_guard import ActivationBudgetGuard
from m6.memory.recompute_plan import ActivationProfile, RecomputePlan, budget_bytes, choose_recompute, full_plan, \
    profile_parts

__all__ = [
    "COMPONENTS", "OFFLOAD_MODES", "ActivationBudgetGuard", "ActivationMemory", "ActivationProfile", "GroupedApply", "HostOffload",
    "MemoryReport", "ParamStreamer", "RecomputeMismatch", "RecomputeParts", "RecomputePlan", "SavedActivationMeter",
    "budget_bytes", "build_offload", "check_recompute", "checkpointed", "choose_recompute", "estimate_memory",
    "full_plan", "partition_contiguous", "profile_parts", "split_apply_groups",
]
