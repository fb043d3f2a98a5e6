"""train.compile=blocks: each block's dense parts under torch.compile (inductor on CPU) train as
eager does, keep the parameter names (checkpoints load either way), and a compile failure stops
with one clear line. The MoE layers stay eager."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from m6.config import ConfigError, load
from m6.parallel.compile import _layer_norm_forward as compile_module_forward
from m6.model.flops import ModelSize
from m6.train.banner import RunFacts, compile_time_line, startup_banner
from m6.train.loop import Trainer

# Tiny: block 0 dense, block 1 dropless MoE; dropout 0 (inductor draws its own random numbers, so
# dropout masks would differ from eager's); recompute of every part (the compiled regions run
# again in backward under the checkpoint wrappers); no eval (eval mode compiles again).
TRAIN = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=40",
         "model.image_size=16", "model.patch_size=8", "model.moe.every=2", "model.moe.num_experts=4",
         "model.moe.capacity_factor=null", "model.dropout=0.0", "data.kind=synthetic", "data.num_samples=64",
         "data.eval_samples=0", "data.seq_len=32", "data.num_workers=0", "train.global_batch_size=4",
         "train.max_steps=3", "train.device=cpu", "logging.console=false", "logging.every=1", "checkpoint.every=0",
         "memory.activation_checkpointing=full"]


FACTS = RunFacts(world_size=1, expert_parallel_size=1, micro_batch=4, accumulation=1, device=torch.device("cpu"),
                 precision="fp32", size=ModelSize(1000, 500, 100, 600), moe_blocks=[1], source_records=[64],
                 tokenizer="byte (vocab 261)", run_dir=Path("/tmp/run"), start="fresh start", wandb=None)


def _cfg(run_dir, *extra: str):
    return load(None, [*TRAIN, f"run.dir={run_dir}", *extra])


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-5), ("bf16", 1e-3)])
def test_compiled_blocks_train_as_eager_and_checkpoints_load_either_way(tmp_path, capsys, precision, rtol):
    """Three steps eager and compiled (with recompute) give the same losses; the state dict's keys
    are the eager ones, and a checkpoint of either loads into the other; fp32 also with the blocks'
    parameters offloaded. Over 30 s: inductor
    compiles the attention, norm and MLP graphs, forward and backward, in C++ (measured on the
    shared 2-core machine, inductor's on-disk cache warm: fp32 47 s, bf16 25 s; with it empty
    fp32 113 s before the two offload runs (15 s) were added, bf16 65 s); one compiled run is what
    the test is about."""
    extra = [f"train.precision={precision}"]
    eager = Trainer(_cfg(tmp_path / "eager", *extra))
    eager_history = eager.fit()
    compiled = Trainer(_cfg(tmp_path / "compiled", *extra, "train.compile=blocks"))
    out = capsys.readouterr().out
    assert "compile  blocks (2 blocks: attention sub-block, FFN norm and dense MLP; torch.compile, inductor; MoE " \
           "layers eager)" in out
    compiled_history = compiled.fit()
    out = capsys.readouterr().out
    assert "compile: blocks compiled in " in out and "during step 1" in out, out
    assert type(compiled.model.blocks[0]).__name__ == "CompiledTransformerBlock"
    assert type(compiled.model.blocks[0].ffn).__name__ == "CompiledDenseMLP"
    assert type(compiled.model.blocks[1].ffn).__name__ == "MoELayer"  # eager

    for key in ("loss", "lm_loss", "grad_norm"):
        torch.testing.assert_close([h[key] for h in compiled_history], [h[key] for h in eager_history],
                                   rtol=rtol, atol=0, msg=key)
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    assert all("_orig_mod" not in k for k in compiled.model.state_dict())
    if precision != "fp32":
        return
    # The two runs' parameters after three steps agree (fp32) and each checkpoint loads into the other mode.
    eager_params, compiled_params = _params(eager), _params(compiled)
    for name, value in eager_params.items():
        torch.testing.assert_close(compiled_params[name], value, rtol=1e-4, atol=1e-6, msg=name)
    for saved, mode, want in ((tmp_path / "compiled", [], compiled_params),
                              (tmp_path / "eager", ["train.compile=blocks"], eager_params)):
        step_dir = saved / "checkpoints" / "step_00000003"
        loaded = Trainer(_cfg(tmp_path / f"from_{saved.name}", *extra, *mode, f"checkpoint.init_from={step_dir}"))
        for name, value in _params(loaded).items():
            assert torch.equal(value, want[name]), (saved.name, name)
    # Offloaded parameters (host homes swapped in and out around each block by module hooks) too.
    offload = ["memory.offload=optimizer+params", "checkpoint.enabled=false"]
    runs = [Trainer(_cfg(tmp_path / f"offload{i}", *extra, *offload, *mode)).fit()
            for i, mode in enumerate(([], ["train.compile=blocks"]))]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([h[key] for h in runs[1]], [h[key] for h in runs[0]], rtol=rtol, atol=0, msg=key)


@pytest.mark.parametrize("cast_on_use", [False, True])
def test_each_compiled_region_is_one_graph(cast_on_use):
    """No graph breaks in the compiled regions, plain fp32 or under bf16 cast-on-use (its custom
    autograd Functions traced): a break would split a region and fall back to eager between the
    pieces. torch._dynamo.explain traces only (no inductor), so this is quick."""
    import torch._dynamo
    from m6.config import ModelConfig, MoEConfig
    from m6.model import M6Model
    from m6.model.cast_on_use import set_cast_on_use
    model = M6Model(ModelConfig(d_model=16, num_layers=1, num_heads=2, ffn_dim=32, max_text_len=8, image_size=8,
                                patch_size=8, moe=MoEConfig(every=0)))  # a dense block
    set_cast_on_use(model, cast_on_use)
    block = model.blocks[0]
    x = torch.randn(2, 4, 16, requires_grad=True)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    regions = {"attention": (type(block).attention_residual, (block, x, mask)),
               "ffn_norm": (compile_module_forward, (block.ffn_norm, x)),
               "mlp": (type(block.ffn).forward, (block.ffn, x))}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast_on_use, cache_enabled=False):
        for name, (fn, args) in regions.items():
            explained = torch._dynamo.explain(fn)(*args)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), (name, explained.break_reasons)


def test_compile_failure_is_one_clear_error(monkeypatch, tmp_path, capsys):
    """A backend that cannot compile (here: inductor's C++ compiler missing) raises CompileFailed
    naming the key and the region, and train.py prints it as one line with exit code 1."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from m6.train.cli import main
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/c++",))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)  # a cached graph would need no compiler
    monkeypatch.setattr(inductor_config, "autotune_local_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    torch._dynamo.reset()
    try:
        code = main(["--config", str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"), *TRAIN, "data.sources=[]", f"run.dir={tmp_path}",
                     "train.compile=blocks", "memory.activation_checkpointing=none"])
    finally:
        torch._dynamo.reset()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith("error: train.compile=blocks: torch.compile failed on "
                                               "TransformerBlock.attention_residual ("), err
    assert err[0].endswith("train.compile=false runs eager"), err


def test_compile_lines_say_what_compiles_and_when():
    cfg = load(None, ["train.compile=blocks", "model.num_layers=3", "model.moe.every=1"])
    line = startup_banner(cfg, dataclasses.replace(FACTS, moe_blocks=[0, 1, 2]))
    assert ("compile  blocks (3 blocks: attention sub-block, FFN norm; torch.compile, inductor; MoE layers eager); "
            "compiled lazily in the first step, its compile time printed after it") in line
    assert "compile  " not in startup_banner(load(None, []), FACTS)
    assert compile_time_line(1, 12.34, 20.0, first=True).startswith("compile: blocks compiled in 12.3 s during step 1")
    assert compile_time_line(7, 2.0, 3.0, first=False).startswith("compile: 2.0 s more compiling by step 7")


def test_compile_key_takes_false_or_blocks():
    assert load(None, []).train.compile is False
    assert load(None, ["train.compile=blocks"]).train.compile == "blocks"
    for bad in ("true", "full"):
        with pytest.raises(ConfigError, match="train.compile"):
            load(None, [f"train.compile={bad}"])
