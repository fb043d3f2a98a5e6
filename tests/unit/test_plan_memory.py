"""The memory model (m6.model.activation_bytes, m6.memory.estimate) against what a real forward
keeps (SavedActivationMeter) and against m6.inspect's per-rank report."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from m6 import config as m6config
from m6 import inspect as m6inspect
from m6.batch_format import IGNORE_INDEX, SEG_SOURCE, SEG_TARGET
from m6.memory.activation_meter import SavedActivationMeter
from m6.memory.recompute import RecomputeParts
from m6.model import M6Model
from m6.model.activation_bytes import ActivationShape, activation_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# Dropless, so every assignment is kept (the formula's assumption), small enough to run in a second.
SMALL = ["data.kind=synthetic", "data.sources=[]", "model.moe.capacity_factor=null", "data.seq_len=40",
         "model.max_text_len=40", "model.image_size=16"]


def densest_inputs(cfg: m6config.Config, batch: int):
    """An image in every row, no padding, a label at every text position but the last."""
    m, L = cfg.model, cfg.data.seq_len
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, m.image_size, m.image_size, generator=g)
    ids = torch.randint(0, 256, (batch, L), generator=g)
    seg = torch.full((batch, L), SEG_TARGET)
    seg[:, 0] = SEG_SOURCE
    labels = torch.full((batch, L), IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    return images, torch.ones(batch, dtype=torch.bool), ids, seg, labels


def measured_saved_bytes(cfg: m6config.Config, batch: int, recompute: list[str] | None = None) -> int:
    torch.manual_seed(0)
    model = M6Model(cfg.model)
    if recompute is not None:
        RecomputeParts(model).apply(recompute or [p.name for p in model.recomputable_parts()])
    images, has, ids, seg, labels = densest_inputs(cfg, batch)
    with SavedActivationMeter(model.parameters()) as meter:
        hidden, aux = model(images, has, ids, seg)
        loss = model.target_loss_sum(hidden, labels) + aux
        held = meter.held_bytes()
    del loss
    return held


@pytest.mark.parametrize("extra", [[], ["model.moe.activation=swiglu", "model.moe.top_k=1"],
                                   ["model.moe.every=1", "model.moe.num_prototypes=2", "model.moe.top_k=1"],
                                   # the Hugging Face families' block options (model keys of m6.config)
                                   ["model.norm=rmsnorm", "model.positions=rope", "model.num_kv_heads=2",
                                    "model.head_dim=16", "model.qk_norm=head", "model.linear_bias=false",
                                    "model.ffn_activation=swiglu", "model.moe.activation=swiglu",
                                    "model.moe.num_shared_experts=1", "model.moe.shared_expert_gate=true"],
                                   ["model.qk_norm=full", "model.image_positions=rope", "model.moe.first_dense_blocks=2",
                                    "model.moe.every=1", "model.attention_bias=true"]])
def test_formula_equals_the_meter_on_a_real_forward(extra):
    cfg = m6config.load(CONFIGS / "tiny.yaml", SMALL + extra)
    predicted = activation_bytes(cfg.model, ActivationShape(3, cfg.data.seq_len))
    measured = measured_saved_bytes(cfg, 3)
    assert abs(predicted.kept() - measured) <= 0.02 * measured, (predicted.kept(), measured)


def test_full_recompute_formula_equals_the_meter():
    cfg = m6config.load(CONFIGS / "tiny.yaml", SMALL)
    predicted = activation_bytes(cfg.model, ActivationShape(3, cfg.data.seq_len)).kept_full()
    measured = measured_saved_bytes(cfg, 3, recompute=[])
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)
    assert predicted < 0.6 * activation_bytes(cfg.model, ActivationShape(3, cfg.data.seq_len)).kept()


def test_inspect_sizes_one_rank_of_the_layout(capsys):
    one = m6inspect.report(m6config.load(CONFIGS / "m6-1t.yaml", ["train.micro_batch_size=2"]), 1)
    many = m6inspect.report(m6config.load(CONFIGS / "m6-1t.yaml", ["train.micro_batch_size=2",
                                                                   "parallel.expert_parallel_size=512"]), 512)
    f1, f512 = one["memory_with_features"], many["memory_with_features"]
    experts = one["expert_params"]
    # 511/512 of the experts leave the rank; everything else stays.
    assert f1.device["params"] - f512.device["params"] == 4 * experts * 511 // 512
    assert m6inspect.main([str(CONFIGS / "m6-1t.yaml"), "--world-size", "512", "train.micro_batch_size=2"]) == 0
    assert "expert-parallel size 512" in capsys.readouterr().out
    assert m6inspect.main([str(CONFIGS / "m6-1t.yaml"), "--world-size", "480"]) == 2
    assert "train.global_batch_size (1024) must be divisible" in capsys.readouterr().err


def _walk_setup():
    from m6.memory.estimate import _BackwardWalk, recomputed_parts
    from m6.moe import MoELayer
    from m6.plan.memory import rank_model
    cfg = m6config.load(CONFIGS / "tiny.yaml", SMALL)
    model = rank_model(cfg, 1, 1)
    experts = {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
    acts = activation_bytes(cfg.model, ActivationShape(3, cfg.data.seq_len))
    kept = acts.kept_by_unit(recomputed_parts(cfg, acts))
    walk = lambda world, ep, bucket: _BackwardWalk(model, experts, world, ep, bucket)  # noqa: E731
    return model, acts, kept, walk


def test_activations_split_by_unit_in_backward_order():
    _, acts, kept, _ = _walk_setup()
    assert list(kept)[0] == "head" and list(kept)[-1] == "embeddings"
    assert list(kept)[1:-1] == [f"blocks.{i}" for i in reversed(range(4))]
    assert sum(kept.values()) == pytest.approx(acts.kept())


def test_a_bucket_weighs_on_the_backward_peak_only_while_activations_are_held():
    model, _, kept, walk = _walk_setup()
    alone_walk = walk(1, 1, 25 * 2**20)
    alone = alone_walk.peak(kept, grads_made=True)  # one process: nothing bucketed
    assert walk(1, 1, 25 * 2**20).buckets == []
    # EP 2 at world 2: only replicated gradients are summed, all in one bucket that completes with
    # the embeddings' gradients, the last ones backward makes: after every activation is released.
    one = walk(2, 2, 25 * 2**20)
    assert len(one.buckets) == 1 and one.peak(kept, grads_made=True) == alone
    # A bucket per parameter: each goes as soon as its unit is done, beside the activations still held.
    many = walk(2, 1, 1)
    largest = max(p.numel() * 4 for p in model.parameters())
    assert len(many.buckets) == sum(1 for _ in model.parameters())
    assert alone < many.peak(kept, grads_made=True) <= alone + 2 * largest
    # The tied embedding's gradient is made by the head's backward (the first unit), final after
    # the embeddings' (the last): it counts from the start, and its bucket goes at the end.
    head_grads = {u: sum(b for a, _, b, _ in alone_walk.grads if a == u) for u in kept}
    assert head_grads["head"] >= model.text_embed.tokens.weight.numel() * 4
    # Offloaded, a gradient nothing sums leaves the device as soon as it is final.
    assert alone_walk.peak(kept, grads_made=True, offloaded=True) < alone
    # Gradients that exist before backward (accumulation) are not made again.
    assert walk(1, 1, 1).peak(kept, grads_made=False) == sum(kept.values())  # at the first unit, all of them held


def test_step_time_counts_one_latency_per_scalar_all_reduce():
    from m6.plan.timing import GPUS, step_time
    cfg = m6config.load(CONFIGS / "tiny.yaml", SMALL + ["train.global_batch_size=16", "train.micro_batch_size=2"])
    hw = GPUS["h100"]
    assert step_time(cfg, 1, 1, 8, hw, None).small_collectives == 0.0
    layers = 2  # tiny: MoE in blocks 1 and 3
    accum = 16 // (4 * 2)
    t = step_time(cfg, 4, 2, 8, hw, None)
    # targets, the sync's reach check, loss/metric sums, stop flag, expert norm (EP 2), routing stats
    assert t.small_collectives == pytest.approx((4 + 1 + layers * accum) * hw.latency_s)
    assert t.total == pytest.approx(t.compute + t.all_to_all + t.grad_sync + t.small_collectives + t.offload + t.update)


def test_offloaded_update_runs_on_the_gpus_host_cores_and_its_copies_overlap():
    from m6.plan.timing import GPUS, HostProfile, step_time
    cfg = m6config.load(CONFIGS / "tiny.yaml", SMALL + ["train.global_batch_size=16", "train.micro_batch_size=2",
                                                        "memory.offload=optimizer+params", "optim.apply_groups=4",
                                                        "memory.host_optimizer=torch"])
    host = HostProfile(threads=1, host_cores_per_gpu=12)
    host._step_costs[("adamw", "torch", False)] = (2e-6, 3e-9)  # as if measured on one thread of this host
    assert host.host_step_s(10, 1000) == pytest.approx((10 * 2e-6 + 1000 * 3e-9) / 12)
    t = step_time(cfg, 4, 2, 8, GPUS["v100"], host)
    from m6.plan.memory import rank_model
    model, accum = rank_model(cfg, 4, 2), 16 // (4 * 2)
    numel = sum(p.numel() for p in model.parameters())
    streamed = sum(p.numel() for b in model.blocks for p in b.parameters())
    # Less than all the copies one after the other (every gradient out in every micro-batch, the
    # blocks in for forward and backward, the weights back): they overlap compute and the update.
    serial = (4.0 * numel * accum + 8.0 * streamed * accum + 4.0 * numel) / (GPUS["v100"].pcie_GBps * 1e9)
    assert 0 < t.offload < serial - min(t.compute, t.update)
    assert t.update == pytest.approx(host.host_step_s(*_tensors_and_elements(cfg, 4, 2)))


def _tensors_and_elements(cfg, world: int, ep: int) -> tuple[int, int]:
    from m6.plan.memory import rank_model
    params = [p for p in rank_model(cfg, world, ep).parameters() if p.requires_grad]
    return len(params), sum(p.numel() for p in params)


def test_the_planner_counts_the_checkpoint_staging_buffer_in_host_memory():
    """An asynchronous save's staging buffer (one host copy of the rank's weights and Adam moments,
    kept from the first save on) is in the host peak m6.plan checks per node: a node whose host
    memory holds the synchronous plans but not the staging buffers rules the asynchronous ones out."""
    from m6.plan.memory import RankMemory
    from m6.plan.search import search
    from m6.plan.timing import GPUS, HostProfile

    tiny = CONFIGS / "tiny.yaml"
    cfgs = {mode: m6config.load(tiny, SMALL + [f"checkpoint.async_save={mode}"]) for mode in ("true", "false")}
    rank = RankMemory(cfgs["true"], 2, 2, "cuda")
    asynchronous, synchronous = rank.report(cfgs["true"]), rank.report(cfgs["false"])
    staged = asynchronous.host["checkpoint staging"]
    states = asynchronous.device["params"] + asynchronous.device["optimizer state"]
    assert states <= staged < states + 64 * 4 * sum(1 for _ in rank.model.parameters())  # + 64-byte padding
    assert "checkpoint staging" not in synchronous.host and asynchronous.peak_host - synchronous.peak_host == staged
    host_gib = 2 * (synchronous.peak_host + staged / 2) / 2**30  # two ranks per node
    only = dict(eps=[2], recompute=("none",), offload=("none",), apply_groups=(1,), a2a=(None,), micro_batches=[1])
    found = {mode: search(cfg, 2, 2, GPUS["h100"], HostProfile(1), host_gib, **only) for mode, cfg in cfgs.items()}
    assert found["false"].feasible and not found["true"].feasible


def test_the_planner_keeps_host_gradients_in_16_bit_where_fp32_ones_do_not_fit():
    """memory.host_grad_dtype in the search: at one micro-batch per step an offloaded layout may keep
    its host gradients in fp16 (V100), 2 bytes per parameter less on the host, and its gradients
    cross PCIe in half the bytes; a node whose host memory holds only those plans gets them."""
    from m6.plan.memory import rank_model
    from m6.plan.search import search
    from m6.plan.timing import GPUS, HostProfile

    cfg = m6config.load(CONFIGS / "tiny.yaml", SMALL + ["train.global_batch_size=2", "checkpoint.async_save=false"])
    # Update groups of an eighth: the fp32 read-back of one group costs less than the 2 bytes saved.
    # Unsharded: sharding the offloaded states (fp16 on a V100 shards too) would fit fp32 by other means.
    only = dict(eps=[2], recompute=("none",), offload=("optimizer+params",), apply_groups=(8,), a2a=(None,),
                micro_batches=[1], shard=("none",))
    everything = search(cfg, 2, 2, GPUS["v100"], HostProfile(1), 1024.0, **only)
    by = {c.host_grad_dtype: c for c in everything.feasible if c.a2a_overlap_degree == 1}
    numel = sum(p.numel() for p in rank_model(cfg, 2, 2).parameters())
    assert by["fp32"].memory.host["grads"] - by["compute"].memory.host["grads"] == 2 * numel
    assert by["compute"].time.offload <= by["fp32"].time.offload
    assert "memory.host_grad_dtype=compute" in by["compute"].overrides()
    assert by["compute"].memory.peak_host < by["fp32"].memory.peak_host
    between = (by["compute"].memory.peak_host + by["fp32"].memory.peak_host) / 2**30  # two ranks per node, halfway
    tight = search(cfg, 2, 2, GPUS["v100"], HostProfile(1), between, **only)
    assert tight.feasible and {c.host_grad_dtype for c in tight.feasible} == {"compute"}
    # With accumulation (2 micro-batches of 1 per rank) 16-bit host gradients are not searched.
    accumulating = m6config.load(CONFIGS / "tiny.yaml", SMALL + ["train.global_batch_size=4", "checkpoint.async_save=false"])
    assert {c.host_grad_dtype for c in search(accumulating, 2, 2, GPUS["v100"], HostProfile(1), 1024.0,
                                              **only).feasible} == {"fp32"}
