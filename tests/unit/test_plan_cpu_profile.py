"""m6.plan --gpu cpu: the loopback dispatcher that times an expert-parallel rank alone hands its
experts the rows AllToAllDispatcher would (under the balance assumption) and puts them back; the
profile runs at EP > 1 and with the node's ranks timed at once."""

from __future__ import annotations

import torch

from m6.config import load
from m6.moe import LocalDispatcher, MoELayer
from m6.moe.loopback import LoopbackDispatcher
from m6.plan.timing import HostProfile

TINY = ["data.kind=synthetic", "data.sources=[]", "data.seq_len=16", "model.max_text_len=16", "model.image_size=16",
        "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.moe.every=1",
        "model.moe.num_experts=4", "model.moe.capacity_factor=null", "train.global_batch_size=4"]


def test_loopback_regroups_rows_by_local_expert_and_restores_them():
    torch.manual_seed(0)
    layer = MoELayer(d_model=8, ffn_dim=16, num_experts=4, top_k=2)
    x_TD = torch.randn(10, 8, dtype=torch.float64)
    plan = layer.dispatch_plan(layer.router(x_TD.float()), None, 10)
    rows_ND, splits_E, kept = LocalDispatcher().dispatch(x_TD, plan)
    by_expert = list(rows_ND.split(splits_E))
    loop = LoopbackDispatcher(num_experts=4, expert_parallel_size=2, a2a_dtype=None)
    x_local, splits, handle = loop.dispatch(x_TD, plan)
    # Rank r of the group sends expert r*L + l's rows to local expert l: [e0, e2] then [e1, e3].
    assert splits == [splits_E[0] + splits_E[2], splits_E[1] + splits_E[3]]
    torch.testing.assert_close(x_local, torch.cat([by_expert[0], by_expert[2], by_expert[1], by_expert[3]]))
    # Identity experts: the combine equals the local dispatcher's.
    torch.testing.assert_close(loop.combine(x_local * 3, handle, x_TD.dtype),
                               LocalDispatcher().combine(rows_ND * 3, kept, x_TD.dtype))


def test_cpu_profile_runs_an_expert_parallel_rank_alone_and_with_its_node():
    cfg = load(None, TINY)
    alone = HostProfile(threads=1).forward_backward_s(cfg, 2, 2, 2, frozenset())
    together = HostProfile(threads=1, concurrent=2).forward_backward_s(cfg, 2, 2, 2, frozenset({"blocks.0.attention"}))
    assert alone > 0 and together > 0


def test_profiled_rank_waits_where_the_runs_collectives_make_ranks_wait():
    from m6.plan.timing import _profile_model, _time_rank_steps, _densest_inputs
    cfg = load(None, TINY)
    calls = []
    model = _profile_model(cfg, 2, 2, frozenset({"blocks.0.experts"}), sync=lambda: calls.append(1))
    _time_rank_steps(model, _densest_inputs(cfg, 2), runs=1, sync=lambda: calls.append(1))
    # Per MoE layer (2) and step: routing statistics, counts and payload exchange in dispatch, the
    # payload's way back in combine, both payloads again in backward (6); the step's start and
    # its end. Recompute (blocks.0.experts) re-runs no exchange. Two steps (one warm-up, one timed).
    assert len(calls) == 2 * (2 * 6 + 2)


def test_profiled_sharded_rank_waits_at_every_fsdp_unit():
    """parallel.shard: the ranks also wait at each FSDP2 unit's gathers and reduce-scatters."""
    from m6.plan.timing import _profile_model, _time_rank_steps, _densest_inputs
    cfg = load(None, [*TINY, "parallel.shard=full"])
    calls = []
    model = _profile_model(cfg, 2, 2, frozenset({"blocks.0.experts"}), sync=lambda: calls.append(1))
    _time_rank_steps(model, _densest_inputs(cfg, 2), runs=1, sync=lambda: calls.append(1))
    # On top of the unsharded waits (above): per unit (2 blocks, 2 MoE layers' experts) one before
    # its forward and one as its backward begins; the recomputed experts' second forward none.
    assert len(calls) == 2 * (2 * 6 + 2 + 2 * 4)


def test_profiled_sharded_rank_updates_with_sharded_adafactor():
    """parallel.shard with optim.name=adafactor: the profile (its own process, a one-rank group,
    FSDP2's units) steps the run's exact sharded form (torch's foreach Adafactor cannot step
    FSDP2's DTensor shards: the profile would fail)."""
    cfg = load(None, [*TINY, "parallel.shard=full", "optim.name=adafactor"])
    assert HostProfile(threads=1).update_s(cfg, 2, 2, 2, frozenset()) > 0
