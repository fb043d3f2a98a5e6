"""memory.offload=zero's copy back in forward-order segments (m6.memory.block_copy_back): every
resident weight is copied once per update, the weights outside the blocks first, then block 0,
1, ...; each block's forward runs after its own segment's copy; and the run trains exactly as the
whole-model copy did: the losses of 6 steps equal it bitwise (on a CPU device the copies are
synchronous), with the synchronous and the delayed update, apply groups and streamed blocks."""

from __future__ import annotations

import pytest
import torch

from m6.config import load
from m6.train.loop import Trainer

SMALL = [
    "model.d_model=32", "model.num_layers=3", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=256", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0", "train.precision=bf16",
    "logging.console=false", "checkpoint.every=0", "memory.host_optimizer=torch", "train.device=cpu",
    "memory.offload=zero",
]
STEPS = 6


def trainer(path, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"run.dir={path}", *extra]))


def whole_model_copy(tr: Trainer) -> Trainer:
    """The trainer with the copy back as one whole-model copy before the next forward."""
    off = tr.update.offload
    off.block_copy_back.close()
    off.block_copy_back = None
    return tr


@pytest.mark.parametrize("extra, rounds_waited", [
    (("memory.offload_blocks=[]",), STEPS - 1),
    (("memory.offload_blocks=[]", "optim.apply_groups=3"), STEPS - 1),
    # Steps 2, 4, 5, 6 run on weights copied back (step 3 on step 1's still: step 2's update is delayed).
    (("memory.offload_blocks=[]", "optim.delayed_update=true", "optim.delayed_update_after=1",
      "memory.host_grad_dtype=compute"), STEPS - 2),
    (("memory.offload_blocks=[1]", "optim.delayed_update=true", "optim.delayed_update_after=0"), STEPS - 2),
], ids=["sync", "sync-apply-groups", "delayed-half-grads", "delayed-streamed"])
def test_losses_equal_the_whole_model_copys_bitwise(tmp_path, extra, rounds_waited):
    blocks = trainer(tmp_path / "blocks", *extra)
    assert blocks.update.offload.block_copy_back is not None
    whole = whole_model_copy(trainer(tmp_path / "whole", *extra))
    got = [blocks.train_step()["loss"] for _ in range(STEPS)]
    want = [whole.train_step()["loss"] for _ in range(STEPS)]
    assert got == want
    # Each forward on copied-back weights waited once for each segment (block 1 streamed: no copy back).
    copy_back = blocks.update.offload.block_copy_back
    segments = copy_back.num_segments - (1 if "memory.offload_blocks=[1]" in extra else 0)
    assert copy_back.segment_waits == rounds_waited * segments
    blocks.update.wait()
    if blocks.update.delayed is not None:  # the last update's weights to the device too
        blocks.update.delayed.catch_up()
    for p, m in blocks.update.offload.resident:  # every weight is its master's rounding (a gate: fp32)
        assert torch.equal(p.detach(), m.to(p.dtype))


def test_segments_are_copied_in_forward_order_before_their_forward(tmp_path):
    """Outside the blocks first, then block by block; block i's forward after block i's copy, and
    all of one apply group's weights handed over before the next group updates."""
    tr = trainer(tmp_path, "memory.offload_blocks=[]")
    copy_back = tr.update.offload.block_copy_back
    log: list[tuple[str, int]] = []
    push = copy_back._push

    def logged_push(pairs):
        segments = {copy_back.segment(p) for p, _ in pairs}
        assert len(segments) == 1  # one segment at a time
        log.append(("copy", segments.pop()))
        push(pairs)
    copy_back._push = logged_push
    for i, block in enumerate(tr.model.blocks):
        block.register_forward_pre_hook(lambda module, args, i=i: log.append(("forward", i + 1)))
    tr.model.register_forward_pre_hook(lambda module, args: log.append(("forward", 0)))
    tr.train_step()
    log.clear()
    tr.train_step()  # the forward of the weights step 1's update copied back, then step 2's copy back
    num = copy_back.num_segments
    copies = [s for kind, s in log if kind == "copy"]
    assert copies == list(range(num))
    first_forward = log.index(("forward", 0))
    assert [s for kind, s in log[first_forward:first_forward + 2 * num] if kind == "forward"][:num] == list(range(num))


def test_a_failed_copy_is_raised_by_the_forward_not_waited_for(tmp_path):
    tr = trainer(tmp_path, "memory.offload_blocks=[]")
    copy_back = tr.update.offload.block_copy_back

    def broken(pairs):
        raise OSError("no pinned memory left")
    copy_back._push = broken
    with pytest.raises(OSError, match="no pinned memory"):
        tr.train_step()
    with pytest.raises(RuntimeError, match="copy of the updated weights to the device failed: OSError"):
        tr.train_step()


def test_apply_groups_update_in_forward_order_and_that_changes_no_value(tmp_path):
    """zero with apply groups: the groups update (and go back) in the order the forward reads
    their first weight, so the first blocks' weights are on the device first; each tensor's update
    is its own, so the losses equal those of the groups in their split order (replicated first)."""
    from m6.memory import split_apply_groups

    # Experts in every block, small ones: the replicated weights take most groups, one expert group starts early.
    extra = ("memory.offload_blocks=[]", "optim.apply_groups=6", "model.moe.every=1", "model.ffn_dim=8")
    ordered = trainer(tmp_path / "ordered", *extra)
    off, apply = ordered.update.offload, ordered.update.apply
    position = {id(m): i for i, m in enumerate(off.masters_of(list(ordered.model.parameters())))}
    starts = [min(position[id(m)] for m in group) for group in apply.groups]
    assert starts == sorted(starts) and starts[0] == 0
    split = trainer(tmp_path / "split", *extra)
    u = split.update
    split_order = split_apply_groups(u.replicated, u.experts, 6)
    ids = lambda groups: [[id(t) for t in g] for g in groups]  # noqa: E731
    assert ids(split_order) != ids(u.apply.groups) and sorted(ids(split_order)) == sorted(ids(u.apply.groups))
    u.apply.groups = split_order
    assert [ordered.train_step()["loss"] for _ in range(4)] == [split.train_step()["loss"] for _ in range(4)]
