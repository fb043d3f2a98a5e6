"""Checkpoint tools: ``python -m m6.checkpoint info|export`` on checkpoints written by tiny Trainer
runs, and checkpoint.init_from (weights only; dense -> MoE upcycling)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "smoke"))
from test_train import small_cfg  # noqa: E402  (the smoke tests' tiny-run config)

from m6.batch_format import SEG_PAD  # noqa: E402
from m6.checkpoint import checkpoint_info, export_safetensors  # noqa: E402
from m6.checkpoint.__main__ import main  # noqa: E402
from m6.config import ConfigError  # noqa: E402
from m6.model.flops import count_parameters  # noqa: E402
from m6.checkpoint import sharded_io  # noqa: E402
from m6.checkpoint import CheckpointError, read_checkpoint  # noqa: E402
from m6.checkpoint.init_from import plan_init  # noqa: E402
from m6.train.loop import Trainer  # noqa: E402

safetensors_torch = pytest.importorskip("safetensors.torch")  # the `test` extra

RUN = ["train.max_steps=2", "train.eval_every=0", "checkpoint.async_save=false"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> tuple[Path, Trainer]:
    """A 2-step MoE run (experts in every block) and its one checkpoint."""
    run_dir = tmp_path_factory.mktemp("moe")
    trainer = Trainer(small_cfg(run_dir, *RUN))
    trainer.fit()
    return run_dir, trainer


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory) -> tuple[Path, Trainer]:
    """A 2-step dense run (model.moe.every=0)."""
    run_dir = tmp_path_factory.mktemp("dense")
    trainer = Trainer(small_cfg(run_dir, *RUN, "model.moe.every=0"))
    trainer.fit()
    return run_dir, trainer


def _step_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step_00000002"


def _saved_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(_step_dir(run_dir))["model"]


# --------------------------------------------------------------------------- info


def test_info_summarises_without_reading_tensors(moe_run, monkeypatch, capsys):
    run_dir, trainer = moe_run
    ckpt = _step_dir(run_dir)
    requested = []
    real_read = sharded_io.read

    def recording_read(path, targets, shards, group=None):
        requested.extend((k, v) for k, v in targets.items())
        return real_read(path, targets, shards, group)

    monkeypatch.setattr(sharded_io, "read", recording_read)
    for form in (run_dir, run_dir / "checkpoints", ckpt, ckpt / ".metadata"):
        assert checkpoint_info(form)["path"] == str(ckpt)
    assert requested and all(v is None for _, v in requested), [k for k, v in requested if v is not None]

    info = checkpoint_info(run_dir)
    size = count_parameters(trainer.model)
    assert info["step"] == 2 and info["world_size"] == 1 and info["expert_parallel_size"] == 1
    assert info["model"]["d_model"] == 64 and info["model"]["num_layers"] == 2
    assert info["model"]["moe"]["num_experts"] == 4 and info["num_moe_layers"] == 2
    assert info["total_params"] == size.total and info["expert_params"] == size.expert > 0
    assert info["size_bytes"] == sum(p.stat().st_size for p in ckpt.iterdir()) > 0
    assert info["num_data_files"] == 1 and info["has_optimizer_state"] is True
    assert info["dtypes"] == ["float32"]

    assert main(["info", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "step             2" in out and "world size 1, expert-parallel size 1" in out
    assert "d_model 64, 2 layers" in out and "4 per MoE layer (top-2) in 2 of 2 layers" in out
    assert f"{size.total:,} ({size.expert:,} in experts)" in out
    assert f"{info['size_bytes']:,} bytes" in out and "in 1 data file" in out and "optimizer state  yes" in out
    assert main(["info", str(ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(info))


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "run" / "checkpoints" / ".tmp-step_00000004").mkdir(parents=True)  # an unfinished save only
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ".metadata").write_bytes(b"not a pickle")
    cases = {tmp_path / "nowhere": "does not exist", tmp_path / "empty": "has no .metadata",
             tmp_path / "run": "holds no complete checkpoint", tmp_path / "bad": ".metadata is corrupt"}
    for path, message in cases.items():
        for argv in (["info", str(path)], ["export", str(path), str(tmp_path / "out.safetensors")]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temporary left behind


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_export_round_trip_streams_one_tensor_at_a_time(moe_run, tmp_path, monkeypatch, dtype):
    run_dir, _ = moe_run
    saved = _saved_model(run_dir)
    requested_bytes = []  # per sharded_io.read call: bytes of the tensors it was asked to fill
    real_read = sharded_io.read

    def recording_read(path, targets, shards, group=None):
        requested_bytes.append(sum(v.numel() * v.element_size() for v in targets.values() if torch.is_tensor(v)))
        return real_read(path, targets, shards, group)

    monkeypatch.setattr(sharded_io, "read", recording_read)
    out = tmp_path / "model.safetensors"
    argv = ["export", str(run_dir), str(out)] + (["--dtype", dtype] if dtype else [])
    assert main(argv) == 0

    loaded = safetensors_torch.load_file(str(out))
    assert set(loaded) == set(saved)
    assert loaded["blocks.0.ffn.experts.w_in"].shape == (4, 64, 128)  # experts at global shape
    want = torch.bfloat16 if dtype == "bf16" else torch.float32
    for name, t in saved.items():
        assert loaded[name].dtype == want and loaded[name].shape == t.shape, name
        assert torch.equal(loaded[name], t.to(want)), name

    tensor_reads = [b for b in requested_bytes if b]
    sizes = [t.numel() * t.element_size() for t in saved.values()]
    assert len(tensor_reads) == len(saved)  # one read per tensor ...
    assert max(tensor_reads) == max(sizes) < sum(sizes) / 4  # ... never more than the largest one
    assert out.stat().st_size > sum(sizes) * want.itemsize / 4


def test_export_header_is_aligned_and_complete(moe_run, tmp_path):
    run_dir, _ = moe_run
    done = export_safetensors(run_dir, tmp_path / "m.safetensors")
    raw = (tmp_path / "m.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and header["__metadata__"]["step"] == "2" and done["step"] == 2
    # Self-describing: the run's resolved config builds the model these weights fit, and the
    # tokenizer its ids belong to is named.
    config = json.loads(header["__metadata__"]["config"])
    assert config["model"]["d_model"] == 64 and config["model"]["moe"]["num_experts"] == 4
    assert header["__metadata__"]["tokenizer"] == "byte"
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert 8 + n + spans[-1][1] == len(raw) == done["size_bytes"]


# --------------------------------------------------------------------------- init_from


def test_init_from_loads_weights_only_and_resume_wins(moe_run, tmp_path, capsys):
    src_dir, _ = moe_run
    saved = _saved_model(src_dir)
    fresh = Trainer(small_cfg(tmp_path / "fresh", *RUN))
    capsys.readouterr()
    init = Trainer(small_cfg(tmp_path / "init", *RUN, f"checkpoint.init_from={src_dir}"))
    out = capsys.readouterr().out
    assert f"model weights initialised from {_step_dir(src_dir)} (step 2 of that run)" in out

    assert init.step == 0
    weights = init.model.state_dict()
    assert set(weights) == set(saved) and all(torch.equal(weights[k], saved[k]) for k in saved)
    assert not torch.equal(fresh.model.state_dict()["blocks.0.ffn.experts.w_in"], saved["blocks.0.ffn.experts.w_in"])
    assert all(not s for s in init.update.optimizer.state.values())  # no Adam moments yet
    assert init.update.lr == fresh.update.lr
    assert init.update.scheduler.state_dict() == fresh.update.scheduler.state_dict()
    assert init.loader.state_dict() == fresh.loader.state_dict()

    init.fit()
    after = {k: v.clone() for k, v in init.model.state_dict().items()}
    resumed = Trainer(small_cfg(tmp_path / "init", *RUN, "checkpoint.resume=auto", f"checkpoint.init_from={src_dir}"))
    out = capsys.readouterr().out
    assert "not used: resuming from" in out and "(resume wins)" in out and "initialised from" not in out
    assert resumed.step == 2
    assert all(torch.equal(v, after[k]) for k, v in resumed.model.state_dict().items())


def test_init_from_a_different_shape_lists_the_differences(moe_run, tmp_path):
    src_dir, _ = moe_run
    with pytest.raises(CheckpointError, match=r"do not fit this model") as err:
        Trainer(small_cfg(tmp_path, *RUN, "model.moe.num_experts=8", f"checkpoint.init_from={src_dir}"))
    assert "blocks.0.ffn.experts.w_in: checkpoint [4, 64, 128] vs model [8, 64, 128]" in str(err.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        Trainer(small_cfg(tmp_path, *RUN, f"checkpoint.init_from={tmp_path / 'nowhere'}"))
    for bad in ("''", "' '"):
        with pytest.raises(ConfigError, match="checkpoint.init_from"):
            small_cfg(tmp_path, f"checkpoint.init_from={bad}")


def test_plan_init_refuses_what_cannot_be_upcycled():
    dense = {"blocks.0.ffn.fc_in.weight": torch.Size([16, 8]), "blocks.0.ffn.fc_in.bias": torch.Size([16]),
             "blocks.0.ffn.fc_out.weight": torch.Size([8, 16]), "blocks.0.ffn.fc_out.bias": torch.Size([8])}
    moe = {"blocks.0.ffn.router.weight": torch.Size([4, 8]), "blocks.0.ffn.experts.w_in": torch.Size([4, 8, 16]),
           "blocks.0.ffn.experts.w_out": torch.Size([4, 16, 8])}
    plan = plan_init(moe, dense, "x")
    assert plan.upcycled == ["blocks.0.ffn."] and plan.by_name == [] and plan.fresh == ["blocks.0.ffn.router.weight"]
    assert plan.dropped == ["blocks.0.ffn.fc_in.bias", "blocks.0.ffn.fc_out.bias"]
    with pytest.raises(CheckpointError, match=r"fc_in.weight: checkpoint \[16, 8\] cannot fill .*needs \[32, 8\]"):
        plan_init({**moe, "blocks.0.ffn.experts.w_in": torch.Size([4, 8, 32])}, dense, "x")
    with pytest.raises(CheckpointError, match="SwiGLU experts cannot be upcycled"):
        plan_init({**moe, "blocks.0.ffn.experts.w_gate": torch.Size([4, 8, 16])}, dense, "x")
    swiglu = {**dense, "blocks.0.ffn.fc_gate.weight": torch.Size([16, 8])}
    with pytest.raises(CheckpointError, match="cannot be upcycled into GELU experts"):
        plan_init(moe, swiglu, "x")
    plan = plan_init({**moe, "blocks.0.ffn.experts.w_gate": torch.Size([4, 8, 16])}, swiglu, "x")
    assert plan.upcycled == ["blocks.0.ffn."] and plan.by_name == []
    with pytest.raises(CheckpointError, match=r"fc_gate.weight: checkpoint \[16, 8\] cannot fill"):
        plan_init({**moe, "blocks.0.ffn.experts.w_gate": torch.Size([4, 8, 32]),
                   "blocks.0.ffn.experts.w_in": torch.Size([4, 8, 32]), "blocks.0.ffn.experts.w_out": torch.Size([4, 32, 8])},
                  {**swiglu, "blocks.0.ffn.fc_in.weight": torch.Size([32, 8]), "blocks.0.ffn.fc_out.weight": torch.Size([8, 32])}, "x")
    with pytest.raises(CheckpointError, match="missing in checkpoint: final_norm.weight"):
        plan_init({**moe, "final_norm.weight": torch.Size([8])}, dense, "x")


# --------------------------------------------------------------------------- upcycling


def test_upcycling_dense_to_moe(dense_run, tmp_path, capsys):
    src_dir, dense_trainer = dense_run
    saved = _saved_model(src_dir)
    # top-1 with normalized weights: every token's combine weight is p/p = 1 exactly; dropless, so
    # no token loses its FFN to capacity.
    moe_args = [*RUN, "model.moe.every=1", "model.moe.top_k=1", "model.moe.capacity_factor=null"]
    capsys.readouterr()
    moe = Trainer(small_cfg(tmp_path / "moe", *moe_args, f"checkpoint.init_from={src_dir}"))
    out = capsys.readouterr().out
    assert "upcycled the dense FFN of blocks.0, blocks.1 into every expert" in out
    assert ("warning: checkpoint.init_from: dropped dense FFN biases that experts do not have: "
            "blocks.0.ffn.fc_in.bias, blocks.0.ffn.fc_out.bias, blocks.1.ffn.fc_in.bias, blocks.1.ffn.fc_out.bias"
            in out)

    fresh = Trainer(small_cfg(tmp_path / "fresh", *moe_args))
    weights, fresh_weights = moe.model.state_dict(), fresh.model.state_dict()
    for i in range(2):
        ffn = f"blocks.{i}.ffn."
        w_in, w_out = weights[f"{ffn}experts.w_in"], weights[f"{ffn}experts.w_out"]
        assert w_in.shape == (4, 64, 128) and w_out.shape == (4, 128, 64)
        for e in range(4):
            assert torch.equal(w_in[e], saved[f"{ffn}fc_in.weight"].t())  # [D, F] <- [F, D]
            assert torch.equal(w_out[e], saved[f"{ffn}fc_out.weight"].t())  # [F, D] <- [D, F]
        assert torch.equal(weights[f"{ffn}router.weight"], fresh_weights[f"{ffn}router.weight"])  # fresh init
    shared = [k for k in weights if ".ffn." not in k]
    assert shared and all(torch.equal(weights[k], saved[k]) for k in shared)

    # The MoE model computes the dense model without its FFN biases.
    dense = dense_trainer.model
    assert all(torch.equal(v, saved[k]) for k, v in dense.state_dict().items())  # the checkpoint's weights
    with torch.no_grad():
        for i in range(2):
            for fc in (dense.blocks[i].ffn.fc_in, dense.blocks[i].ffn.fc_out):
                assert fc.bias.abs().sum() > 0  # zeroing them below is a real change
                fc.bias.zero_()
    batch = moe.held_out_batch(list(range(8)))
    dense.eval(), moe.model.eval()
    with torch.no_grad():
        inputs = (batch.images, batch.has_image, batch.text_ids, batch.segment_ids)
        hidden_dense, _ = dense(*inputs)
        hidden_moe, _ = moe.model(*inputs)
        loss_dense = dense.target_loss_sum(hidden_dense, batch.labels)
        loss_moe = moe.model.target_loss_sum(hidden_moe, batch.labels)
    real = batch.segment_ids != SEG_PAD  # padding gets no FFN in an MoE layer (masked from routing)
    assert real.sum() > 0 and (~real).sum() > 0
    # Equal up to fp32 rounding, not bitwise in general: the routing is exact (weights p/p = 1,
    # dropless), but the experts' GEMMs (x[rows of expert e] @ w_in[e], a contiguous [D, F] copy)
    # and the dense Linear (x @ W.T + 0 over all rows) may run different kernels and blockings, so
    # the last bits can differ (on the CPU this was written on, one layer on 37 random rows differed
    # by ~6e-9 while this whole-model batch happened to match bitwise).
    torch.testing.assert_close(hidden_moe[real], hidden_dense[real], rtol=1e-5, atol=1e-5)
    assert math.isclose(loss_moe.item(), loss_dense.item(), rel_tol=1e-5)
    assert hidden_dense[real].abs().max() > 1e-1  # the comparison is not between near-zero values
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe.model.blocks[0].ffn(x)[0], dense.blocks[0].ffn(x), rtol=1e-5, atol=1e-6)


def test_upcycling_a_swiglu_dense_model_into_swiglu_experts(tmp_path):
    """model.ffn_activation=swiglu -> model.moe.activation=swiglu: every expert gets fc_in, fc_gate
    and fc_out transposed, and the dense blocks' other weights (RMSNorm, GQA attention) by name."""
    arch = ["model.linear_bias=false", "model.norm=rmsnorm", "model.positions=rope", "model.num_kv_heads=1",
            "model.ffn_activation=swiglu"]
    dense = Trainer(small_cfg(tmp_path / "dense", *RUN, *arch, "model.moe.every=0"))
    dense.fit()
    saved = _saved_model(tmp_path / "dense")
    moe = Trainer(small_cfg(tmp_path / "moe", *RUN, *arch, "model.moe.every=1", "model.moe.activation=swiglu",
                            f"checkpoint.init_from={tmp_path / 'dense'}"))
    weights = moe.model.state_dict()
    for i in range(2):
        ffn = f"blocks.{i}.ffn."
        for dense_key, expert_key in (("fc_in", "w_in"), ("fc_gate", "w_gate"), ("fc_out", "w_out")):
            w = weights[f"{ffn}experts.{expert_key}"]
            assert all(torch.equal(w[e], saved[f"{ffn}{dense_key}.weight"].t()) for e in range(w.shape[0]))
    assert torch.equal(weights["blocks.1.attn.qkv.weight"], saved["blocks.1.attn.qkv.weight"])
