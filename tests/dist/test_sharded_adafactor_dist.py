"""m6.parallel.sharded_adafactor against its reference, torch.optim.Adafactor on the whole tensors,
over awkward shapes on real gloo processes: uneven dim-0 shards, a rank with no rows, a 3-D
expert stack, vectors, a scalar, two groups (with and without weight decay)."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from m6.parallel.sharded_adafactor import ShardedAdafactor

# rows over 3 ranks: 5 -> 2, 2, 1; 2 -> 1, 1, 0 (a rank without rows); the stack's 2 experts too.
SHAPES = [(5, 7), (2, 3), (2, 3, 4), (7,), (1,), (4, 4)]
STEPS = 4


def _ranks(rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same tensors and gradients on every rank
    whole = [torch.randn(shape) for shape in SHAPES]
    grads = [[torch.randn(shape) * 10 ** (i % 3 - 1) for shape in SHAPES] for i in range(STEPS)]
    mesh = init_device_mesh("cpu", (world,))
    ref = [torch.nn.Parameter(t.clone()) for t in whole]
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in whole]

    def groups(params):
        return [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}]
    ref_opt = torch.optim.Adafactor(groups(ref), lr=0.05, foreach=True)
    opt = ShardedAdafactor(groups(sharded), lr=0.05)
    for step in range(STEPS):
        for p, q, g in zip(ref, sharded, grads[step]):
            p.grad = g.clone()
            q.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        ref_opt.step()
        opt.step()
        for i, (p, q) in enumerate(zip(ref, sharded)):
            torch.testing.assert_close(q.detach().full_tensor(), p.detach(), rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"step {step + 1}, tensor {SHAPES[i]}: {m}")
    for p, q in zip(ref, sharded):  # the state too: torch's names, the whole shapes
        want, got = ref_opt.state[p], opt.state[q]
        assert set(got) == set(want)
        for key in want:
            value = got[key].full_tensor() if hasattr(got[key], "full_tensor") else got[key]
            torch.testing.assert_close(value, want[key], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_adafactor_equals_torch_adafactor(world):
    run_distributed(_ranks, world, timeout_s=120)
