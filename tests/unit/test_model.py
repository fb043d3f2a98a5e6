"""M6Model: the prefix-LM mask against a slow reference, the mask's rules seen through the whole
forward (perturb one input, watch which outputs move), shapes and the loss, MoE placement, tied
embeddings, and a tiny model that overfits one batch.

The MoE layers run dropless (capacity_factor=None) so a token's output never depends on how many
other tokens chose its expert; the perturbation tests then hold exactly, up to float64 rounding.

Shape legend: B batch, N image patches, L text length, S = N + L, D d_model, V vocab.
"""

from __future__ import annotations

import math

import pytest
import torch

from m6.config import ModelConfig, MoEConfig, num_patches
from m6.data import batch as data_batch
from m6.data.batch import collate
from m6.data.synthetic import SyntheticImageCaptionDataset
from m6.data.byte_tokenizer import ByteTokenizer
from m6.model import M6Model
from m6.model import mask as model_mask
from m6.model.block import DenseMLP
from m6.model.mask import prefix_lm_mask
from m6.moe import MoELayer

PAD, SRC, TGT = 0, 1, 2  # written out here so the reference does not borrow the code's constants
IGNORE = -100
SAME_ATOL = 1e-12  # float64: "unchanged" means equal up to reduction-order rounding
MOVED_MIN = 1e-8  # float64: "changed" means a difference far above rounding


def small_cfg(**overrides) -> ModelConfig:
    moe = overrides.pop("moe", {})
    moe_cfg = MoEConfig(**{"every": 1, "num_experts": 4, "top_k": 2, "capacity_factor": None, **moe})
    base = dict(vocab_size=261, d_model=32, num_layers=2, num_heads=2, ffn_dim=64, max_text_len=40,
                image_size=16, patch_size=8, moe=moe_cfg)
    base.update(overrides)
    return ModelConfig(**base)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny ops run fastest on one thread, and several times faster than two on a loaded 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# The mask against a slow reference


def reference_mask(segments_BS: torch.Tensor) -> torch.Tensor:
    """Double loop over (query, key) writing down the prefix-LM rules one by one."""
    B, S = segments_BS.shape
    out = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b in range(B):
        seg = segments_BS[b].tolist()
        for q in range(S):
            for k in range(S):
                if seg[q] == PAD:
                    allowed = k == q  # a pad query sees only itself (keeps its softmax row finite)
                elif seg[k] == PAD:
                    allowed = False
                elif seg[q] == SRC:
                    allowed = seg[k] == SRC
                else:  # target query
                    allowed = seg[k] == SRC or (seg[k] == TGT and k <= q)
                out[b, 0, q, k] = allowed
    return out


def test_segment_constants_agree_between_data_and_model():
    assert (data_batch.SEG_PAD, data_batch.SEG_SOURCE, data_batch.SEG_TARGET) == (PAD, SRC, TGT)
    assert (model_mask.SEG_PAD, model_mask.SEG_SOURCE, model_mask.SEG_TARGET) == (PAD, SRC, TGT)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_lm_mask_matches_reference_on_random_layouts(seed):
    g = torch.Generator().manual_seed(seed)
    S = 17
    # Arbitrary interleavings (the rules are per position) ...
    rows = [torch.randint(0, 3, (S,), generator=g) for _ in range(4)]
    # ... and realistic [image | source | target | pad] layouts, including empty parts.
    for _ in range(4):
        n_img, n_src, n_tgt = (int(v) for v in torch.randint(0, 6, (3,), generator=g))
        n_pad = S - n_img - n_src - n_tgt
        rows.append(torch.tensor([SRC] * (n_img + n_src) + [TGT] * n_tgt + [PAD] * n_pad))
    segments = torch.stack(rows)
    got = prefix_lm_mask(segments)
    assert got.dtype == torch.bool and got.shape == (len(rows), 1, S, S)
    assert torch.equal(got, reference_mask(segments))


def test_prefix_lm_mask_has_no_empty_rows():
    segments = torch.tensor([[PAD] * 5, [SRC, PAD, TGT, PAD, TGT]])
    assert prefix_lm_mask(segments).any(dim=-1).all()


# ---------------------------------------------------------------------------------------------
# Mask rules through the full model


