"""Activation checkpointing (memory.activation_checkpointing): exact byte accounting, the same
training run with and without it, the auto plan under its budget, and the gradient check."""

from __future__ import annotations

import pytest
import torch

import m6.parallel.activation_checkpoint as ac
from m6.config import ModelConfig, MoEConfig, load
from m6.model import M6Model
from m6.parallel.activation_checkpoint import ActivationCheckpointing, CheckpointingMismatch
from m6.parallel.activation_meter import SavedActivationMeter
from m6.parallel.activation_plan import ActivationProfile, PartProfile, choose_recompute, profile_parts
from m6.train.loop import Trainer

# Tiny, dropout on (recompute must replay the same masks), dropless MoE in block 1, dense in block 0.
TRAIN = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=40",
         "model.image_size=16", "model.patch_size=8", "model.moe.every=2", "model.moe.num_experts=4",
         "model.moe.capacity_factor=null", "model.dropout=0.1", "data.kind=synthetic", "data.num_samples=64",
         "data.eval_samples=8", "data.seq_len=32", "data.num_workers=0", "train.global_batch_size=4",
         "train.max_steps=5", "train.eval_every=0", "logging.console=false", "logging.every=1", "checkpoint.every=0"]


def _model_and_batch(dropout: float = 0.1):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, num_layers=2, num_heads=2, ffn_dim=64, max_text_len=40, image_size=16, patch_size=8,
                      dropout=dropout, moe=MoEConfig(every=2, num_experts=4, capacity_factor=None))
    model = M6Model(cfg)
    g = torch.Generator().manual_seed(1)
    B, L = 4, 24
    segments = torch.ones(B, L, dtype=torch.long)
    segments[:, 12:] = 2
    ids = torch.randint(3, 200, (B, L), generator=g)
    labels = ids.masked_fill(segments == 1, -100)
    batch = (torch.randn(B, 3, 16, 16, generator=g), torch.tensor([True, False, True, True]), ids, segments)

    def loss_fn():
        hidden, aux = model(*batch)
        return model.target_loss_sum(hidden, labels) + aux
    return model, loss_fn


def test_meter_counts_each_storage_once_and_skips_parameters():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedActivationMeter([w]) as meter:
        h = x @ w  # saves x and w: only x counts
        y = (h * h).sum() + (h.t() * 2).exp().sum()  # h saved by mul, its view's exp output saved
    assert meter.held_bytes() == 4 * 8 * 4 + 4 * 8 * 4 + 8 * 4 * 4  # x, h (once), exp's output
    y.backward()
    assert meter.held_bytes() == 0  # backward released every saved slot


def test_predicted_bytes_match_measured_for_every_plan_and_math_is_bitwise_equal():
    model, loss_fn = _model_and_batch()
    ckpt = ActivationCheckpointing(model)
    assert list(ckpt.parts) == ["blocks.0.attention", "blocks.0.mlp", "blocks.1.attention", "blocks.1.experts"]
    profile = profile_parts(ckpt, loss_fn, model.parameters(), torch.device("cpu"))
    reference = None
    names = list(ckpt.parts)
    # None, each part alone, pairs that share a block or not, all: storages shared between parts
    # and their surroundings must be counted once in every combination.
    for subset in [(), *[(n,) for n in names], tuple(names[:2]), (names[0], names[2]), tuple(names[1:]),
                   tuple(names)]:
            ckpt.apply(subset)
            torch.manual_seed(5)
            with SavedActivationMeter(model.parameters()) as meter:
                loss = loss_fn()
            assert meter.held_bytes() == profile.saved_bytes(subset), subset
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            if reference is None:
                reference = (loss.item(), grads)
            assert loss.item() == reference[0], subset
            assert all(torch.equal(a, b) for a, b in zip(grads, reference[1])), subset
    full, none = profile.saved_bytes(tuple(ckpt.parts)), profile.saved_bytes(())
    assert full < 0.6 * none  # recomputing does free most of the activations


def test_router_and_moe_layer_never_run_inside_a_part(monkeypatch):
    """Routing, dispatch and combine (all in MoELayer.forward, outside GroupedExperts) are kept,
    never recomputed: the only MoE code inside a part is the expert FFN."""
    import m6.moe.experts as experts
    model, loss_fn = _model_and_batch()
    ckpt = ActivationCheckpointing(model)
    current, seen = [None], []

    def wrap(part, original):
        def run(*args, **kwargs):
            current[0] = part.name
            try:
                return original(*args, **kwargs)
            finally:
                current[0] = None
        return run
    for m in model.modules():
        m.register_forward_pre_hook(lambda mod, args: seen.append((type(mod).__name__, current[0])))
    ffn_apply = experts._GroupedFFN.apply
    monkeypatch.setattr(experts._GroupedFFN, "apply",
                        lambda *a: (seen.append(("_GroupedFFN", current[0])), ffn_apply(*a))[1])
    with ckpt.wrapped(wrap):
        loss_fn()
    inside = {(kind, part) for kind, part in seen if part is not None}
    assert ("TopKRouter", None) in seen and ("MoELayer", None) in seen
    assert not any(kind in ("TopKRouter", "MoELayer") for kind, _ in inside)
    assert ("_GroupedFFN", "blocks.1.experts") in inside and ("SelfAttention", "blocks.0.attention") in inside


