"""The inter-node link's floor per phase of a step: every transfer the planner hides beside
compute in one window and that crosses nodes uses the same link of the rank (its share of the
node's NICs, ``Hardware.inter_node_GBps``), so the window lasts at least the sum of their
inter-node seconds. Two windows hold such transfers:

last backward  the last micro-batch's backward (2/3 of its compute, plus what of its all-to-all
          and gradient sync shows): the data-parallel buckets' all-reduces (or, with
          ``memory.offload=zero`` + ``parallel.shard=optimizer``, their reduce-scatters) once the
          data-parallel world spans nodes (m6.plan.timing.data_parallel_s), and the inter-node part
          of that backward's all-to-alls (m6.plan.timing.expert_exchange_inter_s).
next forward  (the partitioned zero) the first micro-batch's forward (1/3 of its compute, plus what
          of the weights' return and of its all-to-all shows): the weights' all-gathers over the
          groups that span nodes, and the inter-node part of that forward's all-to-alls.

What of a window's sum exceeds its modelled length is added to the step, labelled "inter-node link
shared". Intra-node (NVLink) and host<->device (PCIe) traffic are other links, not counted here.
ASSUMED: the link moves the transfers back to back at its full rate (a floor: contention costs
more). parallel.shard's FSDP2 collectives are modelled not overlapped with compute
(m6.plan.timing.sharded_sync_s), so they already hold the link to themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

LINK_ASSUMED = ("inter-node link: in the last backward (the gradient sync + that backward's all-to-alls) and, with "
                "zero shard=optimizer, in the next forward (the weights' all-gathers + that forward's all-to-alls), "
                "the transfers that cross nodes share one link, each window lasting at least their sum at the full "
                "inter-node rate")


@dataclass(frozen=True)
class LinkWindow:
    """One window of a step and the inter-node transfers placed in it (seconds on the link)."""

    name: str  # "last backward" or "next forward"
    window_s: float  # its modelled length before the floor
    transfers: tuple[tuple[str, float], ...]  # (what, inter-node seconds), zero entries left out

    @property
    def load_s(self) -> float:
        return sum(s for _, s in self.transfers)

    @property
    def excess_s(self) -> float:
        """What the link adds to the window: its load beyond the window's length."""
        return max(0.0, self.load_s - self.window_s)

    def describe(self) -> str:
        carried = " + ".join(f"{what} {s:.3f}" for what, s in self.transfers)
        return f"{self.name} {self.window_s:.3f} carries {carried} (+{self.excess_s:.3f})"


def link_window(name: str, window_s: float, transfers: dict[str, float]) -> LinkWindow:
    """The window ``name`` of ``window_s`` seconds with the inter-node ``transfers`` in it (what ->
    seconds; those of zero seconds, which stay inside a node, left out)."""
    return LinkWindow(name, window_s, tuple((k, v) for k, v in transfers.items() if v > 0.0))
