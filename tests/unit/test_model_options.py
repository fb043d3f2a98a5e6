"""The block-architecture options (model.norm, positions, num_kv_heads / head_dim, qk_norm, biases,
ffn_activation, shared experts, first_dense_blocks, routed_scaling_factor), each against a plain
reference written out here; text_logits; and building under a default-device context.

float64 throughout, so "equal" means equal up to reduction-order rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from m6.config import ConfigError, ModelConfig, MoEConfig
from m6.model import M6Model
from m6.model.attention import SelfAttention
from m6.model.block import DenseMLP
from m6.model.rope import cos_sin, grid_angles, text_angles
from m6.moe import MoELayer
from m6.moe.experts import GroupedExperts

PAD, SRC, TGT = 0, 1, 2


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_style_cfg(**overrides) -> ModelConfig:
    """A tiny model with every option a Hugging Face MoE family sets."""
    moe = {**dict(every=1, num_experts=4, top_k=2, capacity_factor=None, activation="swiglu"), **overrides.pop("moe", {})}
    base = dict(vocab_size=97, d_model=32, num_layers=2, num_heads=4, ffn_dim=48, max_text_len=24, image_size=16,
                patch_size=8, norm="rmsnorm", positions="rope", num_kv_heads=2, head_dim=12, qk_norm="head",
                linear_bias=False, ffn_activation="swiglu", tie_embeddings=False, moe=MoEConfig(**moe))
    base.update(overrides)
    cfg = ModelConfig(**base)
    cfg.validate()
    return cfg


def build(cfg: ModelConfig, seed: int = 0) -> M6Model:
    torch.manual_seed(seed)
    return M6Model(cfg).double()


# ---------------------------------------------------------------------------------------------
# Norms


def test_rmsnorm_everywhere_matches_formula():
    model = build(hf_style_cfg())
    norms = [model.final_norm, model.blocks[0].attn_norm, model.blocks[1].ffn_norm]
    assert all(type(n) is nn.RMSNorm for n in norms)
    assert all(len(list(n.parameters())) == 1 for n in norms)  # weight only
    x = torch.randn(3, 32, dtype=torch.float64)
    w = torch.randn(32, dtype=torch.float64)
    with torch.no_grad():
        model.final_norm.weight.copy_(w)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(model.final_norm(x), expected, rtol=1e-12, atol=1e-12)


def test_defaults_are_the_m6_block():
    model = M6Model(ModelConfig())
    block = model.blocks[0]
    assert type(block.attn_norm) is nn.LayerNorm and type(model.final_norm) is nn.LayerNorm
    assert block.attn.qkv.bias is not None and block.attn.out.bias is not None
    assert not hasattr(block.attn, "q_norm")
    assert model.text_embed.positions is not None and model.patch_embed.rows is not None
    assert model.rotary(4, 8, torch.device("cpu")) is None


# ---------------------------------------------------------------------------------------------
# Rotary positions


def rotate_pairs_directly(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Pair (i, i + Dh/2) of each row turned by its angle, written as a 2x2 rotation."""
    half = x.shape[-1] // 2
    out = x.clone()
    for s in range(x.shape[-2]):
        for i in range(half):
            a, b = x[..., s, i], x[..., s, i + half]
            c, t = math.cos(angles[s, i]), math.sin(angles[s, i])
            out[..., s, i] = a * c - b * t
            out[..., s, i + half] = a * t + b * c
    return out


