"""m6.inspect and m6.model.flops: the giant configs are counted on `meta` to their advertised sizes,
and on small real models the counts and FLOPs equal a count made by hand.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import pytest

from m6 import config as m6config
from m6 import inspect as m6inspect
from m6.config import ModelConfig, MoEConfig
from m6.model import M6Model, build_meta_model
from m6.model.flops import count_parameters, training_flops_per_token

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
M6_10T_EXPERT_PARAMS = 48 * 10240 * 2 * 1024 * 9984  # layers x experts x (w_in + w_out) x D x F


@pytest.fixture(scope="module")
def report_10t() -> dict:
    return m6inspect.report(m6config.load(CONFIGS_DIR / "m6-10t.yaml"))


def test_10t_config_counts_ten_trillion(report_10t):
    r = report_10t
    assert 9.5e12 <= r["total_params"] <= 10.5e12
    assert r["expert_params"] == M6_10T_EXPERT_PARAMS
    assert r["moe_layers"] == 48
    assert r["active_params"] < 0.02 * r["total_params"]  # 80 of 10,240 experts per token
    assert r["active_params"] > 80 / 10240 * r["expert_params"]  # the trunk is active too
    assert r["flops_per_token"] > 6 * r["active_params"]


def test_inspect_main_prints_the_10t_counts(report_10t, capsys):
    assert m6inspect.main([str(CONFIGS_DIR / "m6-10t.yaml")]) == 0
    out = capsys.readouterr().out
    match = re.search(r"total params\s+(\S+) \(([\d,]+)\)", out)
    assert match, out
    assert match.group(1).endswith("T")
    assert int(match.group(2).replace(",", "")) == report_10t["total_params"]
    assert re.search(r"expert params\s+10\.05T", out), out
    assert "48 layers x 10240 experts" in out


@pytest.mark.parametrize("name, low, high", [("m6-1t.yaml", 0.9e12, 1.1e12), ("m6-100b.yaml", 0.9e11, 1.1e11)])
def test_1t_and_100b_configs(name, low, high):
    cfg = m6config.load(CONFIGS_DIR / name)
    r = m6inspect.report(cfg)
    assert low <= r["total_params"] <= high
    m, moe = cfg.model, cfg.model.moe
    assert r["expert_params"] == m.num_layers * moe.num_experts * 2 * m.d_model * m.ffn_dim
    assert r["active_params"] < 0.05 * r["total_params"]


def test_main_reports_a_config_error_with_its_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: 130\n  num_heads: 4\n")
    assert m6inspect.main([str(bad)]) == 2
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "config error:" in text and "model.d_model" in text and "model.num_heads" in text
    assert "total params" not in text


def test_main_reports_a_bad_override_with_its_key(capsys):
    assert m6inspect.main([str(CONFIGS_DIR / "tiny.yaml"), "model.moe.num_expert=3"]) == 2
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "config error:" in text and "model.moe.num_experts" in text


# ---------------------------------------------------------------------------------------------
# Small real models against a hand count


def small_cfg(**overrides) -> ModelConfig:
    moe = overrides.pop("moe", {})
    base = dict(vocab_size=261, d_model=16, num_layers=2, num_heads=2, ffn_dim=32, max_text_len=24,
                image_size=16, patch_size=8, moe=MoEConfig(**{"every": 1, "num_experts": 4, "top_k": 2, **moe}))
    base.update(overrides)
    return ModelConfig(**base)


SMALL_CFGS = {
    "moe-every-1": small_cfg(),
    "moe-every-2-untied": small_cfg(num_layers=4, tie_embeddings=False, moe={"every": 2}),
    "prototypes-swiglu": small_cfg(moe={"num_experts": 6, "num_prototypes": 3, "top_k": 1,
                                        "activation": "swiglu", "ffn_dim": 8}),
    "dense-conv": small_cfg(patch_embed="conv", moe={"every": 0}),
}


@pytest.mark.parametrize("name", SMALL_CFGS)
def test_count_parameters_matches_the_module_tree(name):
    cfg = SMALL_CFGS[name]
    model = M6Model(cfg)
    size = count_parameters(model)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    expert = sum(p.numel() for n, p in params.items() if ".ffn.experts." in n)
    embedding_names = ["text_embed.tokens.weight", "text_embed.positions.weight", "patch_embed.rows.weight",
                       "patch_embed.cols.weight", "modality.weight"]
    embedding = sum(params[n].numel() for n in embedding_names)
    head = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0  # untied: lm_head is in total
    k_over_e = Fraction(cfg.moe.num_prototypes * cfg.moe.top_k, cfg.moe.num_experts)
    active = total - expert - embedding + head + expert * k_over_e
    assert active.denominator == 1
    assert (size.total, size.expert, size.embedding, size.active) == (total, expert, embedding, int(active))
    if cfg.moe.every == 0:
        assert size.expert == 0
    else:
        assert size.expert > 0


def hand_count_active(cfg: ModelConfig) -> int:
    """Weights a token multiplies by, written from the architecture (not from the module tree)."""
    D, F, V = cfg.d_model, cfg.ffn_dim, cfg.vocab_size
    moe = cfg.moe
    Fe = moe.ffn_dim or F
    K = moe.num_prototypes * moe.top_k
    mats = 3 if moe.activation == "swiglu" else 2
    attention = (D * 3 * D + 3 * D) + (D * D + D)
    norms = 2 * 2 * D
    per_block = []
    for i in range(cfg.num_layers):
        if moe.every and (i + 1) % moe.every == 0:
            ffn = moe.num_experts * D + K * mats * D * Fe  # router + the K experts a token visits
        else:
            ffn = (D * F + F) + (F * D + D)
        per_block.append(attention + norms + ffn)
    patch = cfg.image_channels * cfg.patch_size**2 * D + D
    return sum(per_block) + patch + 2 * D + V * D  # + final norm + LM head (tied or not)


@pytest.mark.parametrize("name", ["moe-every-1", "moe-every-2-untied", "prototypes-swiglu"])
def test_training_flops_per_token_by_hand(name):
    cfg = SMALL_CFGS[name]
    size = count_parameters(M6Model(cfg))
    n_active = hand_count_active(cfg)
    assert size.active == n_active
    seq_len = 20
    context = (cfg.image_size // cfg.patch_size) ** 2 + seq_len  # 4 patches + 20 text tokens
    expected = 6 * n_active + 12 * cfg.num_layers * cfg.d_model * context
    assert training_flops_per_token(cfg, size, seq_len) == pytest.approx(expected, rel=1e-12)


def test_meta_model_counts_equal_real_model_counts():
    cfg = SMALL_CFGS["moe-every-2-untied"]
    assert count_parameters(build_meta_model(cfg)) == count_parameters(M6Model(cfg))
    assert all(p.is_meta for p in build_meta_model(cfg).parameters())
    assert not any(p.is_meta for p in M6Model(cfg).parameters())


# The Hugging Face families' published configs. Reference counts: transformers 5.24's
# AutoModelForCausalLM.from_config(<the model's config.json values>) built on meta, summed over
# named_parameters (the checked formula below gives the same numbers from the shapes alone).
HF_REFERENCE = {
    # config: (total, expert params, experts per token / experts; published total, active in B)
    "mixtral-8x7b.yaml": (46_702_792_704, 45_097_156_608, Fraction(2, 8), 46.7, 12.9),
    "qwen3-moe-30b-a3b.yaml": (30_532_122_624, 28_991_029_248, Fraction(8, 128), 30.5, 3.3),
    "olmoe-1b-7b.yaml": (6_919_161_856, 6_442_450_944, Fraction(8, 64), 6.9, 1.3),
}


def hf_total_from_shapes(m: ModelConfig) -> tuple[int, int]:
    """(total, experts) of the Hugging Face decoder with these shapes: embed + lm_head, per layer
    q/k/v/o, q/k norms, router, SwiGLU experts, two RMSNorms; a final RMSNorm."""
    D, Dh, H = m.d_model, m6config.head_dim(m), m.num_heads
    kv = m6config.num_kv_heads(m) * Dh
    qk_norm = {"none": 0, "head": 2 * Dh, "full": H * Dh + kv}[m.qk_norm]
    experts = m.moe.num_experts * 3 * D * m.ffn_dim
    layer = D * H * Dh + 2 * D * kv + H * Dh * D + qk_norm + m.moe.num_experts * D + experts + 2 * D
    return 2 * m.vocab_size * D + m.num_layers * layer + D, m.num_layers * experts


@pytest.mark.parametrize("name", sorted(HF_REFERENCE))
def test_published_moe_configs_count_their_published_sizes(name):
    total, experts, k_over_e, published_total, published_active = HF_REFERENCE[name]
    cfg = m6config.load(CONFIGS_DIR / name)
    assert hf_total_from_shapes(cfg.model) == (total, experts)
    r = m6inspect.report(cfg, world_size=8)
    hf_active = total - experts + int(experts * k_over_e)
    assert r["expert_params"] == experts
    # m6 adds only the image side (patch projection, modality vectors): well under 0.1%.
    assert 0 < r["total_params"] - total < 1e-3 * total
    assert 0 <= r["text_active_params"] - hf_active < 1e-3 * hf_active
    assert abs(r["total_params"] / 1e9 - published_total) < 0.05
    assert abs(r["text_active_params"] / 1e9 - published_active) < 0.06  # published to 0.1B


def test_published_moe_config_plans(tmp_path, capsys):
    """m6.plan lays OLMoE out on a node of 8 80 GB GPUs, and the layout it writes loads as a config.
    (One family: a search takes 10-25 s on a loaded 2-core machine; Mixtral and Qwen3 plan the same way.)"""
    from m6.plan.__main__ import main as plan_main
    out = tmp_path / "plan.overrides"
    assert plan_main([str(CONFIGS_DIR / "olmoe-1b-7b.yaml"), "--gpus", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PREDICTED" in printed and "#1  EP" in printed, printed
    m6config.load(CONFIGS_DIR / "olmoe-1b-7b.yaml", out.read_text().split())


# ---------------------------------------------------------------------------------------------
# The printed report: one memory estimate, with its assumptions; a reader that stops early


def test_inspect_prints_one_memory_estimate_and_what_it_assumes(capsys):
    assert m6inspect.main([str(CONFIGS_DIR / "m6-100b.yaml"), "--world-size", "64", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("activations") == 1 and out.count("GiB") > 5 and "fp32 AdamW" not in out, out
    assumed = [line for line in out.splitlines() if line.startswith("memory of one rank, assuming: ")]
    assert len(assumed) == 1, out
    for words in ("world size 64 (--world-size)", "expert-parallel size 64", "device cpu (--device)",
                  "train.precision=bf16", "micro-batch 8 x accumulation 2 of global batch 1024"):
        assert words in assumed[0], (words, assumed[0])


def test_inspect_piped_into_a_reader_that_stops_early_exits_quietly(monkeypatch, capfd):
    """`m6.inspect ... | head -3` where the reader is gone before the report is written: stdout is
    a pipe whose read end is closed. No BrokenPipeError, exit 0, nothing on stderr."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as pipe:
        monkeypatch.setattr("sys.stdout", pipe)
        assert m6inspect.main([str(CONFIGS_DIR / "tiny.yaml")]) == 0
        pipe.write("after the report: goes nowhere, raises nothing\n")
        pipe.flush()
    assert capfd.readouterr().err == ""
