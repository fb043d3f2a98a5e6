"""optim.name=adafactor: the Trainer's update is torch.optim.Adafactor's (on the device and as the
offloaded host update, where both give the same bits on CPU), its factored state checkpoints and
resumes bitwise (offloaded too), resuming with the other optimizer is a clear error, and the
combinations that cannot work are config errors naming the keys."""

from __future__ import annotations

import pytest
import torch

from m6.checkpoint.errors import CheckpointMismatch
from m6.config import ConfigError, load
from m6.memory.memory_report import estimate_memory
from m6.memory.host_adafactor import HostAdafactor, probe_adafactor_op
from m6.train.loop import Trainer
from m6.train.optim import no_decay_ids

SMALL = [
    "model.d_model=32", "model.num_layers=3", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=256", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0",
    "train.precision=fp32", "logging.console=false", "checkpoint.every=0", "train.max_steps=5",
    "optim.name=adafactor", "optim.lr=1e-2",
]
STEPS = 5
_DEVICE = ["cpu"]  # pytest --device (tests/conftest.py), set once per module below


@pytest.fixture(autouse=True, scope="module")
def _selected_device(device):
    _DEVICE[0] = device.type


def trainer(path, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"train.device={_DEVICE[0]}", f"run.dir={path}", *extra]))


def assert_same_run(losses, want_losses, weights, want_weights) -> None:
    """Bitwise on the CPU (the host runs the device's kernels). On a GPU the device run's Adafactor
    runs CUDA kernels and the offloaded one the host's, whose roundings differ in the last bits:
    equal to fp32 rounding there (the first forward bitwise: same weights, same kernels)."""
    if _DEVICE[0] == "cpu":
        assert losses == want_losses
        for k, v in weights.items():
            assert torch.equal(v, want_weights[k]), k
        return
    assert losses[0] == want_losses[0]
    assert losses == pytest.approx(want_losses, rel=1e-5)
    for k, v in weights.items():  # offload=optimizer+params keeps blocks' weights on the host between steps
        torch.testing.assert_close(v.cpu(), want_weights[k].cpu(), rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def run(tr: Trainer, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    return losses, {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(trainer(tmp_path_factory.mktemp("plain")), STEPS)


def test_update_is_torch_adafactor_with_factored_state(reference, tmp_path):
    tr = trainer(tmp_path)
    assert type(tr.update.optimizer) is torch.optim.Adafactor
    losses, _ = run(tr, 1)
    assert losses == reference[0][:1]
    for p in tr.model.parameters():
        state = tr.update.optimizer.state[p]
        if p.dim() > 1:  # O(rows + cols): never a tensor of the parameter's size
            assert set(state) == {"step", "row_var", "col_var"}
            assert state["row_var"].shape == (*p.shape[:-1], 1) and state["col_var"].shape == (*p.shape[:-2], 1, p.shape[-1])
        else:
            assert set(state) == {"step", "variance"}
    assert any(p.dim() == 3 for p in tr.update.experts)  # expert stacks [E, ., .]: factored per expert
    # The loss falls: Adafactor trains this model (lr 1e-2 as torch's default).
    assert reference[0][-1] < reference[0][0]


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params"])
def test_offloaded_host_adafactor_equals_device_run_and_resumes(reference, tmp_path, offload):
    tr = trainer(tmp_path / "torch", f"memory.offload={offload}", "memory.host_optimizer=torch")
    assert tr.update.host_optimizer == "torch" and type(tr.update.optimizer) is torch.optim.Adafactor
    first = run(tr, 2)[0]
    tr.save_checkpoint(wait=True)
    resumed = trainer(tmp_path / "torch", f"memory.offload={offload}", "memory.host_optimizer=torch")
    assert resumed.step == 2
    more, weights = run(resumed, STEPS - 2)
    assert_same_run(first + more, reference[0], weights, reference[1])


def test_offloaded_auto_runs_m6s_cpp_adafactor_and_resumes_into_torchs(reference, tmp_path):
    """memory.host_optimizer=auto: m6's C++ Adafactor, the device run's math to fp32 rounding (its
    sums run in another order); its checkpoint resumes into torch's Adafactor (the same state)."""
    if probe_adafactor_op(print) is not None:
        pytest.skip("no C++ toolchain here: auto falls back to torch's Adafactor (tests/unit/test_host_adafactor.py)")
    tr = trainer(tmp_path, "memory.offload=optimizer", "memory.host_optimizer=auto")
    assert tr.update.host_optimizer == "cpp" and type(tr.update.optimizer) is HostAdafactor
    first = run(tr, 2)[0]
    tr.save_checkpoint(wait=True)
    resumed = trainer(tmp_path, "memory.offload=optimizer", "memory.host_optimizer=torch")
    assert resumed.step == 2 and type(resumed.update.optimizer) is torch.optim.Adafactor
    more, weights = run(resumed, STEPS - 2)
    assert first + more == pytest.approx(reference[0], rel=1e-5)
    for k, v in weights.items():
        torch.testing.assert_close(v.cpu(), reference[1][k].cpu(), rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_resume_with_the_other_optimizer_is_refused(tmp_path):
    tr = trainer(tmp_path)
    run(tr, 1)
    tr.save_checkpoint(wait=True)
    with pytest.raises(CheckpointMismatch, match=r"holds adafactor optimizer state \(col_var, row_var, variance\); "
                                                 r"this run has optim.name=adamw\. Resume with optim.name=adafactor"):
        Trainer(load(None, [*SMALL[:-2], f"run.dir={tmp_path}"]))
    adam = tmp_path / "adam"
    first = Trainer(load(None, [*SMALL[:-2], f"run.dir={adam}"]))
    run(first, 1)
    first.save_checkpoint(wait=True)
    with pytest.raises(CheckpointMismatch, match=r"holds adamw optimizer state \(exp_avg, exp_avg_sq\); this run has "
                                                 r"optim.name=adafactor.*checkpoint.init_from=PATH"):
        trainer(adam)


@pytest.mark.parametrize("overrides, message", [
    (["memory.offload=optimizer", "memory.host_optimizer=deepspeed"],
     r"optim.name=adafactor with memory.host_optimizer=deepspeed: DeepSpeed's CPU op is Adam only"),
    (["optim.beta1=0.8"], r"optim.beta1=0.8 set, but optim.name=adafactor does not use them"),
    (["optim.name=adam"], r"optim.name"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, [*SMALL, *overrides])


def test_memory_report_counts_adafactor_state(tmp_path):
    """The estimate (and so the planner, which sizes layouts with it) knows Adafactor's factored
    state: equal to the state tensors a step leaves on the host, and far below AdamW's."""
    tr = trainer(tmp_path, "memory.offload=optimizer", "memory.host_optimizer=torch")
    tr.train_step()
    state = [v for s in tr.update.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    est = estimate_memory(tr.cfg, tr.model, no_decay_ids(tr.model))
    assert est.host["optimizer state"] == sum(t.untyped_storage().nbytes() for t in state)
    adamw = estimate_memory(load(None, [*SMALL[:-2], "memory.offload=optimizer"]), tr.model, no_decay_ids(tr.model))
    numel = sum(p.numel() for p in tr.model.parameters())
    assert est.host["optimizer state"] < 0.2 * adamw.host["optimizer state"] and adamw.host["optimizer state"] > 8 * numel
