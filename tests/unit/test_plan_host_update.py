"""The planner times the offloaded host update with the optimizer the run will choose
(m6.plan.host_update): its per-core probe follows optim.name and memory.host_optimizer."""

from pathlib import Path

import pytest
import torch

import m6.config as m6config
import m6.plan.host_update as host_update
from m6.memory.host_adafactor import HostAdafactor, probe_adafactor_op
from m6.plan.host_update import probe_optimizer, resolve_host_update
from m6.plan.memory import rank_model
from m6.plan.timing import GPUS, HostProfile, step_time

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = ["data.kind=synthetic", "data.sources=[]", "model.moe.capacity_factor=null", "data.seq_len=40",
         "model.max_text_len=40", "model.image_size=16", "train.global_batch_size=16", "train.micro_batch_size=2",
         "memory.offload=optimizer"]


def _tensors_and_elements(cfg, world: int, ep: int) -> tuple[int, int]:
    params = [p for p in rank_model(cfg, world, ep).parameters() if p.requires_grad]
    return len(params), sum(p.numel() for p in params)


@pytest.mark.parametrize("name, chosen, other", [("adamw", "deepspeed", "torch"), ("adafactor", "cpp", "torch")])
def test_step_time_takes_the_update_from_the_chosen_optimizers_probe(name, chosen, other):
    cfg = m6config.load(CONFIGS / "tiny.yaml", [*SMALL, f"optim.name={name}"])
    updates = {}
    for host_opt, per_elem in ((chosen, 1e-9), (other, 4e-9)):
        host = HostProfile(threads=1, host_cores_per_gpu=8)
        host._host_updates[(name, "auto")] = host_opt  # as resolved on this host
        host._step_costs[(name, chosen, False)] = (1e-6, 1e-9)  # as if probed on one thread
        host._step_costs[(name, other, False)] = (1e-6, 4e-9)
        updates[host_opt] = step_time(cfg, 4, 2, 8, GPUS["v100"], host).update
        n, e = _tensors_and_elements(cfg, 4, 2)
        assert updates[host_opt] == pytest.approx((n * 1e-6 + e * per_elem) / 8)
        assert list(host.host_rates()) == [host_update.HOST_UPDATE_NAMES[(name, chosen)],
                                           host_update.HOST_UPDATE_NAMES[(name, other)]]
    assert updates[chosen] < updates[other]


def test_the_host_optimizer_is_resolved_as_the_run_resolves_it(monkeypatch):
    said = []
    adamw = m6config.load(CONFIGS / "tiny.yaml", SMALL)
    adafactor = m6config.load(CONFIGS / "tiny.yaml", [*SMALL, "optim.name=adafactor"])
    torch_only = m6config.load(CONFIGS / "tiny.yaml", [*SMALL, "memory.host_optimizer=torch"])
    assert resolve_host_update(torch_only, said.append) == "torch" and said == []
    monkeypatch.setattr(host_update, "probe_cpu_adam", lambda log: None)
    monkeypatch.setattr(host_update, "probe_adafactor_op", lambda log: None)
    assert resolve_host_update(adamw, said.append) == "deepspeed"
    assert resolve_host_update(adafactor, said.append) == "cpp"
    monkeypatch.setattr(host_update, "probe_cpu_adam", lambda log: "RuntimeError: no compiler")
    monkeypatch.setattr(host_update, "probe_adafactor_op", lambda log: "RuntimeError: no compiler")
    assert resolve_host_update(adamw, said.append) == "torch" and "torch's AdamW instead" in said[-1]
    assert resolve_host_update(adafactor, said.append) == "torch" and "torch's foreach Adafactor instead" in said[-1]


def test_the_probe_steps_the_optimizer_the_run_uses():
    if probe_adafactor_op(print) is not None:
        pytest.skip("no C++ toolchain here to build m6's C++ Adafactor")
    params = [torch.zeros(64, 32, requires_grad=True)]
    assert type(probe_optimizer(params, "adafactor", "cpp")) is HostAdafactor
    assert type(probe_optimizer(params, "adafactor", "torch")) is torch.optim.Adafactor
    assert type(probe_optimizer(params, "adamw", "torch")) is torch.optim.AdamW
    for optimizer, host in (("adafactor", "cpp"), ("adafactor", "torch"), ("adamw", "torch")):
        assert HostProfile._time_host_update(4, 2**12, optimizer, False, host) > 0
