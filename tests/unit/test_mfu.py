"""TFLOP/s and MFU: the training step charges the FLOPs of the work it asked of the model (real
tokens, target positions, kept expert assignments, real sequence lengths), against a count made by
hand; padding adds nothing; the peak matches what runs (fp32 is not TF32 unless TF32 is on).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from m6.batch_format import IGNORE_INDEX, SEG_SOURCE, SEG_TARGET
from m6.config import ModelConfig, MoEConfig, load
from m6.data.batch import MultimodalBatch
from m6.data.loader import LoadedBatch
from m6.model import M6Model
from m6.model.flops import forward_flop_rates
from m6.train.loop import Trainer
from m6.train.metrics import device_peak_tflops, peak_tflops_for

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
# Block 1 dense, block 2 MoE (4 experts, top-2, capacity 1.0: drops happen), 16x16 images in 8x8
# patches (4 per image), fp32 on CPU; a made-up peak so MFU is reported.
D, F, E, K, LAYERS, PATCHES, PATCH_DIM = 32, 64, 4, 2, 2, 4, 3 * 8 * 8
SMALL = [
    f"model.d_model={D}", f"model.num_layers={LAYERS}", "model.num_heads=2", f"model.ffn_dim={F}",
    "model.max_text_len=80", "model.image_size=16", "model.patch_size=8", "model.moe.every=2",
    f"model.moe.num_experts={E}", f"model.moe.top_k={K}", "model.moe.capacity_factor=1.0",
    "model.moe.min_capacity=1", "data.kind=synthetic", "data.sources=[]", "data.num_workers=0",
    "data.seq_len=80", "data.num_samples=64", "data.eval_samples=4", "train.global_batch_size=6",
    "train.micro_batch_size=3", "train.peak_tflops=100", "logging.console=false",
]


@pytest.fixture
def trainer(tmp_path):
    t = Trainer(load(TINY, [*SMALL, f"run.dir={tmp_path}"]))
    yield t
    t.loader.close()
    t.logger.close()


def micro_batch(rows: list[tuple[bool, int, int] | None], text_len: int) -> LoadedBatch:
    """A micro-batch laid out as m6.data.batch.collate does: each row (has_image, source tokens,
    target tokens) or None (an all-padding row), text padded to ``text_len``."""
    B = len(rows)
    g = torch.Generator().manual_seed(0)
    images = torch.zeros(B, 3, 16, 16)
    has_image = torch.zeros(B, dtype=torch.bool)
    text_ids = torch.zeros(B, text_len, dtype=torch.int64)
    segment_ids = torch.zeros(B, text_len, dtype=torch.int64)
    labels = torch.full((B, text_len), IGNORE_INDEX, dtype=torch.int64)
    for b, row in enumerate(rows):
        if row is None:
            continue
        image, s, t = row
        if image:
            images[b] = torch.randn(3, 16, 16, generator=g)
            has_image[b] = True
        text_ids[b, :s + t] = torch.randint(5, 256, (s + t,), generator=g)
        segment_ids[b, :s] = SEG_SOURCE
        segment_ids[b, s:s + t] = SEG_TARGET
        labels[b, s - 1:s + t - 1] = text_ids[b, s:s + t]
    batch = MultimodalBatch(images, has_image, text_ids, segment_ids, labels)
    return LoadedBatch(batch, int((segment_ids != 0).sum()) + int(has_image.sum()) * PATCHES)


def force_routing(trainer: Trainer) -> None:
    """Every MoE input becomes the same vector (ffn_norm weight 0, bias 1) and the router ranks the
    experts 0 > 1 > 2 > ...: every routed token goes to experts 0 and 1, so with capacity C each
    of them keeps min(routed tokens, C) assignments. Re-applied before each step (the update moves
    these weights)."""
    with torch.no_grad():
        for block in trainer.model.blocks:
            if block.is_moe:
                block.ffn_norm.weight.zero_()
                block.ffn_norm.bias.fill_(1.0)
                ranks = torch.arange(E, 0, -1, dtype=torch.float32).view(E, 1)
                block.ffn.router.weight.copy_(ranks.expand(E, D) / D)


def step_flops(trainer: Trainer, loaded: list[LoadedBatch]) -> tuple[float, dict]:
    """Run one training step on ``loaded`` (the micro-batches); the FLOPs its TFLOP/s stands for."""
    force_routing(trainer)
    trainer.loader.next_step = lambda: (loaded, 0.0)
    metrics = trainer.train_step()
    return metrics["tflops"] * 1e12 * metrics["step_time_s"], metrics


def test_step_flops_equal_a_hand_count(trainer):
    V = trainer.cfg.model.vocab_size
    # Two micro-batches of 3 rows, 12 text positions: (has_image, source, target) or None.
    first = micro_batch([(True, 4, 3), (False, 3, 5), None], text_len=12)
    second = micro_batch([(True, 2, 6), (True, 5, 2), (False, 2, 10)], text_len=12)
    flops, metrics = step_flops(trainer, [first, second])

    # Real length of each row: 4 patches if it has an image, plus its source and target text.
    lengths = [4 + 4 + 3, 3 + 5, 4 + 2 + 6, 4 + 5 + 2, 2 + 10]  # the padding row has none
    positions = sum(lengths)  # 11 + 8 + 12 + 11 + 12 = 54 (of 2 x 3 x (4 + 12) = 96 in the batch)
    image_patches = 3 * 4  # three rows have an image
    targets = 3 + 5 + 6 + 2 + 10  # one label per target token = 26
    pairs = sum(n * n for n in lengths)  # 121 + 64 + 144 + 121 + 144 = 594
    # Capacity per expert = max(1, ceil(1.0 * routed * K / E)); every routed token sends both of its
    # assignments to experts 0 and 1, which keep min(routed, capacity) each.
    kept = 2 * min(19, 10) + 2 * min(35, 18)  # micro-batch 1: 19 routed, capacity ceil(9.5) = 10;
    #                                           micro-batch 2: 35 routed, capacity ceil(17.5) = 18
    # (Capacity per sequence instead of per micro-batch keeps as many here: 2 x ceil(n / 2) for
    # rows of n = 11, 8 and 12, 11, 12 is 20 and 36 too, at most one odd row per micro-batch.)
    assert kept == 56 and kept < K * positions  # 52 assignments dropped: not charged

    per_position = LAYERS * (2 * D * 3 * D + 2 * D * D) + (2 * D * F + 2 * F * D) + 2 * D * E
    #              qkv + out in both blocks             dense FFN of block 1        router of block 2
    per_patch = 2 * PATCH_DIM * D  # linear patch projection
    per_target = 2 * V * D  # tied LM head, on target positions only
    per_pair = LAYERS * (2 * D + 2 * D)  # q.k and p.v over all heads
    per_assignment = 2 * D * F + 2 * F * D  # one GELU expert FFN (moe.ffn_dim = model.ffn_dim)
    forward = (per_position * positions + per_patch * image_patches + per_target * targets
               + per_pair * pairs + per_assignment * kept)
    assert flops == pytest.approx(3 * forward, rel=1e-9)
    assert metrics["mfu"] == pytest.approx(3 * forward / metrics["step_time_s"] / 1e12 / 100.0, rel=1e-9)
    # The routing really was forced: the last micro-batch's layer kept 36.
    assert [int(layer.stats.kept) for layer in trainer.model.moe_layers().values()] == [36]


def test_padding_adds_no_flops(trainer):
    rows = [(True, 4, 3), (False, 3, 5), (True, 6, 6)]
    tight, _ = step_flops(trainer, [micro_batch(rows, text_len=12)])
    # The same samples with 20 more padding positions per row and two all-padding rows.
    padded, _ = step_flops(trainer, [micro_batch([*rows, None, None], text_len=32)])
    assert padded == pytest.approx(tight, rel=1e-12)
    # And a sample more does add its FLOPs.
    more, _ = step_flops(trainer, [micro_batch([*rows, (False, 1, 1)], text_len=12)])
    assert more > tight


# ---------------------------------------------------------------------------------------------
# The rates per unit of work, for the variants the Trainer test does not build


@pytest.mark.parametrize("variant", ["conv-untied", "swiglu-prototypes"])
def test_forward_flop_rates_by_hand(variant):
    d, f, fe, v, layers = 16, 32, 8, 300, 2
    if variant == "conv-untied":
        moe = MoEConfig(every=2, num_experts=4, top_k=2, ffn_dim=fe)
        cfg = ModelConfig(vocab_size=v, d_model=d, num_layers=layers, num_heads=2, ffn_dim=f, max_text_len=24,
                          image_size=16, patch_size=8, patch_embed="conv", tie_embeddings=False, moe=moe)
        stem = max(16, d // 4)
        per_patch = 8 * 8 * 2 * (3 * 9 * stem) + 2 * (stem * 8 * 8) * d  # 3x3 stem at 64 pixels + p x p conv
        per_ffn = 2 * d * 4 + (2 * d * f + 2 * f * d)  # router (block 2) + dense FFN (block 1)
        per_assignment = 2 * (2 * d * fe)
    else:
        moe = MoEConfig(every=1, num_experts=6, num_prototypes=3, top_k=1, activation="swiglu", ffn_dim=fe)
        cfg = ModelConfig(vocab_size=v, d_model=d, num_layers=layers, num_heads=2, ffn_dim=f, max_text_len=24,
                          image_size=16, patch_size=8, moe=moe)
        per_patch = 2 * (3 * 8 * 8) * d
        per_ffn = layers * 2 * d * 6  # a router in each block
        per_assignment = 2 * (3 * d * fe)  # w_in, w_gate, w_out
    rates = forward_flop_rates(M6Model(cfg))
    assert rates.per_position == layers * 8 * d * d + per_ffn
    assert rates.per_patch == per_patch
    assert rates.per_target == 2 * v * d
    assert rates.per_attention_pair == layers * 4 * d
    assert rates.per_assignment == per_assignment


# ---------------------------------------------------------------------------------------------
# The peak: a pure function of device name, dtype and the TF32 flag


@pytest.mark.parametrize("name, bf16, fp32, tf32", [
    ("NVIDIA H100 80GB HBM3", 989.4, 67.0, 494.7),  # SXM5
    ("NVIDIA H100 PCIe", 756.5, 51.0, 378.0),
    ("NVIDIA H200", 989.4, 67.0, 494.7),
    ("NVIDIA A100-SXM4-80GB", 312.0, 19.5, 156.0),
    ("NVIDIA A100 80GB PCIe", 312.0, 19.5, 156.0),
    ("Tesla V100-SXM2-16GB", None, 15.7, 15.7),  # no TF32 (nor bf16) on Volta
    ("Tesla V100-PCIE-32GB", None, 14.0, 14.0),
    ("NVIDIA H100 NVL", None, None, None),  # a variant with its own figures, not tabulated
    ("NVIDIA A10", None, None, None),  # not an A100
    ("NVIDIA H20", None, None, None),  # not an H200
])
def test_peak_selection(name, bf16, fp32, tf32):
    assert peak_tflops_for(name, torch.bfloat16, tf32=False) == bf16
    assert peak_tflops_for(name, torch.bfloat16, tf32=True) == bf16  # the flag is about fp32 only
    assert peak_tflops_for(name, torch.float32, tf32=False) == fp32
    assert peak_tflops_for(name, torch.float32, tf32=True) == tf32


@pytest.fixture
def restore_tf32():
    saved = torch.backends.cuda.matmul.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = saved


def test_device_peak_follows_the_tf32_setting(monkeypatch, restore_tf32):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # torch's default: fp32 matmuls are plain fp32
    assert device_peak_tflops(cuda, torch.float32, None) == 67.0
    assert device_peak_tflops(cuda, torch.bfloat16, None) == 989.4
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert device_peak_tflops(cuda, torch.float32, None) == 494.7
    assert device_peak_tflops(cuda, torch.float32, 123.0) == 123.0  # train.peak_tflops wins
    assert device_peak_tflops(torch.device("cpu"), torch.float32, None) is None


def test_expert_load_gives_the_per_layer_values_from_one_read():
    """expert_load reads every layer's statistics in one transfer; the values are those of reading
    each statistic on its own (float32 mean and max on the device, as before)."""
    from m6.moe import MoELayer
    from m6.train.metrics import expert_load

    torch.manual_seed(0)
    layers = {"block1": MoELayer(16, 32, 8, top_k=2, capacity_factor=1.0), "block3": MoELayer(16, 32, 4, top_k=1)}
    for layer in layers.values():
        layer(torch.randn(3, 7, 16))
    scalars, counts = expert_load({**layers, "idle": MoELayer(16, 32, 4)})  # no stats yet: left out
    expected = {}
    for name, layer in layers.items():
        tokens = layer.stats.tokens_per_expert.float()
        mean = tokens.mean().item()
        expected.update({f"moe/{name}/max_tokens": tokens.max().item(), f"moe/{name}/mean_tokens": mean,
                         f"moe/{name}/max_over_mean": tokens.max().item() / mean,
                         f"moe/{name}/dropped_fraction": layer.stats.dropped_fraction.item(),
                         f"moe/{name}/router_entropy": layer.stats.router_entropy.item(),
                         f"moe/{name}/expert_kernel": 0})  # which kernel ran: the loop, on CPU
        assert counts[name] == layer.stats.tokens_per_expert.tolist()
    assert scalars == expected and set(counts) == set(layers)
    assert scalars["moe/block1/dropped_fraction"] > 0  # capacity 1.0 drops some: a real value, not zeros
