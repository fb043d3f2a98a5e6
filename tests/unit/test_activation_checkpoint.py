"""Activation checkpointing (memory.activation_checkpointing): exact byte accounting, the same
training run with and without it, the auto plan under its budget, and the gradient check."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import m6.memory.recompute as ac
from m6.config import ModelConfig, MoEConfig, load
from m6.model import M6Model
from m6.memory.recompute import RecomputeParts, RecomputeMismatch
from m6.memory.recompute_guard import ActivationBudgetGuard
from m6.memory.activation_meter import SavedActivationMeter
from m6.memory.recompute_plan import ActivationProfile, PartProfile, choose_recompute, profile_parts
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


def test_meter_frees_a_graph_dropped_without_backward():
    # exp saves its own output: a pack hook keeping that output itself (with its grad_fn) would
    # close a cycle through C++ (output -> grad_fn -> saved slot -> output) that no gc can break,
    # so a forward never followed by backward (the recompute profile's) would stay alive.
    x = torch.randn(64, 64, requires_grad=True)
    with SavedActivationMeter([]) as meter:
        y = (x * 2).exp()  # mul by a constant saves nothing; exp saves its output
    assert meter.held_bytes() == 64 * 64 * 4
    del y
    gc.collect()
    assert meter.held_bytes() == 0


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages behind every tensor object Python can reach."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        if obj.device.type != "meta":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_recompute_profile_keeps_nothing_of_its_forwards():
    model, loss_fn = _model_and_batch()
    ckpt = RecomputeParts(model)
    loss_fn().backward()  # what a forward leaves by design (MoE statistics, gradients) exists already
    before = _live_tensor_bytes()
    profile_parts(ckpt, loss_fn, model.parameters(), torch.device("cpu"))
    assert _live_tensor_bytes() == before


def test_predicted_bytes_match_measured_for_every_plan_and_math_is_bitwise_equal():
    model, loss_fn = _model_and_batch()
    ckpt = RecomputeParts(model)
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
    ckpt = RecomputeParts(model)
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


_DEVICE = ["cpu"]  # pytest --device (tests/conftest.py), set once per module below


@pytest.fixture(autouse=True, scope="module")
def _selected_device(device):
    _DEVICE[0] = device.type


def _fit(tmp_path, name: str, *extra: str) -> Trainer:
    trainer = Trainer(load(None, [*TRAIN, f"train.device={_DEVICE[0]}", f"run.dir={tmp_path / name}", *extra]))
    trainer.fit()
    return trainer


def test_full_and_auto_train_exactly_like_no_checkpointing(tmp_path, capsys):
    plain = _fit(tmp_path, "plain")
    full = _fit(tmp_path, "full", "memory.activation_checkpointing=full")
    # 0.9 of the no-recompute bytes: a real choice on either device. Recomputing all four parts
    # keeps 0.41 of them on the CPU but 0.68 on an H100 (its flash attention saves no score
    # matrix), where 0.6 could only be missed by recomputing everything.
    auto = _fit(tmp_path, "auto", "memory.activation_checkpointing=auto", "memory.activation_budget_fraction=0.9")
    out = capsys.readouterr().out
    assert "activation checkpointing: recompute 4/4 parts" in out and "budget none (full)" in out
    losses = [h["loss"] for h in plain.history]
    weights = plain.model.state_dict()
    for trainer in (full, auto):
        assert [h["loss"] for h in trainer.history] == losses  # bitwise on CPU fp32
        for k, v in trainer.model.state_dict().items():
            torch.testing.assert_close(v, weights[k], rtol=1e-6, atol=0)
    # The plans are profiled on the densest batch of the shape: every real step keeps at most
    # what they predict (measured with saved-tensor hooks), and the densest batch keeps exactly that.
    assert full.activations.plan.recompute == tuple(full.activations.recompute.parts)
    plan = auto.activations.plan
    assert 0 < len(plan.recompute) < len(auto.activations.recompute.parts)  # a real choice: some parts, not all
    assert plan.budget_bytes == int(0.9 * plan.no_checkpoint_bytes)
    assert plan.predicted_bytes <= plan.budget_bytes
    for trainer in (full, auto):
        kept = [h["activation_saved_mb"] * 2**20 for h in trainer.history]
        assert max(kept) <= trainer.activations.plan.predicted_bytes, kept
        assert len(set(kept)) > 1  # the batches differ in padding, so in what they keep
    assert [h["activation_extra_recomputes"] for h in auto.history] == [0] * len(auto.history)
    assert "activation_extra_recomputes" not in full.history[0]
    batch = auto.loader.next_step()[0][0].batch.densest().to(auto.device)
    for trainer in (full, auto):
        with SavedActivationMeter(trainer.model.parameters()) as meter:
            out = trainer.forward_loss(batch)
        # Another densest batch: the same up to small routing-dependent index buffers.
        assert meter.held_bytes() == pytest.approx(trainer.activations.plan.predicted_bytes, rel=0.01)
        del out
    assert full.history[0]["activation_saved_mb"] < auto.history[0]["activation_saved_mb"]
    assert "activation_saved_mb" not in plain.history[0]


def test_full_recompute_meters_only_the_steps_it_logs(tmp_path, monkeypatch):
    """The saved-tensor meter costs host time on every tensor a forward saves: with full recompute
    it runs only on the steps whose metrics are logged (and the plan's profiling), not on every
    micro-batch; activation_saved_mb is reported on those steps."""
    trainer = Trainer(load(None, [*TRAIN, f"train.device={_DEVICE[0]}", f"run.dir={tmp_path / 'run'}",
                                  "memory.activation_checkpointing=full", "logging.every=2"]))
    packed = []
    real_pack = SavedActivationMeter._pack
    monkeypatch.setattr(SavedActivationMeter, "_pack", lambda self, t: packed.append(1) or real_pack(self, t))
    metered, reported = [], []
    for _ in range(5):  # logging steps: 2, 4 and the last, 5
        before = len(packed)
        metrics = trainer.train_step()
        metered.append(len(packed) > before)
        reported.append("activation_saved_mb" in metrics)
    assert metered[1:] == [True, False, True, True]  # step 1 profiles the plan (its own meters)
    assert reported == [False, True, False, True, True]


def test_check_mode_passes_on_a_correct_recompute_and_fails_on_a_broken_one(tmp_path, monkeypatch, capsys):
    _fit(tmp_path, "ok", "memory.activation_checkpointing=auto", "memory.check_checkpointing=true",
         "train.max_steps=1")
    assert "checkpointing check: largest gradient difference with vs without recompute 0.000e+00" in capsys.readouterr().out

    # Broken: the recompute does not restore the RNG, so its dropout masks differ from the forward's.
    def no_rng_restore(fn, *args, **kwargs):
        kwargs["preserve_rng_state"] = False
        return torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)
    monkeypatch.setattr(ac, "checkpoint", no_rng_restore)
    with pytest.raises(RecomputeMismatch, match="differ from those without"):
        _fit(tmp_path, "broken", "memory.activation_checkpointing=full", "memory.check_checkpointing=true",
             "train.max_steps=1")


def _guard_model_and_batches():
    """4 blocks (2 MoE), dropout on; a light batch (most text is padding, one image) and heavy
    ones (no padding, images): the heavy batches route ~2x the tokens through the MoE layers."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, num_layers=4, num_heads=2, ffn_dim=64, max_text_len=40, image_size=16, patch_size=8,
                      dropout=0.1, moe=MoEConfig(every=2, num_experts=4, capacity_factor=None))
    model = M6Model(cfg)

    def batch(seed: int, light: bool):
        g = torch.Generator().manual_seed(seed)
        B, L = 4, 32
        segments = torch.ones(B, L, dtype=torch.long)
        segments[:, 16:] = 2
        if light:
            segments[:, 8:16] = 1
            segments[:, 20:] = 0  # padding
        ids = torch.randint(3, 200, (B, L), generator=g)
        labels = ids.masked_fill(segments != 2, -100)
        has_image = torch.tensor([True, False, False, False]) if light else torch.ones(B, dtype=torch.bool)
        return (torch.randn(B, 3, 16, 16, generator=g), has_image, ids, segments), labels

    def loss_fn(b):
        inputs, labels = b
        hidden, aux = model(*inputs)
        return model.target_loss_sum(hidden, labels) + aux
    return model, loss_fn, batch(1, light=True), [batch(2 + i, light=False) for i in range(3)]


