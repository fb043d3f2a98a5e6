"""The host-side cut of an expert-parallel exchange into chunks (m6.moe.chunked_all_to_all): every
row goes in exactly one chunk, what a rank sends in chunk c is what its peer expects in chunk c,
and the auto degree rule."""

from __future__ import annotations

import random

import pytest
import torch

from m6.config import ConfigError, MoEConfig
from m6.moe.chunked_all_to_all import (AUTO_CHUNK_BYTES, AUTO_MAX_DEGREE, auto_overlap_degree, chunk_bounds,
                                       chunk_counts, chunk_cuts, chunk_major_order, chunk_of, plan_chunks)
from m6.moe.dispatch import group_received, ungroup


def test_chunk_bounds_cover_the_segment_in_near_equal_parts():
    assert chunk_bounds(10, 4) == [0, 2, 5, 7, 10]
    assert chunk_bounds(0, 3) == [0, 0, 0, 0]
    assert chunk_bounds(2, 4) == [0, 0, 1, 1, 2]  # more parts than rows: empty parts


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_device_cut_is_the_host_cut(degree):
    """chunk_cuts / chunk_of (device, every segment at once) cut as chunk_bounds does on the host."""
    rows_S = torch.tensor([0, 1, 2, 5, 10])
    cuts = chunk_cuts(rows_S, degree)
    assert cuts.tolist() == [chunk_bounds(n, degree) for n in rows_S.tolist()]
    seg_N = torch.repeat_interleave(torch.arange(5), rows_S)
    pos_N = torch.cat([torch.arange(n) for n in rows_S.tolist()])
    want = [c for n in rows_S.tolist() for c in range(degree)
            for _ in range(chunk_bounds(n, degree)[c], chunk_bounds(n, degree)[c + 1])]
    assert chunk_of(cuts, seg_N, pos_N).tolist() == want


def test_receiver_grouping_and_its_inverse():
    """Rows arriving [source][local expert] come out grouped by local expert (source order kept inside
    an expert), cast to the compute dtype; ungroup puts outputs back in arrival order, in the wire dtype."""
    counts_SL = torch.tensor([[2, 1], [0, 2]])  # source 0: 2 rows for expert 0, 1 for 1; source 1: 2 for 1
    x = torch.tensor([[0.], [1.], [2.], [3.], [4.]], dtype=torch.bfloat16)  # arrival: e0 e0 e1 | e1 e1
    x_local, order = group_received(x, counts_SL, torch.float32)
    assert x_local.dtype == torch.float32 and x_local.flatten().tolist() == [0, 1, 2, 3, 4]
    x = torch.tensor([[0.], [1.], [2.], [3.]])  # source 0: e0 e1 | source 1: e0 e1
    x_local, order = group_received(x, torch.tensor([[1, 1], [1, 1]]), None)
    assert x_local.flatten().tolist() == [0, 2, 1, 3] and x_local.dtype == torch.float32
    back = ungroup(x_local * 10, order, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back.flatten().tolist() == [0, 10, 20, 30]


@pytest.mark.parametrize("seed", range(5))
def test_chunks_agree_between_sender_and_receiver(seed):
    rng = random.Random(seed)
    R, L, C = rng.choice([2, 3, 4]), rng.choice([1, 2, 3]), rng.choice([2, 3, 5])
    # counts[s][r*L + l]: rows rank s sends to local expert l of rank r (zeros included).
    counts = [[rng.choice([0, 0, 1, 4, 9]) for _ in range(R * L)] for _ in range(R)]
    plans = []
    for me in range(R):
        recv = [n for s in range(R) for n in counts[s][me * L:(me + 1) * L]]
        plans.append(plan_chunks(counts[me], recv, R, L, C))
    for me, plan in enumerate(plans):
        assert plan.degree == C
        # The device-side reorder: chunk-major, each row once, against a slow reference.
        order = chunk_major_order(torch.tensor(counts[me]).view(R, L), C, sum(counts[me])).tolist()
        assert order == _chunk_major_reference(counts[me], R, L, C)
        recv_RL = torch.tensor([n for s in range(R) for n in counts[s][me * L:(me + 1) * L]]).view(R, L)
        for c in range(C):
            for r in range(R):
                assert plan.send[c][r] == plans[r].recv[c][me]  # the exchange's splits match
                # the rows of chunk c that me sends to r are r's expert counts for chunk c from me
                assert plans[r].recv_counts[c][me * L:(me + 1) * L] == _expert_counts_of_part(
                    counts[me][r * L:(r + 1) * L], c, C)
            assert chunk_counts(recv_RL, C, c).reshape(-1).tolist() == plan.recv_counts[c]
            assert plan.local_experts[c] == [sum(plan.recv_counts[c][s * L + e] for s in range(R)) for e in range(L)]
        assert [sum(plan.local_experts[c][e] for c in range(C)) for e in range(L)] == \
            [sum(counts[s][me * L + e] for s in range(R)) for e in range(L)]


def _expert_counts_of_part(expert_counts, c, C):
    """Slow reference: label every row of the segment with its expert, take part c."""
    labels = [e for e, n in enumerate(expert_counts) for _ in range(n)]
    lo, hi = chunk_bounds(len(labels), C)[c:c + 2]
    return [labels[lo:hi].count(e) for e in range(len(expert_counts))]


def _chunk_major_reference(send_RL, R, L, C):
    """Rows grouped by destination rank, listed chunk by chunk (part c of every rank's segment)."""
    segs = [sum(send_RL[r * L:(r + 1) * L]) for r in range(R)]
    starts = [sum(segs[:r]) for r in range(R)]
    return [starts[r] + i for c in range(C) for r in range(R)
            for i in range(chunk_bounds(segs[r], C)[c], chunk_bounds(segs[r], C)[c + 1])]


def test_auto_degree_rule():
    assert auto_overlap_degree(0, 4096) == 1
    assert auto_overlap_degree(AUTO_CHUNK_BYTES // 4096 - 1, 4096) == 1
    assert auto_overlap_degree(2 * AUTO_CHUNK_BYTES // 4096, 4096) == 2
    assert auto_overlap_degree(10**9, 4096) == AUTO_MAX_DEGREE


@pytest.mark.parametrize("bad", [0, -1, "two", True, 1.5])
def test_config_rejects_a_bad_overlap_degree(bad):
    with pytest.raises(ConfigError, match="model.moe.a2a_overlap_degree"):
        MoEConfig(a2a_overlap_degree=bad).validate()
    MoEConfig(a2a_overlap_degree="auto").validate()
    MoEConfig(a2a_overlap_degree=4).validate()
