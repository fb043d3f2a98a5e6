"""Short Trainer runs of configs/tiny.yaml on simulated cuda:0 (two steps, one logging step, one
evaluation, one checkpoint): fp32, bf16 (with accumulation), autocast, CPU offload of the optimizer
and of optimizer+params (each also with the delayed update), ZeRO-Offload's layout (memory.offload=zero,
resident, streamed-delayed, and streamed with the gradients landing in the blocks' homes; partitioned at world 2), the delayed update with 16-bit host gradients (fp16 optimizer, bf16 zero), full recompute, and expert parallelism
at world 2 and 4 in a mirror world.
Each must run without a device mix, a CUDA-only constraint broken, a collective breaking NCCL's
rules, or a host sync the allow-list (host_sync_allow_list.py) does not document."""

from __future__ import annotations

import math

import pytest

from host_sync_allow_list import ALLOW_LIST, DROPLESS_SINGLE_GPU_ALLOW_LIST, per_event_table, sync_totals, unused, violations
from preload import scenario_result

GROUPS = {"trainer_precision": ["fp32", "bf16-accumulate", "bf16-autocast", "dropless-grouped_mm", "bf16-weight-copy"],
          "trainer_memory": ["offload-optimizer", "offload-optimizer+params", "recompute-full",
                             "offload-optimizer-delayed", "offload-optimizer+params-delayed", "offload-zero",
                             "offload-zero-streamed-delayed", "offload-zero-streamed-home",
                             "offload-optimizer-delayed-half", "offload-zero-delayed-half"],
          "expert_parallel": ["ep-world2", "ep-world4", "zero-partitioned-world2"]}
RUNS = [(group, name) for group, names in GROUPS.items() for name in names]
pytestmark = [pytest.mark.simcuda_group(group) for group in GROUPS]


def _run(simcuda, group: str, name: str) -> dict:
    return scenario_result(simcuda(group), name)


@pytest.mark.parametrize("group, name", RUNS, ids=[name for _, name in RUNS])
def test_trainer_run_is_clean_on_simulated_cuda(simcuda, group, name):
    run = _run(simcuda, group, name)
    facts, findings, events = run["facts"], run["findings"], run["events"]
    assert findings["problems"] == [], findings["problems"]
    assert findings["unchecked_ops"] == {}, findings["unchecked_ops"]  # every op was replayed on fake tensors
    allow_list = DROPLESS_SINGLE_GPU_ALLOW_LIST if name == "dropless-grouped_mm" else ALLOW_LIST
    assert violations(findings, events, allow_list) == []
    assert len(facts["losses"]) == 2 and all(math.isfinite(loss) for loss in facts["losses"]), facts
    if name == "fp32":  # resumed from its checkpoint for a third step
        assert len(facts["resumed_losses"]) == 1 and math.isfinite(facts["resumed_losses"][0]), facts
        # torch's fused AdamW (the default on CUDA) needs its step counts beside the parameters; a
        # resume that loaded them into host tensors crashed the first step on a real GPU.
        assert facts["step_count_devices"] == ["cuda"], facts
        assert facts["checkpoints"] == ["step_00000002", "step_00000003"]
        counts = (3, 2, 2, 2, 1, 2)
    else:
        assert facts["checkpoints"] == ["step_00000002"]
        counts = (2, 1, 1, 1, 0, 1)
    assert tuple(events.get(phase, 0) for phase in ("step", "logging_step", "eval", "save", "resume", "run")) == counts
    # optimizer+params keeps the blocks' weights on the host between their uses (zero here: blocks 0 and 2, 24 params).
    streamed = {"offload-optimizer+params": facts["params"] - 9, "offload-optimizer+params-delayed": facts["params"] - 9,
                "offload-zero-streamed-delayed": 24, "offload-zero-streamed-home": 24}.get(name, 0)
    assert facts["params_on_device"] == facts["params"] - streamed, facts
    if name.startswith(("offload-zero", "zero-partitioned")):  # 16-bit weights; the masters cast into pinned staging
        assert facts["weight_dtypes"] == ["torch.bfloat16", "torch.float32"], facts  # the routers' gates fp32
        assert facts["staging_pinned"] == [True, True], facts  # two buffers, allocated before the first copy back