def _profile(parts: dict[str, tuple[int, int, float]]) -> ActivationProfile:
    """Parts with disjoint storages: name -> (bytes kept if recomputed, bytes kept if not, seconds)."""
    return ActivationProfile(outside={"out": 100}, parts={
        n: PartProfile({f"{n}-in": a}, {f"{n}-in": a, f"{n}-act": b - a}, t) for n, (a, b, t) in parts.items()})


def test_choose_recompute_frees_most_bytes_per_second_and_drops_what_is_not_needed():
    profile = _profile({"a": (10, 110, 1.0), "b": (10, 60, 0.1), "c": (10, 410, 4.1), "d": (10, 40, 0.1)})
    assert profile.saved_bytes(()) == 100 + 110 + 60 + 410 + 40 == 720
    # Free 160: b (500 B/s), d (300 B/s), then a (100 B/s, c frees 97.6 B/s) -> 180 freed; none of
    # the three can be dropped again.
    plan = choose_recompute(profile, 720 - 160)
    assert plan.recompute == ("a", "b", "d") and plan.fits and plan.predicted_bytes == 720 - 180
    # Free 400: greedy takes b, d, a, then c; c alone suffices, so the prune pass (most expensive
    # first) gives back a, b and d.
    plan = choose_recompute(profile, 720 - 400)
    assert plan.recompute == ("c",) and plan.predicted_bytes == 320
    assert choose_recompute(profile, 10**6).recompute == ()
    impossible = choose_recompute(profile, 10)
    assert impossible.recompute == ("a", "b", "c", "d") and not impossible.fits
    assert "cannot be met" in impossible.summary(4)


def _fit(tmp_path, name: str, *extra: str) -> Trainer:
    trainer = Trainer(load(None, [*TRAIN, f"run.dir={tmp_path / name}", *extra]))
    trainer.fit()
    return trainer


def test_full_and_auto_train_exactly_like_no_checkpointing(tmp_path, capsys):
    plain = _fit(tmp_path, "plain")
    full = _fit(tmp_path, "full", "memory.activation_checkpointing=full")
    auto = _fit(tmp_path, "auto", "memory.activation_checkpointing=auto", "memory.activation_budget_fraction=0.6")
    out = capsys.readouterr().out
    assert "activation checkpointing: recompute 4/4 parts" in out and "budget none (full)" in out
    losses = [h["loss"] for h in plain.history]
    weights = plain.model.state_dict()
    for trainer in (full, auto):
        assert [h["loss"] for h in trainer.history] == losses  # bitwise on CPU fp32
        for k, v in trainer.model.state_dict().items():
            torch.testing.assert_close(v, weights[k], rtol=1e-6, atol=0)
    # full: every part; the first step keeps exactly the bytes the profile predicted.
    assert full.checkpoint_plan.recompute == tuple(full.checkpointing.parts)
    assert full.history[0]["activation_saved_mb"] * 2**20 == full.checkpoint_plan.predicted_bytes
    # auto: a real choice (some parts, not all), under its budget, measured with saved-tensor hooks.
    plan = auto.checkpoint_plan
    assert 0 < len(plan.recompute) < len(auto.checkpointing.parts)
    assert plan.budget_bytes == int(0.6 * plan.no_checkpoint_bytes)
    assert auto.history[0]["activation_saved_mb"] * 2**20 == plan.predicted_bytes <= plan.budget_bytes
    assert full.history[0]["activation_saved_mb"] < auto.history[0]["activation_saved_mb"]
    assert "activation_saved_mb" not in plain.history[0]


def test_check_mode_passes_on_a_correct_recompute_and_fails_on_a_broken_one(tmp_path, monkeypatch, capsys):
    _fit(tmp_path, "ok", "memory.activation_checkpointing=auto", "memory.check_checkpointing=true",
         "train.max_steps=1")
    assert "checkpointing check: largest gradient difference with vs without recompute 0.000e+00" in capsys.readouterr().out

    # Broken: the recompute does not restore the RNG, so its dropout masks differ from the forward's.
    def no_rng_restore(fn, *args, **kwargs):
        kwargs["preserve_rng_state"] = False
        return torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)
    monkeypatch.setattr(ac, "checkpoint", no_rng_restore)
    with pytest.raises(CheckpointingMismatch, match="differ from those without"):
        _fit(tmp_path, "broken", "memory.activation_checkpointing=full", "memory.check_checkpointing=true",
             "train.max_steps=1")