def test_text_rope_is_the_hf_rotation():
    from m6.model.rope import apply_rotary
    Dh, L, theta = 8, 5, 500.0
    angles = text_angles(L, Dh, theta)
    for s in range(L):
        for i in range(Dh // 2):
            assert angles[s, i].item() == pytest.approx(s / theta ** (2 * i / Dh), rel=1e-6)
    x = torch.randn(2, 3, L, Dh, dtype=torch.float64)
    torch.testing.assert_close(apply_rotary(x, *cos_sin(angles)), rotate_pairs_directly(x, angles.double()),
                               rtol=1e-6, atol=1e-6)


def test_text_rope_scores_depend_on_relative_position_only():
    from m6.model.rope import apply_rotary
    Dh = 8
    cos, sin = cos_sin(text_angles(12, Dh, 10000.0).double())
    q, k = torch.randn(Dh, dtype=torch.float64), torch.randn(Dh, dtype=torch.float64)
    rq = apply_rotary(q.expand(1, 1, 12, Dh), cos, sin)[0, 0]
    rk = apply_rotary(k.expand(1, 1, 12, Dh), cos, sin)[0, 0]
    assert (rq[7] @ rk[4]).item() == pytest.approx((rq[3] @ rk[0]).item(), rel=1e-6)


def test_grid_rope_turns_half_the_pairs_by_row_and_half_by_column():
    Dh, grid, theta = 8, 3, 100.0
    angles = grid_angles(grid, Dh, theta)
    inv = [1 / theta ** (4 * j / Dh) for j in range(Dh // 4)]
    for r in range(grid):
        for c in range(grid):
            expected = [r * f for f in inv] + [c * f for f in inv]
            torch.testing.assert_close(angles[r * grid + c], torch.tensor(expected, dtype=torch.float32))


def test_text_positions_count_from_the_first_text_token():
    """With image patches before the text, text position i still turns by i (as in text_logits)."""
    model = build(hf_style_cfg(image_positions="rope"))
    cos, _ = model.rotary(4, 6, torch.device("cpu"))
    text_cos, _ = cos_sin(text_angles(6, 12, model.cfg.rope_theta))
    torch.testing.assert_close(cos[4:], text_cos)
    torch.testing.assert_close(cos[:4], cos_sin(grid_angles(2, 12, model.cfg.rope_theta))[0])
    assert model.patch_embed.rows is None and model.text_embed.positions is None


# ---------------------------------------------------------------------------------------------
# Attention: GQA, head_dim, qk_norm, biases


def reference_attention(attn: SelfAttention, x: torch.Tensor, mask: torch.Tensor, rotary=None) -> torch.Tensor:
    """Multi-head attention written out: k/v heads repeated per group, softmax(q k^T / sqrt(Dh)) v."""
    H, Hkv, Dh = attn.num_heads, attn.num_kv_heads, attn.head_dim
    B, S, _ = x.shape
    y = F.linear(x, attn.qkv.weight, attn.qkv.bias)
    q, k, v = y[..., :H * Dh], y[..., H * Dh:(H + Hkv) * Dh], y[..., (H + Hkv) * Dh:]
    if attn.qk_norm == "full":
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.q_norm.weight
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.k_norm.weight
    q = q.view(B, S, H, Dh).transpose(1, 2)
    k = k.view(B, S, Hkv, Dh).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = v.view(B, S, Hkv, Dh).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    if attn.qk_norm == "head":
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.q_norm.weight
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.k_norm.weight
    if rotary is not None:
        cos, sin = rotary
        half = Dh // 2
        rot = lambda t: torch.cat([-t[..., half:], t[..., :half]], dim=-1)  # noqa: E731
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(Dh)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(B, S, H * Dh)
    return F.linear(out, attn.out.weight, attn.out.bias)


@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_matches_repeated_kv_reference(qk_norm, kv_heads):
    torch.manual_seed(1)
    attn = SelfAttention(32, 4, num_kv_heads=kv_heads, head_dim=12, qk_norm=qk_norm, qkv_bias=True,
                         out_bias=False).double()
    if qk_norm != "none":
        with torch.no_grad():  # non-trivial norm weights, so placement (per head vs whole) shows
            attn.q_norm.weight.uniform_(0.5, 1.5)
            attn.k_norm.weight.uniform_(0.5, 1.5)
    assert attn.qkv.weight.shape == ((4 + 2 * kv_heads) * 12, 32) and attn.out.weight.shape == (32, 48)
    if qk_norm == "head":
        assert attn.q_norm.weight.shape == (12,) and attn.k_norm.weight.shape == (12,)
    if qk_norm == "full":
        assert attn.q_norm.weight.shape == (48,) and attn.k_norm.weight.shape == (kv_heads * 12,)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    rotary = tuple(t.double() for t in cos_sin(text_angles(6, 12, 10000.0)))
    torch.testing.assert_close(attn(x, mask, rotary), reference_attention(attn, x, mask, rotary),
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(attn(x, mask), reference_attention(attn, x, mask), rtol=1e-10, atol=1e-10)


def test_bias_options():
    no_bias = build(hf_style_cfg(moe={"first_dense_blocks": 1}))
    biases = [n for n, _ in no_bias.named_parameters() if n.endswith(".bias")]
    assert biases == ["patch_embed.proj.bias"]  # the image projection keeps its bias; no block has one
    qwen2 = build(hf_style_cfg(attention_bias=True, moe={"first_dense_blocks": 1}))
    biases = sorted(n for n, _ in qwen2.named_parameters() if n.endswith(".bias") and n.startswith("blocks."))
    assert biases == ["blocks.0.attn.qkv.bias", "blocks.1.attn.qkv.bias"]


def test_swiglu_dense_mlp_matches_formula():
    mlp = DenseMLP(16, 24, "swiglu", bias=False).double()
    x = torch.randn(5, 16, dtype=torch.float64)
    expected = F.silu(x @ mlp.fc_gate.weight.T) * (x @ mlp.fc_in.weight.T) @ mlp.fc_out.weight.T
    torch.testing.assert_close(mlp(x), expected, rtol=1e-12, atol=1e-12)
    assert mlp.fc_in.bias is None


# ---------------------------------------------------------------------------------------------
# Shared experts, first dense blocks, routed scaling


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_add_to_scaled_routed_output(gated):
    torch.manual_seed(2)
    shared = DenseMLP(16, 40, "swiglu", bias=False)
    gate = nn.Linear(16, 1, bias=False) if gated else None
    kwargs = dict(top_k=2, capacity_factor=None, activation="swiglu", init_seed=5)
    layer = MoELayer(16, 24, 4, shared_experts=shared, shared_expert_gate=gate, routed_scaling_factor=2.5,
                     **kwargs).double()
    plain = MoELayer(16, 24, 4, **kwargs).double()
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared")})
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    shared_out = layer.shared_experts(x)
    if gated:
        shared_out = torch.sigmoid(x @ layer.shared_expert_gate.weight.T) * shared_out
    torch.testing.assert_close(layer(x)[0], 2.5 * plain(x)[0] + shared_out, rtol=1e-12, atol=1e-12)


def test_first_dense_blocks_and_shared_expert_shapes():
    cfg = hf_style_cfg(num_layers=4, moe={"first_dense_blocks": 1, "every": 1, "num_shared_experts": 2,
                                           "shared_expert_ffn_dim": 20, "shared_expert_gate": True})
    model = build(cfg)
    assert [b.is_moe for b in model.blocks] == [False, True, True, True]
    assert model.blocks[0].ffn.fc_gate is not None and model.blocks[0].ffn.fc_in.weight.shape == (48, 32)
    ffn = model.blocks[1].ffn
    assert ffn.shared_experts.fc_in.weight.shape == (40, 32)  # 2 shared experts x 20
    assert ffn.shared_expert_gate.weight.shape == (1, 32)
    assert [p.name for p in model.recomputable_parts()][:5] == [
        "blocks.0.attention", "blocks.0.mlp", "blocks.1.attention", "blocks.1.experts", "blocks.1.shared_experts"]


@pytest.mark.parametrize("overrides, key", [
    ({"norm": "batchnorm"}, "model.norm"),
    ({"num_kv_heads": 3}, "model.num_kv_heads"),
    ({"qk_norm": "all"}, "model.qk_norm"),
    ({"image_positions": "rope", "head_dim": 6}, "divisible by 4"),
    ({"moe": {"shared_expert_gate": True}}, "model.moe.shared_expert_gate"),
    ({"moe": {"first_dense_blocks": 5}}, "model.moe.first_dense_blocks"),
    ({"moe": {"routed_scaling_factor": 0.0}}, "model.moe.routed_scaling_factor"),
])
def test_bad_option_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        hf_style_cfg(**overrides)


# ---------------------------------------------------------------------------------------------
# text_logits


def test_text_logits_equal_the_forward_on_an_imageless_causal_row():
    model = build(hf_style_cfg(moe={"num_shared_experts": 1, "shared_expert_gate": True}))
    ids = torch.randint(0, 97, (2, 9))
    logits = model.text_logits(ids)
    assert logits.shape == (2, 9, 97)
    images = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    hidden, _ = model(images, torch.tensor([False, False]), ids, torch.full((2, 9), TGT))
    torch.testing.assert_close(logits, model.logits(hidden), rtol=1e-10, atol=1e-10)


def test_text_logits_are_causal():
    model = build(hf_style_cfg())
    ids = torch.randint(0, 97, (1, 8))
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] + 1) % 97
    a, b = model.text_logits(ids), model.text_logits(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=1e-12, atol=1e-12)
    assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-6


# ---------------------------------------------------------------------------------------------
# Building under a default-device context


def test_experts_draw_on_the_host_under_a_device_context():
    """Under ``with torch.device(...)`` the expert init still draws from its CPU generators on the
    CPU (a CUDA default device made torch.randn refuse the CPU generator)."""
    experts = GroupedExperts(3, 8, 12, "swiglu", init_seed=4)
    expected = [w.detach().clone() for w in experts.parameters()]
    with torch.device("meta"):  # a draw that follows the default device would land on meta
        experts.reset_parameters()
    for w, e in zip(experts.parameters(), expected):
        assert torch.equal(w, e)


def test_model_builds_under_meta_device_context():
    cfg = hf_style_cfg(moe={"num_shared_experts": 1, "shared_expert_gate": True, "first_dense_blocks": 1})
    with torch.device("meta"):
        model = M6Model(cfg)
        layer = MoELayer(16, 24, 4)
    assert all(p.is_meta for p in model.parameters()) and layer.experts.w_in.is_meta
    model.materialize(torch.device("cpu"), seed=3)
    reference = M6Model(cfg)
    reference.materialize(torch.device("cpu"), seed=3)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# FLOP and parameter accounting follow the options


def test_forward_flop_rates_by_hand_with_every_option():
    from m6.model.flops import forward_flop_rates
    cfg = hf_style_cfg(moe={"first_dense_blocks": 1, "num_shared_experts": 2, "shared_expert_ffn_dim": 20,
                            "shared_expert_gate": True})
    rates = forward_flop_rates(build(cfg))
    D, Q, Kv = 32, 4 * 12, 2 * 12
    attention = 2 * (D * (Q + 2 * Kv) + Q * D)
    dense_swiglu = 2 * 3 * D * 48
    shared, gate, router = 2 * 3 * D * 40, 2 * D, 2 * 4 * D
    assert rates.per_position == 2 * attention + dense_swiglu + shared + gate + router
    assert rates.router_per_position == router
    assert rates.per_attention_pair == 2 * 4 * Q
    assert rates.per_assignment == 2 * 3 * D * 48


def test_step_flops_equal_torch_flop_counter_with_every_option():
    """The accounting against torch's own count of the matmuls a real forward runs (the counter has
    no formula for the CPU SDPA kernel, so QK^T and AV are the hand count of the test above)."""
    from torch.utils.flop_counter import FlopCounterMode

    from m6.model.flops import count_tokens, forward_flop_rates, step_flops
    cfg = hf_style_cfg(image_positions="rope", moe={"first_dense_blocks": 1, "num_shared_experts": 1,
                                                    "shared_expert_gate": True})
    model = build(cfg)
    B, L = 2, 10
    ids = torch.randint(0, 97, (B, L))
    seg = torch.full((B, L), TGT)
    seg[:, :3] = SRC
    labels = torch.full((B, L), -100)
    labels[:, 3:-1] = ids[:, 4:]
    has = torch.ones(B, dtype=torch.bool)
    images = torch.randn(B, 3, 16, 16, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        hidden, _ = model(images, has, ids, seg)
        model.target_loss_sum(hidden, labels)
    kept = sum(int(layer.stats.kept) for layer in model.moe_layers().values())
    counts = count_tokens(seg, has, 4, int((labels != -100).sum()))
    rates = forward_flop_rates(model)
    attention_pairs = rates.per_attention_pair * counts.attention_pairs
    assert step_flops(rates, counts, kept) / 3 == counter.get_total_flops() + attention_pairs


def test_parameter_counts_with_every_option():
    from m6.model.flops import count_parameters
    cfg = hf_style_cfg(attention_bias=True, moe={"first_dense_blocks": 1, "num_shared_experts": 1,
                                                 "shared_expert_gate": True})
    size = count_parameters(build(cfg))
    D, Q, Kv, V = 32, 48, 24, 97
    attention = D * (Q + 2 * Kv) + (Q + 2 * Kv) + Q * D + 2 * 12  # qkv (+ bias), out, per-head q/k norms
    block_norms = 2 * D
    experts = 4 * 3 * D * 48
    moe_block = attention + block_norms + 4 * D + experts + 3 * D * 48 + D  # router, experts, shared, gate
    dense_block = attention + block_norms + 3 * D * 48
    embeddings = V * D + 2 * D  # tokens, modality (rotary text: no position table; learned 2-D patches)
    patches = 3 * 8 * 8 * D + D + 2 * 2 * D
    total = moe_block + dense_block + embeddings + patches + D + V * D  # final norm, untied LM head
    assert size.total == total
    assert size.expert == experts
    assert size.active == total - experts - (V * D + 2 * D + 2 * 2 * D) + experts * 2 // 4


def test_recomputing_every_part_gives_the_same_gradients_with_every_option():
    """Attention (with q/k norms and rotary), dense SwiGLU, experts and shared experts recomputed in
    backward: the same gradients bit for bit, and the formula's full-recompute bytes near the meter's."""
    from m6.memory.activation_meter import SavedActivationMeter
    from m6.memory.recompute import RecomputeParts
    from m6.model.activation_bytes import ActivationShape, activation_bytes
    cfg = hf_style_cfg(image_positions="rope", moe={"first_dense_blocks": 1, "num_shared_experts": 1,
                                                    "shared_expert_gate": True})
    ids = torch.randint(0, 97, (2, 10))
    seg = torch.full((2, 10), TGT)
    seg[:, 0] = SRC
    labels = torch.full((2, 10), -100)
    labels[:, :-1] = ids[:, 1:]
    images = torch.randn(2, 3, 16, 16)
    grads, held = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = M6Model(cfg)
        if recompute:
            RecomputeParts(model).apply([p.name for p in model.recomputable_parts()])
        with SavedActivationMeter(model.parameters()) as meter:
            hidden, aux = model(images, torch.tensor([True, True]), ids, seg)
            loss = model.target_loss_sum(hidden, labels) + aux
            held.append(meter.held_bytes())
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert "blocks.1.ffn.shared_experts.fc_gate.weight" in grads[0]
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name
    predicted = activation_bytes(cfg, ActivationShape(2, 10))
    assert abs(predicted.kept() - held[0]) <= 0.02 * held[0], (predicted.kept(), held[0])
    assert abs(predicted.kept_full() - held[1]) <= 0.05 * held[1], (predicted.kept_full(), held[1])


def test_banner_names_the_non_default_block_options():
    from m6.model.architecture import block_options
    assert block_options(ModelConfig()) == ""
    cfg = hf_style_cfg(attention_bias=True, moe={"num_shared_experts": 2, "shared_expert_gate": True,
                                                 "first_dense_blocks": 1, "routed_scaling_factor": 2.5})
    assert block_options(cfg) == ("rmsnorm, RoPE (text, theta 10000), GQA 2 key/value heads, head dim 12, "
                                  "q/k norm per head, q/k/v biases only, swiglu dense MLPs, 2 shared experts (gated), "
                                  "first 1 block dense, routed output x2.5")
