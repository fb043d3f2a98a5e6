"""CPU offload (memory.offload) and group-wise apply in the Trainer: 5 fp32 CPU steps equal the
plain run bitwise, the offload paths really run (separate host masters, gradients streamed,
layers fetched and released around their use), resume is exact, and the memory report's model
states match the tensors a step leaves behind."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from m6.config import load
from m6.checkpoint.staging import aligned
from m6.memory.memory_report import estimate_memory
from m6.train.loop import Trainer
from m6.train.optim import no_decay_ids

SMALL = [
    "model.d_model=32", "model.num_layers=3", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=256", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0", "train.precision=fp32",
    "logging.console=false", "checkpoint.every=0",
    # Offload is compared with the plain run bitwise: the same torch AdamW on the host. DeepSpeed's
    # CPU Adam (the default when it builds) is tested in test_host_optimizer.py.
    "memory.host_optimizer=torch",
]
_DEVICE = ["cpu"]  # pytest --device (tests/conftest.py), set once per module below


@pytest.fixture(autouse=True, scope="module")
def _selected_device(device):
    _DEVICE[0] = device.type
VARIANTS = {
    "apply_groups": ["optim.apply_groups=4"],
    "offload_optimizer": ["memory.offload=optimizer"],
    "offload_params": ["memory.offload=optimizer+params"],
    "offload_params_groups": ["memory.offload=optimizer+params", "optim.apply_groups=3"],
    # Recompute in backward reads the weights of a layer the streamer fetched back for it.
    "offload_params_checkpointing": ["memory.offload=optimizer+params", "memory.activation_checkpointing=full"],
    # Granular: blocks 0 and 2 stream (2 prefetched while 0 computes), block 1 stays on the device.
    "offload_some_blocks": ["memory.offload=optimizer+params", "memory.offload_blocks=[0,2]"],
}
STEPS = 5


def assert_same_run(losses, want_losses, weights, want_weights) -> None:
    """On the CPU, offload trains bitwise like the plain run (the same torch AdamW kernels on the
    host). On a GPU the plain run's AdamW runs CUDA's fused kernel and the offloaded one the host's
    foreach, whose roundings differ in the last bits: equal to fp32 rounding there (losses to 1e-5,
    weights to 1e-5 relative); the gradients and the forward are the same."""
    if _DEVICE[0] == "cpu":
        assert losses == want_losses
        assert weights.keys() == want_weights.keys()
        for k, v in weights.items():
            assert torch.equal(v, want_weights[k]), k
        return
    assert losses[0] == want_losses[0]  # the first forward: same weights, same kernels
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert weights.keys() == want_weights.keys()
    for k, v in weights.items():
        torch.testing.assert_close(v.cpu(), want_weights[k].cpu(), rtol=1e-5, atol=1e-7, msg=k)


def trainer(tmp_path, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"train.device={_DEVICE[0]}", f"run.dir={tmp_path}", *extra]))


def run(tr: Trainer, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    return losses, {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(trainer(tmp_path_factory.mktemp("plain")))


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_equals_the_plain_run_bitwise(reference, tmp_path, name):
    losses, weights = run(trainer(tmp_path, *VARIANTS[name]))
    assert_same_run(losses, reference[0], weights, reference[1])


def test_offload_keeps_separate_host_masters_and_streams_gradients(tmp_path):
    tr = trainer(tmp_path, "memory.offload=optimizer", "optim.apply_groups=2")
    off = tr.update.offload
    params = list(tr.model.parameters())
    optimized = [p for g in tr.update.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in optimized} == {id(off.master(p)) for p in params}  # the update runs on masters
    assert all(off.master(p).untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p in params)
    tr.train_step()
    # After a step the device grads are gone (streamed), the masters updated and copied back.
    assert all(p.grad is None for p in params)
    assert all(torch.equal(off.master(p), p.detach().to(off.master(p).device)) for p in params)
    # A trial backward outside update.backward (recompute check, speed measurement) keeps its
    # gradients on the device; a training backward streams them in every micro-batch (world 1:
    # no parameter is shared) and the host sums them.
    batch = tr.loader.next_step()[0][0].batch.to(tr.device)
    tr.update.begin_micro_batch(last=False)
    lm, aux = tr.forward_loss(batch)
    (lm + aux).backward()
    first = {id(p): p.grad.to(off.master(p).device, copy=True) for p in params}
    assert all(off.master(p).grad is None for p in params)
    tr.update.zero_grad()
    for last in (False, False, True):
        tr.update.begin_micro_batch(last=last)
        lm, aux = tr.forward_loss(batch)
        tr.update.backward(lm + aux)
        assert all(p.grad is None for p in params)  # left for the host, micro-batch by micro-batch
    tr.update.finish()
    for p in params:
        torch.testing.assert_close(off.master(p).grad, 3 * first[id(p)], rtol=1e-5, atol=1e-8)
    assert tr.update.grad_bytes_after_backward == 0


@pytest.mark.parametrize("mode", ["optimizer", "optimizer+params"])
def test_gradients_stream_in_every_micro_batch_of_four(tmp_path, mode):
    """Accumulation 4: the host sum equals the device's bitwise (same losses and weights as the
    plain run), and no gradient is left on the device at the end of any backward (world 1)."""
    plain = trainer(tmp_path / "plain", "train.micro_batch_size=2")
    offloaded = trainer(tmp_path / "offloaded", "train.micro_batch_size=2", f"memory.offload={mode}")
    assert plain.accum == offloaded.accum == 4
    grad_bytes = sum(p.numel() * 4 for p in plain.model.parameters())
    plain_losses, offloaded_losses = [], []
    for _ in range(3):
        a, b = plain.train_step(), offloaded.train_step()
        plain_losses.append(a["loss"])
        offloaded_losses.append(b["loss"])
        # Before streaming, offload kept every gradient on the device until the last micro-batch.
        assert a["grad_mb"] * 2**20 == grad_bytes and b["grad_mb"] == 0
    assert_same_run(offloaded_losses, plain_losses, offloaded.model.state_dict(), plain.model.state_dict())


def test_offloaded_params_live_on_the_host_and_visit_the_device_per_block(tmp_path):
    tr = trainer(tmp_path, "memory.offload=optimizer+params")
    streamer = tr.update.offload.streamer
    layers = streamer.layers
    blocks = list(tr.model.blocks)
    assert len(layers) == len(blocks) == 3

    def state() -> list[bool]:
        """Per block: are its weights in the device buffers (True) or at their host homes?"""
        out = []
        for layer in layers:
            on_device = [p.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and b.untyped_storage().nbytes() > 0
                         for p, b in zip(layer.params, layer.buffers)]
            at_home = [p.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
                       for p, h in zip(layer.params, layer.homes)]
            assert all(on_device) or all(at_home)
            out.append(all(on_device))
        return out

    seen_forward, seen_backward = [], []
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: seen_forward.append((i, state())))
        # Runs inside the block's backward: the block's weights must be on the device then.
        block.ffn_norm.weight.register_hook(lambda g, i=i: seen_backward.append((i, state())) or g)
    assert state() == [False, False, False]
    tr.train_step()
    # Forward: block i present and block i + 1 prefetched, earlier blocks released.
    assert seen_forward[:3] == [(0, [True, True, False]), (1, [False, True, True]), (2, [False, False, True])]
    assert [i for i, _ in seen_backward[:3]] == [2, 1, 0]
    for i, resident in seen_backward[:3]:
        assert resident[i] and all(not r for j, r in enumerate(resident) if j > i)
    assert state() == [False, False, False]  # all released after the step
    assert all(b.untyped_storage().nbytes() == 0 for layer in layers for b in layer.buffers)
    # Eval (no grad) streams too, and state_dict reads the host homes.
    tr.evaluate()
    assert state() == [False, False, False]
    sd = tr.model.state_dict()
    assert torch.equal(sd["blocks.1.attn_norm.weight"], layers[1].homes[[id(p) for p in layers[1].params].index(
        id(blocks[1].attn_norm.weight))])


@pytest.mark.parametrize("saver, resumer", [("memory.offload=optimizer+params", "memory.offload=none"),
                                            ("memory.offload=none", "memory.offload=optimizer")])
def test_resume_is_exact_across_offload_settings(reference, tmp_path, saver, resumer):
    first = trainer(tmp_path, saver, "optim.apply_groups=2", f"train.max_steps={STEPS}")
    losses = [first.train_step()["loss"] for _ in range(2)]
    first.save_checkpoint(wait=True)
    resumed = trainer(tmp_path, resumer, "checkpoint.resume=auto", f"train.max_steps={STEPS}")
    assert resumed.step == 2
    more, weights = run(resumed, STEPS - 2)
    assert_same_run(losses + more, reference[0], weights, reference[1])


def test_non_finite_step_is_skipped_with_offload(tmp_path):
    tr = trainer(tmp_path, "memory.offload=optimizer+params", "optim.apply_groups=2")
    tr.train_step()
    masters = {id(p): tr.update.offload.master(p).clone() for p in tr.model.parameters()}
    with torch.no_grad():
        tr.model.final_norm.weight.fill_(float("nan"))  # a resident (not streamed) parameter
    m = tr.train_step()
    assert m["skipped_steps"] == 1 and not math.isfinite(m["loss"])
    for p in tr.model.parameters():
        assert torch.equal(tr.update.offload.master(p), masters[id(p)])  # no update reached the masters
        assert p.grad is None and tr.update.offload.master(p).grad is None


def test_memory_report_matches_the_tensors_of_a_step(tmp_path):
    tr = trainer(tmp_path, "memory.offload=optimizer", "optim.apply_groups=3")
    tr.train_step()
    cfg, model, off = tr.cfg, tr.model, tr.update.offload
    est = estimate_memory(cfg, model, no_decay_ids(model))
    params = list(model.parameters())
    nbytes = lambda ts: sum(t.untyped_storage().nbytes() for t in ts)  # noqa: E731
    state_tensors = [v for s in tr.update.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert est.device["params"] == nbytes(params)
    assert est.host["params"] == nbytes(off.masters_of(params))
    assert est.host["grads"] == nbytes(off._grad_buffers.values())
    assert est.host["optimizer state"] == nbytes(state_tensors)
    # The step's temporaries, measured with the allocation counter of test_optimizer_apply.
    from test_optimizer_apply import LiveBytes

    for p in params:
        off.master(p).grad = torch.randn_like(off.master(p))
    with LiveBytes() as counter:
        tr.update.apply.step()
    assert counter.peak <= est.host["optimizer step temporaries"] + 1024
    assert counter.peak >= est.host["optimizer step temporaries"]
    # The plain run's device update on a CPU (foreach; CUDA's fused AdamW would keep no temporaries).
    plain = estimate_memory(load(None, [*SMALL, f"run.dir={tmp_path}"]), model, no_decay_ids(model), device_type="cpu")
    assert est.host["optimizer step temporaries"] < 0.5 * plain.device["optimizer step temporaries"]
    # On CUDA the device update runs torch's fused AdamW (optim.implementation auto): no temporaries;
    # foreach there keeps the host's.
    on_gpu = {impl: estimate_memory(load(None, [*SMALL, f"run.dir={tmp_path}", f"optim.implementation={impl}"]), model,
                                    no_decay_ids(model), device_type="cuda").device["optimizer step temporaries"]
              for impl in ("auto", "foreach")}
    assert on_gpu == {"auto": 0.0, "foreach": plain.device["optimizer step temporaries"]} and on_gpu["foreach"] > 0
    assert "optimizer state" not in est.device and set(plain.host) == {"checkpoint staging"}
    # The checkpoint staging buffer (async save): one copy of every weight and optimizer tensor,
    # device-resident ones and offloaded host ones alike (the RNG states aside).
    tr.save_checkpoint(wait=True)
    staging = tr.checkpoints.staging
    staged = sum(aligned(s.shape.numel() * s.dtype.itemsize) for k, s in staging.slots.items()
                 if k.startswith(("model/", "optimizer/state/")))
    assert est.host["checkpoint staging"] == plain.host["checkpoint staging"] == staged > 0
    assert staging.nbytes - staged < 16 * 1024  # the rest: this rank's RNG states


def test_inspect_prints_device_and_host_bytes(capsys):
    from m6 import inspect as m6inspect

    assert m6inspect.main([str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"), "memory.offload=optimizer", "optim.apply_groups=4"]) == 0
    out = capsys.readouterr().out
    assert "memory features   optim.apply_groups=4, memory.offload=optimizer," in out
    line = next(l for l in out.splitlines() if l.strip().startswith("optimizer state") and "MiB" in l)
    device, host = line.split()[-4], line.split()[-2]
    assert float(device) == 0.0 and float(host) > 0.0  # moved to the host


def test_offload_blocks_streams_only_the_listed_blocks(tmp_path):
    tr = trainer(tmp_path / "some", "memory.offload=optimizer+params", "memory.offload_blocks=[2,0]")
    streamer = tr.update.offload.streamer
    blocks = list(tr.model.blocks)
    assert [layer.params for layer in streamer.layers] == [
        [p for p in blocks[i].parameters() if p.requires_grad] for i in (0, 2)]
    resident = list(blocks[1].parameters())
    before = [p.untyped_storage().data_ptr() for p in resident]
    tr.train_step()
    assert [p.untyped_storage().data_ptr() for p in resident] == before  # never released nor refetched
    assert all(b.untyped_storage().nbytes() == 0 for layer in streamer.layers for b in layer.buffers)
    # auto on a CPU device: one memory, nothing to stream; said so.
    auto = trainer(tmp_path / "auto", "memory.offload=optimizer+params", "memory.offload_blocks=auto")
    assert auto.update.offload.streamer is None
    # The estimate counts the listed blocks as streamed: the others' weights stay on the device.
    est = {blocks_: estimate_memory(load(None, [*SMALL, "memory.offload=optimizer+params",
                                                f"memory.offload_blocks={blocks_}"]), tr.model, no_decay_ids(tr.model))
           for blocks_ in ("all", "[0,2]", "[0]")}
    sizes = [4 * sum(p.numel() for p in b.parameters()) for b in blocks]
    total = 4 * sum(p.numel() for p in tr.model.parameters())
    # On the device at once: the blocks not streamed + the two streamed ones adjacent in the list
    # (the running one and the prefetched one): streaming 2 of 3 blocks saves nothing at the peak.
    assert est["all"].device["params"] == total - sum(sizes) + max(a + b for a, b in zip(sizes, sizes[1:]))
    assert est["[0,2]"].device["params"] == est["[0]"].device["params"] == total


def test_offload_blocks_bad_index_is_a_config_error_naming_the_key(tmp_path):
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "train.py"), "--config", str(root / "configs" / "tiny.yaml"),
                          "memory.offload=optimizer+params", "memory.offload_blocks=[0,7]", f"run.dir={tmp_path}"],
                         capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "memory.offload_blocks" in out.stderr and "Traceback" not in out.stderr


def test_offload_blocks_auto_keeps_what_fits_the_cuda_memory(tmp_path, monkeypatch):
    """The auto rule on a (pretended) CUDA device of a given size: the estimate decides."""
    from types import SimpleNamespace

    from m6.memory.offload_blocks import AUTO_MEMORY_FRACTION, resolve_offload_blocks

    cfg = load(None, [*SMALL, "memory.offload=optimizer+params", "memory.offload_blocks=auto"])
    tr = trainer(tmp_path, "memory.offload=optimizer+params")
    model, skip = tr.model, no_decay_ids(tr.model)

    def peak(streamed):
        c = load(None, [*SMALL, "memory.offload=optimizer+params", f"memory.offload_blocks={streamed}"])
        return estimate_memory(c, model, skip, 1, 1, "cuda").peak_device

    cuda, lines = torch.device("cuda"), []
    for memory, expected in ((peak([0, 1, 2]) / AUTO_MEMORY_FRACTION, [0, 1, 2]), (1e15, [])):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, m=memory: SimpleNamespace(total_memory=m))
        assert resolve_offload_blocks(cfg, model, skip, 1, 1, cuda, lines.append) == expected
    assert peak([0, 1]) > peak([0, 1, 2])  # so the first device could keep no block resident
    assert "memory.offload_blocks=auto: 0 of 3 blocks stay on the device" in lines[0]
