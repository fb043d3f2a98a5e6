"""m6's C++ host Adafactor (m6.memory.host_adafactor) against torch's foreach Adafactor: the same
parameters and state to 1e-6 relative over several steps, on awkward shapes; and the fallback."""

import pytest
import torch

from m6.memory.host_adafactor import (HostAdafactor, build_host_adafactor, choose_host_adafactor, load_adafactor_op,
                                      probe_adafactor_op)

SHAPES = [(7,), (1,), (3, 5), (1, 9), (64, 1), (130, 257), (3, 17, 33)]


@pytest.fixture(scope="module")
def op():
    try:
        return load_adafactor_op(print)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no C++ toolchain to build the op: {e}")


def _pair(op, weight_decay):
    torch.manual_seed(0)
    a = [torch.randn(s, requires_grad=True) for s in SHAPES]
    b = [p.detach().clone().requires_grad_() for p in a]
    groups = lambda ps: [{"params": ps[:4], "weight_decay": weight_decay}, {"params": ps[4:], "weight_decay": 0.0}]
    return a, b, torch.optim.Adafactor(groups(a), lr=1e-2, foreach=True), HostAdafactor(groups(b), op, lr=1e-2)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adafactor(op, weight_decay):
    a, b, ref, fast = _pair(op, weight_decay)
    for step in range(5):
        for p, q in zip(a, b):
            g = torch.randn(p.shape) * (10.0 if step == 2 else 1.0)  # a large step: the RMS clip engages
            if p.dim() > 1 and p.shape[-1] > 2 and step < 2:
                g[..., 1] = 0.0  # a column of zeros: its variance estimate is clamped to eps1^2 (the exact path)
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        fast.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    for p, q in zip(a, b):
        for key, value in ref.state[p].items():
            torch.testing.assert_close(fast.state[q][key], value, rtol=1e-6, atol=1e-12)
    # the state is torch's: a checkpoint loads into either
    torch.optim.Adafactor([{"params": b[:4]}, {"params": b[4:]}], foreach=True).load_state_dict(fast.state_dict())


def test_other_tensors_take_torchs_step(op):
    torch.manual_seed(0)
    p = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    f = torch.randn(8, 3, requires_grad=True)
    g = f.detach().clone().requires_grad_()
    ref = torch.optim.Adafactor([p, f], lr=1e-2, foreach=True)
    fast = HostAdafactor([q, g], op, lr=1e-2)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
        f.grad = torch.randn_like(f)
        g.grad = f.grad.clone()
        ref.step()
        fast.step()
    torch.testing.assert_close(q, p)
    torch.testing.assert_close(g, f, rtol=1e-6, atol=1e-7)


def test_without_compiler_falls_back_with_one_line():
    said = []

    def no_compiler(log):
        raise RuntimeError("Error building extension 'm6_host_adafactor': c++: command not found")

    gist = probe_adafactor_op(said.append, load=no_compiler)
    assert "command not found" in gist
    assert choose_host_adafactor("auto", {0: gist}, said.append) == "torch"
    assert len(said) == 1 and "command not found" in said[0] and "torch's foreach Adafactor" in said[0]
    assert choose_host_adafactor("auto", {}, said.append) == "cpp" and "m6's C++ Adafactor" in said[1]
    assert choose_host_adafactor("torch", {}, said.append) == "torch"
    opt = build_host_adafactor([{"params": [torch.zeros(3, 3, requires_grad=True)]}], 1e-3, "torch")
    assert type(opt) is torch.optim.Adafactor