def test_simulated_run_computes_what_the_cpu_computes(simcuda):
    """The simulation runs the real math on the data. Not bitwise: on a cuda tensor torch's
    scaled_dot_product_attention takes its math decomposition, on the CPU its fused CPU kernel
    (float32 rounding apart, ~1e-7)."""
    report = simcuda("trainer_precision")
    simulated = scenario_result(report, "fp32")["facts"]["losses"]
    assert simulated == pytest.approx(scenario_result(report, "fp32-cpu")["facts"]["losses"], rel=1e-6, abs=0)


def test_offload_waits_for_the_gradients_once_per_step(simcuda):
    """The gradient copies to the host run in order on one stream: the step waits for the last one,
    not for each parameter's (55 waits per step before)."""
    for name in ("offload-optimizer", "offload-optimizer+params", "offload-optimizer-delayed",
                 "offload-optimizer+params-delayed", "offload-zero", "offload-zero-streamed-delayed",
                 "offload-zero-streamed-home", "offload-optimizer-delayed-half", "offload-zero-delayed-half"):
        run = _run(simcuda, "trainer_memory", name)
        totals = sync_totals(run["findings"])
        assert totals[("m6/memory/offload.py:finish_backward", "step")] == run["events"]["step"], (name, totals)


def test_streamed_gradients_land_in_their_homes_after_the_homes_last_fetch(simcuda):
    """memory.zero_grad_landing (auto: home here): each streamed bf16 weight's host home is fetched
    to the device for the forward and for the backward of both micro-batches, then receives the
    step's gradient, on the same copy stream as those fetches (a stream runs its copies in issue
    order: the last fetch has completed before the gradient overwrites the home), then the update
    casts the new master into it before anything fetches it again. Nothing else touches a home."""
    run = _run(simcuda, "trainer_memory", "offload-zero-streamed-home")
    copies, steps = run["facts"]["home_copies"], run["events"]["step"]
    assert copies and steps == 2
    for name, events in copies.items():
        rest = events
        for _ in range(steps):
            write = next(i for i, e in enumerate(rest) if e.startswith("write device"))
            stream = rest[write].split("@")[1]
            assert rest[:write] == [f"read device @{stream}"] * 4, (name, events)  # 2 micro-batches x (fwd, bwd)
            assert rest[write + 1] == "write host", (name, events)  # the update's cast, before the next fetch
            rest = rest[write + 2:]
        assert all(e.startswith("read device") for e in rest), (name, events)  # the final evaluation's fetches


def test_logging_step_reads_routing_statistics_once(simcuda):
    """Every MoE layer's statistics in one transfer (six reads per MoE layer before)."""
    for group, name in RUNS:
        run = _run(simcuda, group, name)
        logging = {site: n for (site, phase), n in sync_totals(run["findings"]).items() if phase == "logging_step"}
        assert logging == {"m6/train/metrics.py:expert_load": run["events"]["logging_step"]}, (name, logging)


def test_expert_parallel_collectives_run_on_the_groups_they_should(simcuda):
    """The all-to-all and the gradient all-reduce on NCCL (device tensors: the problems above are
    empty), checkpoint coordination on the gloo group; backward's all-to-all on autograd's thread."""
    for name in ("ep-world2", "ep-world4"):
        calls = _run(simcuda, "expert_parallel", name)["facts"]["collectives"]
        assert calls.get("MainThread nccl all_to_all_single", 0) > 0 and calls.get("MainThread nccl all_reduce", 0) > 0
        assert any(key.endswith("nccl all_to_all_single") and not key.startswith("MainThread") for key in calls), calls
        assert calls.get("MainThread gloo gather_object", 0) > 0 and not any(
            key.split()[1] == "nccl" and "object" in key.split()[2] and "all_gather" not in key for key in calls), calls