@pytest.fixture(scope="module")
def model64(device) -> M6Model:
    torch.manual_seed(0)
    return M6Model(small_cfg()).double().eval().to(device)


def make_inputs(cfg: ModelConfig, seed: int = 0):
    """Three rows of L=12 text: [src 4 | tgt 6 | pad 2], [src 3 | tgt 9], [src 5 | tgt 4 | pad 3]
    (the last without an image)."""
    g = torch.Generator().manual_seed(seed)
    layouts = [[SRC] * 4 + [TGT] * 6 + [PAD] * 2, [SRC] * 3 + [TGT] * 9, [SRC] * 5 + [TGT] * 4 + [PAD] * 3]
    segments = torch.tensor(layouts)
    ids = torch.randint(0, 256, segments.shape, generator=g)
    ids[segments == PAD] = ByteTokenizer.pad_id
    images = torch.randn(3, cfg.image_channels, cfg.image_size, cfg.image_size, generator=g, dtype=torch.float64)
    has_image = torch.tensor([True, True, False])
    return images, has_image, ids, segments


def on_model(model: M6Model, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors moved to the model's device (pytest --device)."""
    device = next(model.parameters()).device
    return tuple(t.to(device) for t in tensors)


def forward(model: M6Model, images, has_image, ids, segments) -> torch.Tensor:
    """Hidden states on the CPU, whatever device the model is on."""
    with torch.no_grad():
        hidden, _ = model(*on_model(model, images, has_image, ids, segments))
    return hidden.cpu()


def changed_positions(a_BLD: torch.Tensor, b_BLD: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: True where the hidden state moved by more than rounding."""
    diff = (a_BLD - b_BLD).abs().amax(dim=-1)
    assert not ((diff > SAME_ATOL) & (diff < MOVED_MIN)).any(), "a change neither exact nor clear"
    return diff > SAME_ATOL


def other_token(ids: torch.Tensor, b: int, p: int) -> torch.Tensor:
    new = ids.clone()
    new[b, p] = (int(ids[b, p]) + 7) % 256
    return new


def test_changing_a_target_token_moves_only_itself_and_later_targets(model64):
    images, has_image, ids, segments = make_inputs(model64.cfg)
    base = forward(model64, images, has_image, ids, segments)
    checked = 0
    for b, p in (segments == TGT).nonzero().tolist():
        moved = changed_positions(base, forward(model64, images, has_image, other_token(ids, b, p), segments))
        expected = torch.zeros_like(moved)
        expected[b, p:] = segments[b, p:] == TGT  # this target and the later ones, nothing else
        assert torch.equal(moved, expected), f"changed target token at row {b}, position {p}"
        checked += 1
    assert checked == 19


def test_changing_a_source_token_moves_the_whole_prefix_and_target_of_its_row(model64):
    images, has_image, ids, segments = make_inputs(model64.cfg)
    base = forward(model64, images, has_image, ids, segments)
    for b, p in (segments == SRC).nonzero().tolist():
        moved = changed_positions(base, forward(model64, images, has_image, other_token(ids, b, p), segments))
        expected = torch.zeros_like(moved)
        expected[b] = segments[b] != PAD  # bidirectional prefix: earlier source positions move too
        assert torch.equal(moved, expected), f"changed source token at row {b}, position {p}"


def test_changing_a_padding_token_changes_nothing_else(model64):
    images, has_image, ids, segments = make_inputs(model64.cfg)
    base = forward(model64, images, has_image, ids, segments)
    pads = (segments == PAD).nonzero().tolist()
    assert pads
    for b, p in pads:
        moved = changed_positions(base, forward(model64, images, has_image, other_token(ids, b, p), segments))
        moved[b, p] = False  # a padding position's own output is never used
        assert not moved.any(), f"changed padding token at row {b}, position {p}"


def test_changing_one_image_patch_changes_its_rows_caption(model64):
    cfg = model64.cfg
    images, has_image, ids, segments = make_inputs(cfg)
    base = forward(model64, images, has_image, ids, segments)
    new_images = images.clone()
    p = cfg.patch_size
    new_images[0, :, 0:p, p:2 * p] += 0.5  # only the pixels of patch (row 0, col 1) of sample 0
    hidden = forward(model64, new_images, has_image, ids, segments)
    moved = changed_positions(base, hidden)
    expected = torch.zeros_like(moved)
    expected[0] = segments[0] != PAD
    assert torch.equal(moved, expected)
    target = segments[0] == TGT
    new_h, base_h = on_model(model64, hidden[0, target], base[0, target])
    logits_diff = (model64.logits(new_h) - model64.logits(base_h)).abs().amax(dim=-1)
    assert (logits_diff > MOVED_MIN).all()


def test_image_of_a_sample_without_image_is_ignored(model64):
    images, has_image, ids, segments = make_inputs(model64.cfg)
    assert not has_image[2]
    base = forward(model64, images, has_image, ids, segments)
    new_images = images.clone()
    new_images[2] = torch.randn_like(new_images[2]) * 3.0
    assert not changed_positions(base, forward(model64, new_images, has_image, ids, segments)).any()
    # The same pixel change does reach the text once the sample is said to have an image.
    with_image = torch.tensor([True, True, True])
    a = forward(model64, images, with_image, ids, segments)
    b = forward(model64, new_images, with_image, ids, segments)
    assert changed_positions(a, b)[2, segments[2] != PAD].all()


def test_padding_changes_nothing_else_even_with_a_capacity_limit():
    torch.manual_seed(0)
    cfg = small_cfg(moe={"capacity_factor": 1.0, "min_capacity": 1})
    model = M6Model(cfg).double().eval()
    images, has_image, ids, segments = make_inputs(cfg)
    base = forward(model, images, has_image, ids, segments)
    for b, p in (segments == PAD).nonzero().tolist():
        moved = changed_positions(base, forward(model, images, has_image, other_token(ids, b, p), segments))
        moved[b, p] = False
        assert not moved.any(), f"changed padding token at row {b}, position {p}"
    new_images = images.clone()
    new_images[2] = torch.randn_like(new_images[2]) * 3.0  # row 2 has no image: its slots are padding
    assert not changed_positions(base, forward(model, new_images, has_image, ids, segments)).any()


# ---------------------------------------------------------------------------------------------
# Shapes, loss


def test_shapes_of_hidden_and_logits(model64):
    cfg = model64.cfg
    images, has_image, ids, segments = make_inputs(cfg)
    hidden, aux = model64(*on_model(model64, images, has_image, ids, segments))
    assert hidden.shape == (3, 12, cfg.d_model)
    assert model64.logits(hidden).shape == (3, 12, cfg.vocab_size)
    assert aux.shape == () and torch.isfinite(aux)


def test_target_loss_sum_equals_manual_cross_entropy(model64):
    images, has_image, ids, segments = make_inputs(model64.cfg)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, model64.cfg.vocab_size, ids.shape, generator=g)
    labels[torch.rand(ids.shape, generator=g) < 0.4] = IGNORE
    with torch.no_grad():
        hidden, _ = model64(*on_model(model64, images, has_image, ids, segments))
        got = model64.target_loss_sum(hidden, labels.to(hidden.device))
        hidden = hidden.cpu()
        weight = model64.text_embed.tokens.weight.cpu()
        expected, count = 0.0, 0
        for b in range(labels.shape[0]):
            for p in range(labels.shape[1]):
                y = int(labels[b, p])
                if y == IGNORE:
                    continue
                z = hidden[b, p] @ weight.t()
                expected += float(torch.logsumexp(z, dim=0) - z[y])
                count += 1
    assert count > 5
    # target_loss_sum computes the cross-entropy in float32 (for bf16 runs), hence the tolerance.
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_target_loss_sum_with_the_host_count_is_the_boolean_selection_bitwise():
    """Given the number of targets (the batch knows it on the host), the loss gathers the target
    positions without a host sync: the same positions in the same order, so the same loss and
    gradients bit for bit; a wrong count is refused, never silently padded or cut."""
    torch.manual_seed(0)
    model = M6Model(small_cfg()).train()
    images, has_image, ids, segments = make_inputs(model.cfg)
    labels = torch.randint(0, 256, ids.shape)
    labels[segments != TGT] = IGNORE
    count = int((labels != IGNORE).sum())
    results = []
    for num_targets in (None, count):
        model.zero_grad(set_to_none=True)
        hidden, _ = model(images.float(), has_image, ids, segments)
        loss = model.target_loss_sum(hidden, labels, num_targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_mask, grads_mask), (loss_count, grads_count) = results
    assert torch.equal(loss_mask, loss_count)
    assert grads_mask.keys() == grads_count.keys() and all(torch.equal(grads_mask[n], grads_count[n]) for n in grads_mask)
    with torch.no_grad():
        hidden, _ = model(images.float(), has_image, ids, segments)
        for wrong in (count - 1, count + 1):
            with pytest.raises(RuntimeError, match="num_targets is not the number of labels"):
                model.target_loss_sum(hidden, labels, wrong)


def test_initial_loss_per_token_is_about_ln_vocab():
    torch.manual_seed(0)
    cfg = small_cfg()
    model = M6Model(cfg).eval()
    images, has_image, ids, segments = make_inputs(cfg)
    labels = torch.randint(0, 256, ids.shape)
    labels[segments != TGT] = IGNORE
    with torch.no_grad():
        hidden, _ = model(images.float(), has_image, ids, segments)
        per_token = model.target_loss_sum(hidden, labels) / (labels != IGNORE).sum()
    assert abs(float(per_token) - math.log(cfg.vocab_size)) < 0.3


# ---------------------------------------------------------------------------------------------
# Structure: MoE placement, tied embeddings


@pytest.mark.parametrize(
    "every, num_layers, moe_blocks",
    [(1, 2, [0, 1]), (1, 4, [0, 1, 2, 3]), (2, 4, [1, 3]), (3, 4, [2]), (0, 4, [])],
)
def test_moe_placement(every, num_layers, moe_blocks):
    model = M6Model(small_cfg(num_layers=num_layers, moe={"every": every}))
    for i, block in enumerate(model.blocks):
        if i in moe_blocks:
            assert isinstance(block.ffn, MoELayer), f"block {i}"
        else:
            assert isinstance(block.ffn, DenseMLP), f"block {i}"
    layers = model.moe_layers()
    assert list(layers) == [f"block{i}" for i in moe_blocks]
    assert all(layers[f"block{i}"] is model.blocks[i].ffn for i in moe_blocks)


def test_dense_model_has_zero_aux_loss():
    cfg = small_cfg(moe={"every": 0})
    model = M6Model(cfg).eval()
    images, has_image, ids, segments = make_inputs(cfg)
    _, aux = model(images.float(), has_image, ids, segments)
    assert float(aux) == 0.0


def test_tied_embeddings_use_the_token_table_as_head():
    cfg = small_cfg(tie_embeddings=True)
    model = M6Model(cfg)
    assert model.lm_head is None
    assert not any("lm_head" in name for name, _ in model.named_parameters())
    hidden = torch.randn(2, 5, cfg.d_model)
    assert torch.allclose(model.logits(hidden), hidden @ model.text_embed.tokens.weight.t())
    with torch.no_grad():
        model.text_embed.tokens.weight[3] += 1.0
    assert torch.allclose(model.logits(hidden)[..., 3], hidden @ model.text_embed.tokens.weight[3])


def test_untied_embeddings_have_their_own_head():
    cfg_tied, cfg_untied = small_cfg(tie_embeddings=True), small_cfg(tie_embeddings=False)
    tied, model = M6Model(cfg_tied), M6Model(cfg_untied)
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.bias is None
    assert model.lm_head.weight.shape == (cfg_untied.vocab_size, cfg_untied.d_model)
    assert model.lm_head.weight.data_ptr() != model.text_embed.tokens.weight.data_ptr()
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in model.parameters())
    assert n_untied - n_tied == cfg_untied.vocab_size * cfg_untied.d_model
    hidden = torch.randn(2, 5, cfg_untied.d_model)
    assert torch.allclose(model.logits(hidden), hidden @ model.lm_head.weight.t())
    assert not torch.allclose(model.logits(hidden), hidden @ model.text_embed.tokens.weight.t())


# ---------------------------------------------------------------------------------------------
# Training


def test_tiny_model_overfits_one_batch():
    seq_len = 40
    cfg = small_cfg(max_text_len=seq_len)
    dataset = SyntheticImageCaptionDataset(64, image_size=cfg.image_size, seed=0)
    batch = collate([dataset[i] for i in range(4)], ByteTokenizer(), seq_len, dataset.image_shape)
    assert batch.has_image.any() and batch.num_target_tokens > 50
    torch.manual_seed(0)
    model = M6Model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(150):
        hidden, aux = model(batch.images, batch.has_image, batch.text_ids, batch.segment_ids)
        loss = model.target_loss_sum(hidden, batch.labels) / batch.num_target_tokens + aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as the training loop does
        opt.step()
    model.eval()
    with torch.no_grad():
        hidden, _ = model(batch.images, batch.has_image, batch.text_ids, batch.segment_ids)
        final = float(model.target_loss_sum(hidden, batch.labels)) / batch.num_target_tokens
    assert final < 0.1


def test_conv_patch_embedding_forward_backward():
    cfg = small_cfg(patch_embed="conv")
    torch.manual_seed(0)
    model = M6Model(cfg)
    images, has_image, ids, segments = make_inputs(cfg)
    labels = ids.roll(-1, dims=1)
    labels[segments != TGT] = IGNORE
    hidden, aux = model(images.float(), has_image, ids, segments)
    assert hidden.shape == (3, 12, cfg.d_model)
    (model.target_loss_sum(hidden, labels) + aux).backward()
    for name in ("stem.0.weight", "proj.weight"):
        grad = model.patch_embed.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert num_patches(cfg) == 4


# ---------------------------------------------------------------------------------------------
# Initialisation does not depend on the device


def _materialized(device: torch.device, redirect_all: bool = False, redirected: list | None = None) -> dict[str, torch.Tensor]:
    cfg = small_cfg(patch_embed="conv")  # nn.Conv2d: kaiming_uniform_ (uniform_) besides normal_
    with torch.device("meta"):
        model = M6Model(cfg)
    if redirect_all:  # every fill through the host-drawn path, CPU tensors too
        from m6.model import host_drawn_init
        original = host_drawn_init.HostDrawnInit.__init__

        def patched(self, redirect=None, **kwargs):
            original(self, redirect=lambda t: redirected.append(tuple(t.shape)) or True, **kwargs)
        host_drawn_init.HostDrawnInit.__init__ = patched
        try:
            model.materialize(device, seed=3)
        finally:
            host_drawn_init.HostDrawnInit.__init__ = original
    else:
        model.materialize(device, seed=3)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_the_host_drawn_init_path_draws_what_a_cpu_init_draws():
    """The path every off-CPU random fill takes (drawn on the host, copied in) gives the CPU init
    bit for bit: same generator, same order."""
    fills: list = []
    plain = _materialized(torch.device("cpu"))
    redirected = _materialized(torch.device("cpu"), redirect_all=True, redirected=fills)
    # Every weight matrix, embedding and conv kernel went through it (experts draw on their own).
    assert len(fills) >= sum(1 for k, v in plain.items() if v.dim() >= 2 and "experts" not in k), fills
    assert plain.keys() == redirected.keys()
    for k in plain:
        assert torch.equal(plain[k], redirected[k]), k
    assert len({float(v.float().std()) for k, v in plain.items() if v.dim() == 2}) > 3  # really random


def test_a_fill_of_a_meta_tensor_draws_nothing():
    """Meta tensors hold no values: the host-drawn path skips them (drawing M6-10T's router weights
    on the host took the planner's scale tests seconds per rank) and leaves the generator as it was."""
    from m6.model.host_drawn_init import HostDrawnInit

    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    target = torch.empty(4096, 4096, device="meta")
    with HostDrawnInit():
        torch.nn.init.normal_(target, std=0.02)
        target.uniform_(-1, 1)
    assert torch.equal(torch.random.get_rng_state(), before) and target.device.type == "meta"


def test_the_same_seed_gives_the_same_model_on_every_device(device):
    """pytest --device cuda: the weights materialized on the GPU equal the CPU's bitwise (torch's
    CUDA generator draws other numbers; m6 draws on the host: m6.model.host_drawn_init)."""
    here, cpu = _materialized(device), _materialized(torch.device("cpu"))
    for k in cpu:
        assert torch.equal(here[k], cpu[k]), k
