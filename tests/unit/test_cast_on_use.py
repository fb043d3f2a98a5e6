"""Cast-on-use bf16 (train.precision=bf16): the same numbers as torch.autocast, without keeping a
bf16 copy of any weight for backward (measured with saved-tensor hooks)."""

from __future__ import annotations

import pytest
import torch

from m6.config import ModelConfig, MoEConfig, load
from m6.model import M6Model
from m6.model.cast_on_use import Conv2d, Linear, set_cast_on_use
from m6.memory.activation_meter import SavedActivationMeter
from m6.train.loop import Trainer


@pytest.mark.parametrize("bias, shape", [(True, (5, 7, 16)), (False, (6, 16))])
def test_linear_matches_autocast_bitwise_and_saves_the_fp32_weight(bias, shape):
    torch.manual_seed(0)
    layer = Linear(16, 12, bias=bias)
    x = torch.randn(shape, requires_grad=True)
    dy = torch.randn(*shape[:-1], 12).bfloat16()
    results = []
    for on in (False, True):
        layer.cast_on_use = on
        with SavedActivationMeter(layer.parameters()) as meter:
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=not on):
                y = layer(x)
        casts = meter.parameter_cast_bytes()
        y.backward(dy)
        results.append((y.detach(), x.grad.clone(), layer.weight.grad.clone(),
                        layer.bias.grad.clone() if bias else None, casts))
        x.grad = None
        layer.zero_grad(set_to_none=True)
    plain, cast = results
    assert plain[0].dtype == cast[0].dtype == torch.bfloat16
    for a, b in zip(plain[:4], cast[:4]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert cast[2].dtype == torch.float32 and cast[1].dtype == torch.float32
    assert plain[4] == 16 * 12 * 2 and cast[4] == 0  # autocast keeps the bf16 weight; cast-on-use none


def test_without_autocast_cast_on_use_is_the_plain_op():
    torch.manual_seed(0)
    layer, conv = Linear(8, 4), Conv2d(3, 4, 3, padding=1)
    set_cast_on_use(torch.nn.Sequential(layer, conv), True)
    x, img = torch.randn(2, 8), torch.randn(1, 3, 5, 5)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert torch.equal(conv(img), torch.nn.functional.conv2d(img, conv.weight, conv.bias, padding=1))


def _model(patch_embed: str, activation: str) -> M6Model:
    torch.manual_seed(0)
    return M6Model(ModelConfig(d_model=32, num_layers=2, num_heads=2, ffn_dim=64, max_text_len=40, image_size=16,
                               patch_size=8, patch_embed=patch_embed,
                               moe=MoEConfig(every=2, num_experts=4, capacity_factor=None, activation=activation)))


def _run(model: M6Model, cast_on_use: bool, device: torch.device = torch.device("cpu")):
    """bf16 forward/backward of a fixed batch: loss, grads, and the bytes the forward kept."""
    g = torch.Generator().manual_seed(1)
    B, L = 4, 24
    segments = torch.ones(B, L, dtype=torch.long)
    segments[:, 12:] = 2
    ids = torch.randint(3, 200, (B, L), generator=g)
    labels = ids.masked_fill(segments == 1, -100)
    images = torch.randn(B, 3, 16, 16, generator=g)
    has_image = torch.tensor([True, False, True, True])
    images, has_image, ids, segments, labels = (t.to(device) for t in (images, has_image, ids, segments, labels))
    set_cast_on_use(model, cast_on_use)
    with SavedActivationMeter(model.parameters()) as meter:
        with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not cast_on_use):
            hidden, aux = model(images, has_image, ids, segments)
            loss = model.target_loss_sum(hidden, labels) + aux
    held, casts = meter.held_bytes(), meter.parameter_cast_bytes()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads, held, casts


@pytest.mark.parametrize("patch_embed, activation", [("linear", "gelu"), ("conv", "swiglu")])
def test_model_cast_on_use_equals_autocast_and_keeps_no_weight_copy(patch_embed, activation, device):
    model = _model(patch_embed, activation).to(device)
    loss_a, grads_a, held_a, casts_a = _run(model, cast_on_use=False, device=device)
    loss_c, grads_c, held_c, casts_c = _run(model, cast_on_use=True, device=device)
    # Same kernels on the same bf16 operands: bitwise equal, so no tolerance is needed.
    assert loss_a == loss_c
    assert all(torch.equal(grads_a[n], grads_c[n]) for n in grads_a)
    assert all(g.dtype == torch.float32 for g in grads_c.values())
    # Autocast keeps a bf16 copy of every weight whose backward needs it: attention, dense FFN,
    # experts, the tied LM head (the token embedding), and the conv patch stem; the linear patch
    # projection's input needs no gradient, so its weight is not kept. Cast-on-use keeps none.
    kept = [n for n, p in model.named_parameters() if p.dim() >= 2 and (
        ".attn." in n or ".ffn.fc_" in n or ".experts." in n or n == "text_embed.tokens.weight"
        or (patch_embed == "conv" and n.startswith("patch_embed.") and ("proj" in n or "stem" in n)))]
    expected = sum(2 * model.get_parameter(n).numel() for n in kept)
    assert casts_a == expected > 0
    assert casts_c == 0
    assert held_a - held_c == expected  # exactly those copies, nothing else, is what it saves
    print(f"\n[{patch_embed}/{activation}] bf16 weight copies kept for backward: autocast {casts_a} B, "
          f"cast-on-use {casts_c} B; all saved activations {held_a} B -> {held_c} B")


def test_trainer_bf16_cast_on_use_matches_bf16_autocast_with_checkpointing(tmp_path):
    base = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64",
            "model.max_text_len=40", "model.image_size=16", "model.patch_size=8", "model.moe.every=2",
            "model.moe.num_experts=4", "model.dropout=0.1", "data.kind=synthetic", "data.num_samples=64",
            "data.eval_samples=8", "data.seq_len=32", "data.num_workers=0", "train.global_batch_size=4",
            "train.max_steps=3", "train.eval_every=0", "logging.console=false", "checkpoint.every=0"]
    runs = {}
    for name, extra in (("autocast", ["train.precision=bf16-autocast"]), ("cast", ["train.precision=bf16"]),
                        ("cast+ckpt", ["train.precision=bf16", "memory.activation_checkpointing=full",
                                       "memory.check_checkpointing=true"])):
        trainer = Trainer(load(None, [*base, f"run.dir={tmp_path / name}", *extra]))
        runs[name] = ([h["loss"] for h in trainer.fit()], trainer.model.state_dict())
    assert runs["cast"][0] == runs["autocast"][0] == runs["cast+ckpt"][0]
    for k, v in runs["autocast"][1].items():
        assert torch.equal(runs["cast"][1][k], v) and torch.equal(runs["cast+ckpt"][1][k], v), k