def _grads_after(model, loss_fn, b, rng_seed: int) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(rng_seed)
    loss_fn(b).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_budget_guard_holds_heavier_batches_under_the_budget_with_the_same_gradients():
    model, loss_fn, light, heavy = _guard_model_and_batches()
    ckpt = RecomputeParts(model)
    profile = profile_parts(ckpt, lambda: loss_fn(light), model.parameters(), torch.device("cpu"))
    for part in profile.parts.values():  # fixed costs: the plan must not depend on this machine's timings
        part.forward_s = 1e-3
    budget = int(0.6 * profile.saved_bytes(()))
    light_targets, heavy_targets = int((light[1] != -100).sum()), int((heavy[0][1] != -100).sum())
    assert heavy_targets == 4 * light_targets

    def kept_bytes(b, meter_cm) -> int:
        with meter_cm as meter:
            loss = loss_fn(b)
        held = meter.held_bytes()
        loss.backward()
        return held

    # Control: the plan alone, fixed from the light batch, keeps more than the budget on a heavy one.
    static = choose_recompute(profile, budget)
    assert 0 < len(static.recompute) < len(ckpt.parts) and static.predicted_bytes <= budget
    ckpt.apply(static.recompute)
    assert kept_bytes(heavy[0], SavedActivationMeter(model.parameters())) > budget

    ckpt.apply(())
    plain = _grads_after(model, loss_fn, heavy[0], 5)
    guard = ActivationBudgetGuard(ckpt, profile, budget, model.parameters(), light_targets)
    assert guard.plan.recompute == static.recompute
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    assert kept_bytes(heavy[0], guard.micro_batch(heavy_targets)) <= budget
    assert guard.step_extras > 0  # it recomputed parts beyond the plan for this batch...
    for name, g in plain.items():  # ...and the gradients are bitwise those without checkpointing
        assert torch.equal(model.get_parameter(name).grad, g), name
    replanned = guard.end_step()  # the step needed extras: re-plan with the measured margin
    assert replanned is not None and replanned.margin > 1 and replanned.fits
    assert len(replanned.recompute) > len(static.recompute)
    assert ckpt.recomputed == replanned.recompute
    for b in heavy[1:]:
        model.zero_grad(set_to_none=True)
        assert kept_bytes(b, guard.micro_batch(heavy_targets)) <= budget
    assert guard.end_step() is None  # no new worst ratio: the plan stays
    # Forwards outside a metered micro-batch (profiling, the check, evaluation) get no extras.
    guard.plan = static
    ckpt.apply(static.recompute, escalate=guard._escalate)
    loss_fn(heavy[0]).backward()
    assert guard.step_extras == 0
