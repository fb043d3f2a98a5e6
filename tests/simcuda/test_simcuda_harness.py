"""The simulated-CUDA harness itself: a defect planted on purpose must be reported, each kind of
it, or the tests built on the harness could pass without seeing anything."""

from __future__ import annotations

import pytest

import preload
from host_sync_allow_list import ALLOW_LIST, Allowed, violations
from preload import SimulationUnavailable, scenario_result

pytestmark = pytest.mark.simcuda_group("layers")


def test_build_says_why_it_cannot_run_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-for-m6")
    monkeypatch.setenv("M6_SIMCUDA_CACHE", str(tmp_path))
    with pytest.raises(SimulationUnavailable, match="no C\\+\\+ compiler: no-such-compiler-for-m6 is not on PATH"):
        preload.build_preload()


def test_planted_defects_are_reported(simcuda):
    result = scenario_result(simcuda("layers"), "planted_defects")
    here = "tests/simcuda/scenarios.py:planted_defects"
    mix = result["device_mix"]["problems"]
    assert [(p["kind"], p["site"]) for p in mix] == [("DEVICE", here)], mix
    assert "cuda:0 and cpu" in mix[0]["detail"]
    cuda_only = result["cuda_only"]["problems"]
    assert [(p["kind"], p["site"]) for p in cuda_only] == [("META", here)], cuda_only
    assert "BF16" in cuda_only[0]["detail"]  # torch's CUDA grouped GEMM check, which the CPU kernel lacks
    syncs = result["host_sync"]["syncs"]
    assert [(s["site"], s["count"]) for s in syncs] == [("tests/simcuda/scenarios.py:planted_item", 1)], syncs
    nccl = result["nccl_host_tensor"]["problems"]
    assert [(p["kind"], p["count"]) for p in nccl] == [("NCCL_HOST", 1)], nccl  # the host tensor, not the device one
    assert result["facts"]["mirror_sum"] == [2.0, 2.0, 2.0]  # world 2, both ranks holding ones
    clean = result["facts"]["clean"]
    assert clean["problems"] == [] and clean["syncs"] == [], clean


def test_allow_list_refuses_an_unlisted_sync_and_one_too_many(simcuda):
    planted = scenario_result(simcuda("layers"), "planted_defects")["host_sync"]
    found = violations(planted, {"run": 1})
    assert len(found) == 1 and "tests/simcuda/scenarios.py:planted_item" in found[0], found
    three = {"syncs": [{"what": "tolist", "site": "m6/moe/dispatch.py:host_ints", "phase": "moe_forward",
                        "chain": "m6/moe/dispatch.py:45", "count": 3}]}
    assert violations(three, {"moe_forward": 3}) == []
    assert len(violations(three, {"moe_forward": 2})) == 1
    # A listed site in another phase is not covered: a MoE layer's sync moved into the step would show.
    in_step = {"syncs": [dict(three["syncs"][0], phase="step")]}
    assert len(violations(in_step, {"moe_forward": 3, "step": 3})) == 1
    assert all(isinstance(entry, Allowed) and entry.count > 0 and entry.why for entry in ALLOW_LIST)
