"""CPU offload at world size 2 with every parameter all-reduced (EP 1), real gloo: gradients
stream to the host and bucket copies are freed during backward (at most ``max_in_flight`` alive),
and the host gradients are bitwise those of one flat all-reduce per bucket after backward."""

from __future__ import annotations

import os

import torch
from dist_helpers import flat_bucket_sums, run_distributed

from m6.config import load
from m6.train.loop import Trainer

TIMEOUT_S = 30


# Every parameter reduced over both ranks (EP 1: the experts are replicated), in 19 small buckets.
OFFLOAD_RUN = [
    "model.d_model=32", "model.num_layers=4", "model.num_heads=2", "model.ffn_dim=32", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "model.moe.capacity_factor=null",
    "data.kind=synthetic", "data.num_workers=0", "data.num_samples=64", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0", "train.precision=fp32",
    "train.device=cpu", "logging.console=false", "checkpoint.every=0", "parallel.expert_parallel_size=1",
    "parallel.bucket_size_mb=0.002", "memory.host_optimizer=torch",  # gradients only: no op build needed
]


class DeviceGradBytes:
    """Samples, after every gradient the sync handles, the device-side gradient bytes (the
    parameters' .grad) and the sync's live bucket copies; the peaks, and the state right before
    ``finish()`` (the end of backward)."""

    def __init__(self, trainer: Trainer) -> None:
        self.params = [p for p in trainer.model.parameters() if p.requires_grad]
        self.sync = trainer.update.sync
        self.peak_bytes = self.peak_copies = 0

        def hook(_) -> None:  # None: a returned value would be taken for the gradient
            self.sample()

        for p in self.params:  # registered after the sync's hooks: sees what they left
            p.register_post_accumulate_grad_hook(hook)
        real_finish = trainer.update.finish

        def finish() -> None:
            self.at_end_of_backward = self.sample()
            real_finish()
        trainer.update.finish = finish  # an instance attribute shadows the method

    def sample(self) -> dict:
        in_flight = [b for b in self.sync.buckets if b.flat is not None]
        with_grad = [p for p in self.params if p.grad is not None]
        total = sum(t.untyped_storage().nbytes() for t in [p.grad for p in with_grad] + [b.flat for b in in_flight])
        self.peak_bytes, self.peak_copies = max(self.peak_bytes, total), max(self.peak_copies, len(in_flight))
        return {"bytes": total, "copies": len(in_flight), "with_grad": {id(p) for p in with_grad},
                "in_flight": {id(p) for b in in_flight for p in b.params}}


def _offload_streams_during_backward(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    for mode in ("optimizer", "optimizer+params"):
        tr = Trainer(load(None, [*OFFLOAD_RUN, f"run.dir={root}/{mode}", f"memory.offload={mode}"]))
        sync, off = tr.update.sync, tr.update.offload
        grad_bytes = sum(p.numel() * 4 for p in tr.model.parameters())
        reduced = sum(len(b.params) for b in sync.buckets if b.group_size > 1)
        assert reduced == len(list(tr.model.parameters())) and len(sync.buckets) > 4 * sync.max_in_flight
        meter = DeviceGradBytes(tr)
        tr.train_step()
        # Before the fix every bucket's copy and every gradient stayed alive until finish():
        # twice the gradient bytes at the end of backward, 19 copies.
        assert meter.peak_copies <= sync.max_in_flight, (mode, meter.peak_copies)
        assert meter.peak_bytes < 0.5 * grad_bytes, (mode, meter.peak_bytes, grad_bytes)
        end = meter.at_end_of_backward
        # Every bucket is complete: those drained have streamed to the host; only the ones in flight hold device grads.
        assert end["copies"] <= sync.max_in_flight and end["with_grad"] == end["in_flight"], (mode, end["copies"])

        # Bitwise the gradients of one flat all-reduce per bucket after backward (no streaming).
        batch = tr.held_out_batch(list(range(4 * rank, 4 * rank + 4)))
        tr.update.begin_micro_batch(last=False)
        lm, aux = tr.forward_loss(batch)
        (lm + aux).backward()
        expected = flat_bucket_sums(sync)
        tr.update.zero_grad()
        tr.update.begin_micro_batch(last=True)
        lm, aux = tr.forward_loss(batch)
        tr.update.backward(lm + aux)
        tr.update.finish()
        for name, p in tr.model.named_parameters():
            assert p.grad is None and torch.equal(off.master(p).grad, expected[id(p)].view_as(p)), (mode, name)


def test_offload_at_world_2_streams_gradients_and_frees_bucket_copies_during_backward(tmp_path):
    run_distributed(_offload_streams_during_backward, 2, str(tmp_path), timeout_s=TIMEOUT_S)
