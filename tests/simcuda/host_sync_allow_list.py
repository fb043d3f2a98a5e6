"""The documented host syncs of m6 on CUDA: where each may happen, how many per event, and why.

A host sync stalls the training thread until the device has finished everything queued before it
(the device then idles while the host catches up). Each entry allows at most ``count`` syncs at
``site`` (the innermost m6 frame, "file:function") per event of ``phase`` (tests/simcuda/run_phases.py:
per MoE layer forward, per training step, per logging step, per save, per evaluation; once per
recompute plan, per resume and per run for start-up work). Everything else a simulated run finds
is a failure.

Counts of the start-up phases (run, recompute plan), and those that scale with the number of tensors
(save, resume), are those of configs/tiny.yaml (2 MoE layers of 8 experts) at world size 1; the
others do not depend on the config. docs/simulated-cuda.md shows this
table and the counts a test measured.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Allowed:
    site: str
    phase: str
    count: int
    why: str


ALLOW_LIST = (
    # ---- per MoE layer forward ------------------------------------------------------------------
    Allowed("m6/moe/dispatch.py:host_ints", "moe_forward", 1,
            "the split sizes (rows per expert, and per rank under expert parallelism) in one read: the "
            "loop of expert GEMMs, the capacity limit's kept count and the all-to-all take them as host "
            "ints (not made by a dropless layer on one GPU with grouped_mm or fused: "
            "DROPLESS_SINGLE_GPU_ALLOW_LIST)"),
    # ---- per training step ----------------------------------------------------------------------
    Allowed("m6/train/step_scalars.py:read", "step", 1, "the step's loss terms and kept assignments in one read"),
    Allowed("m6/train/compute_timer.py:end_step", "step", 2,
            "torch.cuda.synchronize before reading the clock for step_time_s; the compute events' elapsed "
            "time, read after it (complete by then: no wait on a GPU; the simulation counts every elapsed_time)"),
    Allowed("m6/parallel/grad_sync.py:global_grad_norm", "step", 1,
            "the global gradient norm read on the host: a non-finite step is skipped there, and the "
            "norm is the step's grad_norm metric"),
    Allowed("m6/parallel/grad_sync.py:_group_sum_sq", "step", 1,
            "offloaded gradients at world > 1 summed over a group (the partitioned zero's chunks over the "
            "world): the host's sum of squares copied to the device for NCCL, read back by "
            "global_grad_norm right after"),
    Allowed("m6/memory/offload.py:finish_backward", "step", 1,
            "memory.offload: the host update needs every gradient on the host; one wait for the last copy "
            "(the copy stream runs them in order)"),
    Allowed("m6/memory/delayed_update.py:run", "step", 1,
            "optim.delayed_update: the background update waits, on its own thread (the training thread "
            "goes on), for the copy of the masters to the device that the step before started, before it "
            "changes them"),
    Allowed("m6/parallel/grad_sync.py:prepare", "step", 2,
            "world > 1: whether every rank's graph reaches the same parameters (a small all-reduce, its "
            "input copied in and its result read)"),
    Allowed("m6/train/loop.py:all_reduce_sum", "step", 4,
            "world > 1: host scalars summed over ranks on the device for NCCL (the step's target count; "
            "its loss, FLOPs, tokens and skips): each a copy in and a read back"),
    # ---- per logging step -----------------------------------------------------------------------
    Allowed("m6/train/metrics.py:expert_load", "logging_step", 1,
            "every MoE layer's routing statistics in one read"),
    # ---- per evaluation -------------------------------------------------------------------------
    Allowed("m6/train/eval.py:evaluate_captions", "eval", 1, "the evaluation's losses in one read"),
    Allowed("m6/train/loop.py:all_reduce_sum", "eval", 2, "world > 1: the losses and count summed over ranks"),
    # ---- per save -------------------------------------------------------------------------------
    Allowed("m6/checkpoint/staging.py:stage", "save", 1,
            "the device-to-host copies into the page-locked staging buffer waited for once, before the "
            "training thread may change the state again"),
    Allowed("m6/train/loop.py:all_reduce_sum", "save", 2, "world > 1: skipped-record counts summed over ranks"),
    # ---- per resume -----------------------------------------------------------------------------
    Allowed("m6/checkpoint/sharded_io.py:read", "resume", 220,
            "DCP's load copies each tensor read from the files into its device target with a blocking "
            "copy (tiny config, fp32: 55 parameters, 110 AdamW moments and the fused AdamW's 55 step "
            "counts, which live beside their parameters); once per resume"),
    # ---- once: start-up, the end of fit, the recompute plan ---------------------------------------
    Allowed("m6/moe/experts.py:reset_parameters", "run", 32,
            "initialisation: each expert's weights are drawn on the host from its own generator (the same "
            "at any layout) and copied in: 2 weights x 8 experts x 2 layers"),
    Allowed("m6/model/host_drawn_init.py:__torch_function__", "run", 57,
            "initialisation: every random fill of a replicated weight is drawn on the host from the run's "
            "generator (the same model on any device) and copied in: 57 fills in tiny"),
    Allowed("m6/memory/offload.py:_host_copy", "run", 55, "memory.offload: the host master of each parameter"),
    Allowed("m6/memory/offload.py:__init__", "run", 55,
            "memory.offload=optimizer+params or zero: the parameters that are not streamed move to the device "
            "(optimizer+params: 9; zero, every block resident: all 55, as 16-bit weights)"),
    Allowed("m6/train/loop.py:all_reduce_sum", "run", 2, "world > 1: the run summary's skipped records by reason"),
    Allowed("m6/memory/recompute_plan.py:_sync", "recompute_plan", 32,
            "memory.activation_checkpointing: profiling times each recomputable part on the device (tiny: "
            "8 parts, 4 syncs each)"),
    Allowed("m6/moe/dispatch.py:host_ints", "recompute_plan", 2, "the profiled forward's MoE layers"),
)


# Dropless MoE layers whose experts are all in this process, on grouped_mm or the fused kernels: the
# host knows each layer's row count (T*K, padding dispatched with weight 0) and the kernels take the
# rows per expert on the device, so the MoE layers make no host sync at all (m6/moe/dispatch.py).
DROPLESS_SINGLE_GPU_ALLOW_LIST = tuple(entry for entry in ALLOW_LIST
                                       if entry.site != "m6/moe/dispatch.py:host_ints")


def sync_totals(findings: dict) -> Counter:
    """(site, phase) -> host syncs of one run (a scenario's ``findings`` as the report has them)."""
    totals: Counter = Counter()
    for sync in findings["syncs"]:
        totals[(sync["site"], sync["phase"])] += sync["count"]
    return totals


def violations(findings: dict, events: dict, allow_list=ALLOW_LIST) -> list[str]:
    """Every (site, phase) whose syncs the allow-list does not cover, for one run with these ``events``."""
    allowed: Counter = Counter()
    for entry in allow_list:
        allowed[(entry.site, entry.phase)] += entry.count * events.get(entry.phase, 0)
    out = []
    for (site, phase), n in sorted(sync_totals(findings).items()):
        if n > allowed[(site, phase)]:
            chains = sorted({s["chain"] for s in findings["syncs"] if (s["site"], s["phase"]) == (site, phase)})
            whats = sorted({s["what"] for s in findings["syncs"] if (s["site"], s["phase"]) == (site, phase)})
            out.append(f"{n} host syncs at {site} in phase {phase} ({events.get(phase, 0)} events), "
                       f"{allowed[(site, phase)]} allowed: {'; '.join(whats)} [{' | '.join(chains)}]")
    return out


def unused(runs: list[dict], allow_list=ALLOW_LIST) -> list[Allowed]:
    """Entries no run needed: stale, to be removed (or a scenario is missing)."""
    seen = set()
    for run in runs:
        seen |= {key for key, n in sync_totals(run["findings"]).items() if n}
    return [entry for entry in allow_list if (entry.site, entry.phase) not in seen]


def per_event_table(runs: dict[str, dict]) -> str:
    """A markdown table: per variant, the host syncs per event of each phase, as measured."""
    phases = [("moe_forward", "per MoE layer forward"), ("step", "per step (besides its MoE forwards)"),
              ("logging_step", "per logging step"), ("eval", "per evaluation"), ("save", "per save"),
              ("resume", "per resume"), ("run", "per run (start-up and end)"), ("recompute_plan", "recompute plan")]
    lines = ["| run | MoE forwards per step | " + " | ".join(title for _, title in phases) + " |",
             "|---" * (len(phases) + 2) + "|"]
    for name, run in runs.items():
        events = run["events"]
        totals: Counter = Counter()
        for (_, phase), n in sync_totals(run["findings"]).items():
            totals[phase] += n
        writer: Counter = Counter()  # syncs off the training thread (the delayed update's worker)
        for sync in run["findings"]["syncs"]:
            if "[thread " in sync["what"]:
                writer[sync["phase"]] += sync["count"]
        cells = []
        for phase, _ in phases:
            if not events.get(phase):
                cells.append("-")
                continue
            cell = f"{(totals[phase] - writer[phase]) / events[phase]:g}"
            if writer[phase]:
                cell += f" (+{writer[phase] / events[phase]:g} off the training thread)"
            cells.append(cell)
        moe_per_step = events.get("moe_forward in step", 0) / max(events.get("step", 1), 1)
        lines.append(f"| {name} | {moe_per_step:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
