"""Mixture-of-Experts: router -> dispatch -> experts -> combine."""

from m6.moe.dispatch import Dispatcher, DispatchPlan, LocalDispatcher, expert_capacity, plan_dispatch
from m6.moe.experts import GroupedExperts
from m6.moe.layer import MoELayer, MoEStats
from m6.moe.router import Routing, TopKRouter

__all__ = [
    "Dispatcher", "DispatchPlan", "GroupedExperts", "LocalDispatcher", "MoELayer", "MoEStats", "Routing",
    "TopKRouter", "expert_capacity", "plan_dispatch",
]