def test_partitioned_zero_collectives_run_on_nccl_from_the_training_thread(simcuda):
    """The partitioned zero's reduce-scatters (backward: autograd's device thread, as the all-reduces)
    and all-gathers (the training thread, never the delayed update's or the copy-back's) on NCCL with
    device tensors (no problem above), and no all-reduce of the gradients."""
    calls = _run(simcuda, "expert_parallel", "zero-partitioned-world2")["facts"]["collectives"]
    scatters = {k: n for k, n in calls.items() if k.endswith("nccl reduce_scatter_tensor")}
    assert scatters and all(not k.startswith(("m6-", "ThreadPool")) for k in scatters), calls
    assert calls.get("MainThread nccl all_gather_into_tensor", 0) > 0, calls
    assert not any(k.endswith("all_gather_into_tensor") and not k.startswith("MainThread") for k in calls), calls


def test_dropless_single_gpu_moe_layers_make_no_host_sync(simcuda):
    """Dropless, one GPU, grouped_mm: the training step's MoE forwards (and their backward) read
    nothing back; a host sync that comes back in dispatch or the experts fails here."""
    run = _run(simcuda, "trainer_precision", "dropless-grouped_mm")
    assert run["events"]["moe_forward in step"] > 0
    moe = {key: n for key, n in sync_totals(run["findings"]).items()
           if key[0].startswith("m6/moe/") and key[1] in ("moe_forward", "step")}
    assert moe == {}, moe


def test_weight_copy_per_step_adds_no_host_sync(simcuda):
    """train.weight_copy=per_step: the copy after the update, the gradient hook and the masters'
    all-reduce-free clip make exactly the host syncs of cast-on-use with the same accumulation."""
    per_step = sync_totals(_run(simcuda, "trainer_precision", "bf16-weight-copy")["findings"])
    per_use = sync_totals(_run(simcuda, "trainer_precision", "bf16-accumulate")["findings"])
    assert per_step == per_use


def test_allow_list_entries_are_all_needed(simcuda):
    runs = [_run(simcuda, group, name) for group, name in RUNS]
    assert unused(runs) == []


def test_host_sync_counts_per_event(simcuda, capsys):
    """The table docs/simulated-cuda.md shows (run with -s to see it)."""
    table = per_event_table({name: _run(simcuda, group, name) for group, name in RUNS})
    with capsys.disabled():
        print("\nhost syncs per event, measured on simulated CUDA (configs/tiny.yaml):\n" + table)
    assert "| fp32 | 2 | 1 |" in table  # two MoE forwards per step, one host sync each


def test_zero_block_waits_for_its_own_copy_back_only(simcuda):
    """memory.offload=zero: after an update's copy back, the forward of the model (the weights
    outside the blocks) and of each block makes the compute stream wait for that segment's event
    and no other (block i + 1's copy still runs while block i computes); a forward with nothing
    copied back since waits for nothing. The copy-back thread adds no host sync (the allow-list)."""
    result = scenario_result(simcuda("trainer_memory"), "zero_copy_back_waits")
    for name, run in result.items():
        assert run["findings"]["problems"] == [], (name, run["findings"]["problems"])
        assert violations(run["findings"], run["events"]) == [], name
        forwards, segments = run["facts"]["forwards"], run["facts"]["segments"]
        # Training forwards: 3 steps x 2 micro-batches x (model + blocks); the evaluation's after them.
        by_step: dict[int, list[dict]] = {}
        for f in forwards:
            by_step.setdefault(f["step"], []).append(f)
        # Which steps' forwards run on copied-back weights: the synchronous update's from step 2;
        # delayed from step 1, step 2 runs on the initial weights, step 3 on step 1's update's.
        copied = {"sync": {1, 2}, "delayed": {2}}[name]
        assert sorted(by_step)[:3] == [0, 1, 2], (name, sorted(by_step))
        for step, fs in sorted(by_step.items())[:3]:  # the training steps (an evaluation may follow)
            first = fs[:segments]
            assert [f["segment"] for f in first] == list(range(segments)), (name, step)
            if step in copied:
                assert all(f["own"] == [True] for f in first), (name, step, first)
            else:
                assert all(f["waited"] == 0 for f in first), (name, step, first)
            assert all(f["waited"] == 0 for f in fs[segments:]), (name, step)  # the second micro-batch: no wait
