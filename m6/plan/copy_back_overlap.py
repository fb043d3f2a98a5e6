"""The planner's model of zero's block copy-back (m6.memory.block_copy_back): the 16-bit weights
going back after the host update overlap the next step's first forward, block by block.

The copy stream moves forward-order segments (the weights outside the blocks, then block 0, 1,
...), and the forward of a block waits for its own segment only. With a first piece b_0 (the
weights outside the blocks and block 0's), n - 1 more blocks of copy b each, and a forward of f
per block (F = n f), the forward ends at max(b_0 + n f, b_0 + (n - 1) b + f): it waits
max(b_0, B - (F - f)) longer than it computes, B the whole copy. ASSUMED: the blocks' forwards
take equal times (F: the first micro-batch's forward, 1/3 of its forward + backward, as the
gradients' window is 2/3), and the link carries nothing else meanwhile but the streamed blocks'
fetches for that forward, which take their share of F first. Both directions share the PCIe
figure: the copy's hidden part is added to the link's load over the step (m6.plan.offload_layouts).
"""

from __future__ import annotations


def weights_back_exposed(back_s: float, first_s: float, forward_s: float, num_blocks: int,
                         link_busy_s: float = 0.0) -> float:
    """Seconds of a ``back_s`` copy back that the next forward waits for: ``first_s`` the first
    piece's copy (outside the blocks + block 0), ``forward_s`` the forward of ``num_blocks``
    resident blocks, ``link_busy_s`` the link's other copies during that forward."""
    if back_s <= 0.0:
        return 0.0
    last_block = forward_s / max(num_blocks, 1)  # its copy must land before its forward: not hidden
    window = max(0.0, forward_s - last_block - link_busy_s)
    return min(back_s, max(min(first_s, back_s), back_s - window))
