"""The printed step breakdown of a planned layout: what runs beside what (the all-to-all behind the
experts, the gradient sync behind the last backward, the host<->device copies behind compute or
the host update, the delayed host update behind the next step's forward/backward), each with the
seconds it takes and the seconds the step waits for it. Every figure is PREDICTED."""

from __future__ import annotations

from typing import Optional

from m6.plan.offload_layouts import BLOCK_COPY_BACK, ZERO
from m6.plan.timing import StepTime
from m6.plan.zero_partition_step import CHUNKS_BACK, GATHERS


def describe_streamed(offload: str, blocks: Optional[list[int]]) -> str:
    """The offload's block note: which blocks stream (or, in the zero layout, that all are resident)."""
    if blocks:
        return f" (blocks {blocks[0]}-{blocks[-1]} streamed)"
    return " (every block resident)" if offload == ZERO else ""


def describe_overlaps(t: StepTime, delayed_after: int) -> list[str]:
    """The lines saying what overlaps what in step ``t`` (none when nothing overlaps)."""
    parts = []
    if t.all_to_all_hidden:
        parts.append(f"all-to-all {t.all_to_all + t.all_to_all_hidden:.3f} beside the experts ({t.all_to_all:.3f} "
                     "exposed)")
    partitioned = any(c.name == GATHERS for c in t.copies)  # zero with shard=optimizer: reduce-scatters
    if t.grad_sync_hidden:
        parts.append(f"grad sync{' (reduce-scatter)' if partitioned else ''} {t.grad_sync + t.grad_sync_hidden:.3f} beside the last backward "
                     f"({t.grad_sync:.3f} exposed)")
    for copy in t.copies:
        parts.append(f"{copy.name} {copy.seconds:.3f} ({copy.exposed:.3f} exposed)")
    lines = ["    overlaps: " + "; ".join(parts)] if parts else []
    if t.link_windows:  # m6.plan.link_floor: each window at least its transfers' inter-node seconds
        lines.append("    inter-node link (seconds on it): " + "; ".join(w.describe() for w in t.link_windows))
    blocks = any(c.name in (BLOCK_COPY_BACK, CHUNKS_BACK) for c in t.copies)
    if t.synchronous_total is not None and blocks:
        device = t.compute + t.all_to_all + t.grad_sync + t.small_collectives + t.link_shared \
            + sum(c.exposed for c in t.copies)
        back = next(c for c in t.copies if c.name in (BLOCK_COPY_BACK, CHUNKS_BACK))
        lines.append(f"    delayed update: host update {t.update + t.update_hidden:.3f} beside the next step's device "
                     f"phase {device:.3f}, from when the weights back ({back.seconds:.3f}) have read the masters "
                     f"({t.update:.3f} exposed); steps 1-{delayed_after} update synchronously: step "
                     f"{t.synchronous_total:.3f} s")
    elif t.synchronous_total is not None:
        device = t.compute + t.all_to_all + t.grad_sync + t.small_collectives + t.link_shared \
            + sum(c.exposed for c in t.copies if "back" not in c.name)
        lines.append(f"    delayed update: host update {t.update + t.update_hidden:.3f} beside the next step's device "
                     f"phase {device:.3f} ({t.update:.3f} exposed), then the weights back; steps 1-{delayed_after} "
                     f"update synchronously: step {t.synchronous_total:.3f} s")
    elif blocks:
        lines.append(f"    host update {t.update:.3f} after the device's step, the weights going back group by group "
                     "beside it and the rest beside the next forward"
                     + (", each segment all-gathered after its copy" if partitioned else ""))
    elif t.copies:
        lines.append(f"    host update {t.update:.3f} after the device's step, the weights going back group by group "
                     "beside it")
    return lines
