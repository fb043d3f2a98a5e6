"""The m6 config schema (m6.config): shipped configs, overrides, dump/reload, the errors a user sees
(each naming the keys involved) and the derived values.

The generic loader machinery is tested on its own schema in test_config_loader.py; here the real
schema and Config.validate() are under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from m6 import config as m6config
from m6.config import (
    Config,
    ConfigError,
    ModelConfig,
    MoEConfig,
    TrainConfig,
    accumulation_steps,
    dump_yaml,
    expert_ffn_dim,
    load,
    micro_batch_size,
    num_patches,
)

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(CONFIGS_DIR.glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def load_error(tmp_path: Path, yaml_text: str = "", overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, yaml_text), list(overrides))
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# Shipped configs, overrides, round trip


def test_configs_dir_is_not_empty():
    assert {p.name for p in SHIPPED} >= {"tiny.yaml", "m6-10t.yaml", "m6-1t.yaml", "m6-100b.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    cfg = load(path)
    assert isinstance(cfg, Config)
    cfg.validate()


def test_shipped_config_values_are_read():
    cfg = load(CONFIGS_DIR / "m6-10t.yaml")
    assert (cfg.model.num_layers, cfg.model.d_model, cfg.model.ffn_dim) == (48, 1024, 9984)
    assert (cfg.model.moe.num_experts, cfg.model.moe.num_prototypes, cfg.model.moe.top_k) == (10240, 80, 1)
    assert cfg.optim.lr == 1.0e-4 and isinstance(cfg.optim.lr, float)


def test_empty_file_and_no_file_give_defaults(tmp_path):
    assert load(write(tmp_path, "")) == Config()
    assert load(None) == Config()


def test_overrides_are_applied():
    base = load(CONFIGS_DIR / "tiny.yaml")
    cfg = load(CONFIGS_DIR / "tiny.yaml", ["model.moe.num_experts=16", "train.max_steps=50"])
    assert cfg.model.moe.num_experts == 16 and base.model.moe.num_experts == 8
    assert cfg.train.max_steps == 50 and base.train.max_steps == 300
    assert cfg.model.d_model == base.model.d_model  # everything else as in the file


def test_override_of_a_float_and_a_null(tmp_path):
    cfg = load(write(tmp_path, "optim: {lr: 0.01}\n"), ["optim.lr=2e-3", "model.moe.capacity_factor=null"])
    assert cfg.optim.lr == 2e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.model.moe.capacity_factor is None


def test_override_is_validated(tmp_path):
    msg = load_error(tmp_path, "", ["model.moe.top_k=9"])
    assert "model.moe.top_k" in msg and "model.moe.num_experts" in msg


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_resolved_config_dumps_and_reloads_equal(tmp_path, path):
    cfg = load(path, ["model.moe.num_experts=16", "train.max_steps=50", "logging.wandb.tags=[a, b]",
                      "model.moe.num_prototypes=1", "model.moe.top_k=2"])
    out = tmp_path / "resolved.yaml"
    dump_yaml(cfg, out)
    again = load(out)
    assert again == cfg
    assert again.model.moe.num_experts == 16 and again.logging.wandb.tags == ["a", "b"]


# ---------------------------------------------------------------------------------------------
# Errors name keys


def test_unknown_key_suggests_the_nearest(tmp_path):
    msg = load_error(tmp_path, "model:\n  moe:\n    num_expert: 16\n")
    assert "model.moe.num_expert" in msg and "did you mean 'model.moe.num_experts'" in msg


def test_unknown_key_in_override_suggests_the_nearest(tmp_path):
    msg = load_error(tmp_path, "", ["model.moe.num_expert=16"])
    assert "model.moe.num_expert" in msg and "model.moe.num_experts" in msg


def test_unknown_section_suggests_the_nearest(tmp_path):
    msg = load_error(tmp_path, "modle:\n  d_model: 64\n")
    assert "'modle'" in msg and "'model'" in msg


@pytest.mark.parametrize(
    "yaml_text, key, value, expected",
    [
        ("model:\n  d_model: big\n", "model.d_model", "'big'", "int"),
        ("model:\n  num_layers: 2.5\n", "model.num_layers", "2.5", "int"),
        ("model:\n  num_layers: true\n", "model.num_layers", "True", "int"),
        ("optim:\n  lr: fast\n", "optim.lr", "'fast'", "float"),
        ("model:\n  moe:\n    capacity_factor: high\n", "model.moe.capacity_factor", "'high'", "float | None"),
        ("model:\n  patch_embed: mlp\n", "model.patch_embed", "'mlp'", "'linear', 'conv'"),
        ("train:\n  micro_batch_size: [4]\n", "train.micro_batch_size", "[4]", "int"),
        ("model: 3\n", "model", "3", "mapping"),
    ],
)
def test_wrong_type_names_key_value_and_expected_type(tmp_path, yaml_text, key, value, expected):
    msg = load_error(tmp_path, yaml_text)
    assert key in msg and value in msg and expected in msg, msg


def test_wrong_type_in_override_names_the_key(tmp_path):
    msg = load_error(tmp_path, "", ["train.max_steps=many"])
    assert "train.max_steps" in msg and "'many'" in msg and "int" in msg


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["model.moe.num_experts=8", "model.moe.top_k=9"], ["model.moe.top_k", "model.moe.num_experts"]),
        (["model.moe.num_experts=8", "model.moe.num_prototypes=4", "model.moe.top_k=3"],
         ["model.moe.top_k", "model.moe.num_experts", "model.moe.num_prototypes"]),
        (["model.d_model=130", "model.num_heads=4"], ["model.d_model", "model.num_heads"]),
        (["model.image_size=30", "model.patch_size=8"], ["model.image_size", "model.patch_size"]),
        (["model.moe.num_experts=8", "model.moe.num_prototypes=3", "model.moe.top_k=1"],
         ["model.moe.num_experts", "model.moe.num_prototypes"]),
        (["data.seq_len=200", "model.max_text_len=128"], ["data.seq_len", "model.max_text_len"]),
        (["train.global_batch_size=32", "train.micro_batch_size=5"],
         ["train.micro_batch_size", "train.global_batch_size"]),
        (["optim.lr=1e-3", "optim.min_lr=1e-2"], ["optim.min_lr", "optim.lr"]),
        (["model.vocab_size=100"], ["model.vocab_size"]),
        # torch's CUDA grouped GEMM is fused only in bf16 (fp32 loops with a host sync per GEMM).
        (["model.moe.expert_kernel=grouped_mm", "train.precision=fp32", "train.device=cuda"],
         ["model.moe.expert_kernel", "train.precision", "train.device"]),
    ],
)
def test_impossible_combinations_name_every_key(tmp_path, overrides, keys):
    msg = load_error(tmp_path, "", overrides)
    for key in keys:
        assert key in msg, (key, msg)


def test_valid_neighbours_of_the_impossible_combinations_load(tmp_path):
    # The boundary cases are allowed: the checks above reject only what is truly impossible.
    cfg = load(write(tmp_path, ""), [
        "model.moe.num_experts=8", "model.moe.num_prototypes=4", "model.moe.top_k=2",
        "model.d_model=132", "model.num_heads=4", "model.image_size=24", "model.patch_size=8",
        "data.seq_len=128", "model.max_text_len=128", "train.global_batch_size=30",
        "train.micro_batch_size=5", "optim.lr=1e-3", "optim.min_lr=1e-3",
    ])
    assert cfg.model.moe.top_k == 2


@pytest.mark.parametrize(
    "key",
    ["model.vocab_size", "model.d_model", "model.num_layers", "model.num_heads", "model.ffn_dim",
     "model.max_text_len", "model.image_size", "model.patch_size", "model.image_channels",
     "model.moe.num_experts", "model.moe.top_k", "model.moe.num_prototypes", "model.moe.ffn_dim",
     "model.moe.capacity_factor", "data.num_samples", "data.seq_len", "train.max_steps",
     "train.global_batch_size", "train.micro_batch_size", "train.eval_batches", "logging.every",
     "checkpoint.keep", "optim.lr"],
)
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes_are_rejected_by_name(tmp_path, key, value):
    msg = load_error(tmp_path, "", [f"{key}={value}"])
    assert key in msg, msg


@pytest.mark.parametrize(
    "key",
    ["model.moe.every", "model.moe.min_capacity", "optim.warmup_steps", "optim.weight_decay",
     "train.grad_clip", "model.moe.aux_loss_coef", "model.moe.router_jitter", "optim.min_lr"],
)
def test_negative_counts_and_coefficients_are_rejected_by_name(tmp_path, key):
    msg = load_error(tmp_path, "", [f"{key}=-1"])
    assert key in msg, msg


def test_zero_is_allowed_where_it_means_off(tmp_path):
    cfg = load(write(tmp_path, ""), ["model.moe.every=0", "train.grad_clip=0", "train.eval_every=0",
                                     "checkpoint.every=0", "optim.warmup_steps=0", "optim.min_lr=0"])
    assert cfg.model.moe.every == 0


@pytest.mark.parametrize("override", ["optim.beta1=1.5", "optim.beta2=-0.1", "optim.eps=-1",
                                      "model.norm_eps=-1", "model.init_std=-1"])
def test_optimizer_and_init_settings_out_of_range_are_rejected_by_name(tmp_path, override):
    key = override.partition("=")[0]
    msg = load_error(tmp_path, "", [override])
    assert key in msg, msg


# ---------------------------------------------------------------------------------------------
# Derived values


def test_accumulation_and_micro_batch_size():
    assert micro_batch_size(TrainConfig(global_batch_size=32, micro_batch_size=8)) == 8
    assert accumulation_steps(TrainConfig(global_batch_size=32, micro_batch_size=8)) == 4
    assert micro_batch_size(TrainConfig(global_batch_size=32, micro_batch_size=None)) == 32
    assert accumulation_steps(TrainConfig(global_batch_size=32, micro_batch_size=None)) == 1
    assert accumulation_steps(load(CONFIGS_DIR / "m6-10t.yaml").train) == 512


def test_num_patches_and_expert_ffn_dim():
    assert num_patches(ModelConfig(image_size=32, patch_size=8)) == 16
    assert num_patches(ModelConfig(image_size=224, patch_size=16)) == 196
    assert expert_ffn_dim(ModelConfig(ffn_dim=512, moe=MoEConfig(ffn_dim=None))) == 512
    assert expert_ffn_dim(ModelConfig(ffn_dim=512, moe=MoEConfig(ffn_dim=96))) == 96


def test_run_dir_defaults_to_runs_name():
    cfg = Config()
    cfg.run.name = "abc"
    assert Path(m6config.run_dir(cfg)) == Path("runs") / "abc"
    cfg.run.dir = "/tmp/x"
    assert m6config.run_dir(cfg) == "/tmp/x"
