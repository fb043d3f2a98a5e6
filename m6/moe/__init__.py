"""Mixture-of-Experts: router -> dispatch -> experts -> combine."""

from m6.moe.dispatch import Dispatcher, DispatchPlan, LocalDispatcher, expert_capacity, plan_dispatch
from m6.moe.experts import GroupedExperts
from m6.moe.layer import MoELayer, MoEStats
from m6.moe.router import Routing, TopKRouter
from m6.moe.routing_stats import GlobalRoutingStats, LocalRoutingStats, RoutingStatsReducer

__all__ = [
    "Dispatcher", "DispatchPlan", "GlobalRoutingStats", "GroupedExperts", "LocalDispatcher",
    "LocalRoutingStats", "MoELayer", "MoEStats", "Routing", "RoutingStatsReducer", "TopKRouter",
    "expert_capacity", "plan_dispatch",
]
