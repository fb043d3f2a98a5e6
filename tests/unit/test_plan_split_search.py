"""The planner's search over tensor and pipeline parallel (m6.plan.search): which layouts it tries,
what their predictions add (tp collectives, the pipeline's bubble and sends, per-stage memory), and
that a tp plan's overrides load and name the layout."""

from __future__ import annotations

import pytest

from m6.config import load
from m6.plan.pipeline import bubble_s, idle_share
from m6.plan.search import search
from m6.plan.timing import GPUS, HostProfile

SMALL = ["model.d_model=256", "model.num_layers=8", "model.num_heads=8", "model.ffn_dim=512", "model.moe.every=2",
         "model.moe.num_experts=8", "data.seq_len=64", "model.max_text_len=64", "model.image_size=32",
         "train.global_batch_size=32", "checkpoint.async_save=false"]
H100 = GPUS["h100"]


def _search(cfg, world, **kw):
    kw.setdefault("apply_groups", (1,))
    kw.setdefault("a2a", (None,))
    kw.setdefault("overlap", (1,))
    return search(cfg, world, 8, H100, HostProfile(1, host_cores_per_gpu=12), 1024, 8, offload=("none",), **kw)


def test_schedule_bubbles_are_torchs_order_replayed():
    assert idle_share("1f1b", 4, 1, 8) == pytest.approx(3 / 11)
    assert idle_share("interleaved", 4, 2, 8) == pytest.approx(3 / 19)
    # ZB-V as torch orders it: half a micro-batch's compute idle at p 4 (not the paper's 0), more
    # with a, attention's weightless share (more input-gradient, less weight-gradient work)
    assert bubble_s("zero_bubble", 4, 2, 8, 3.0, 0.0) == pytest.approx(1.5)
    assert bubble_s("zero_bubble", 4, 2, 8, 3.0, 0.2) > 1.5
    # torch lays ZB-V out for 2p - 1 micro-batches at least and drops the missing ones' actions
    assert bubble_s("zero_bubble", 4, 2, 5, 3.0, 0.0) == pytest.approx(2.0)


def test_tensor_parallel_layouts_are_searched_and_their_overrides_load():
    cfg = load("configs/tiny.yaml", SMALL)
    result = _search(cfg, 4, tps=(1, 2), pps=(1,), recompute=("none",), shard=("none",))
    tp = [c for c in result.feasible if c.tensor_parallel_size == 2]
    assert tp and {c.sequence_parallel for c in tp} == {False, True}
    best = tp[0]
    assert best.time.tensor_parallel > 0 and best.layout_name().startswith("TP 2")
    # The whole step's model FLOPs, not tp x the rank's (its MoE work is replicated over the tp ranks).
    plain = next(c for c in result.feasible if c.tensor_parallel_size == 1)
    assert best.time.model_flops == pytest.approx(plain.time.model_flops, rel=1e-6)
    loaded = load("configs/tiny.yaml", [*SMALL, *best.overrides()])
    assert loaded.parallel.tensor_parallel_size == 2
    # Sequence parallel holds less of the residual stream.
    sp = {c.sequence_parallel: c.memory.peak_device for c in tp if c.micro_batch == best.micro_batch
          and c.expert_parallel_size == best.expert_parallel_size}
    assert sp[True] < sp[False]


def test_tensor_parallel_is_searched_with_shard_and_full_recompute():
    """tp x FSDP2 (the rank model's states sharded over the data-parallel ranks: 1/dp of the tp
    shard) and full recompute (less activation memory, the forward collectives again)."""
    cfg = load("configs/tiny.yaml", SMALL)
    result = _search(cfg, 8, tps=(2,), pps=(1,), eps=[1], recompute=("none", "full"),
                     shard=("none", "full"), micro_batches=[8])
    tp = {(c.shard, c.recompute, c.sequence_parallel): c for c in result.feasible if c.tensor_parallel_size == 2}
    assert {(s, r) for s, r, _ in tp} == {("none", "none"), ("none", "full"), ("full", "none"), ("full", "full")}
    plain, sharded = tp[("none", "none", False)], tp[("full", "none", False)]
    assert sharded.memory.peak_device < plain.memory.peak_device
    assert tp[("none", "full", False)].time.tensor_parallel > plain.time.tensor_parallel
    loaded = load("configs/tiny.yaml", [*SMALL, *tp[("full", "full", False)].overrides()])
    assert (loaded.parallel.tensor_parallel_size, loaded.parallel.shard,
            loaded.memory.activation_checkpointing) == (2, "full", "full")


def test_pipeline_layouts_add_bubble_sends_and_per_rank_memory():
    # No caption eval: m6 refuses it on the zero-bubble schedule (config.check_pipeline), which the
    # search respects.
    cfg = load("configs/tiny.yaml", [*SMALL, "data.eval_samples=0"])
    result = _search(cfg, 4, tps=(1,), pps=(1, 2), recompute=("none",), shard=("none",), micro_batches=[2])
    by = {(c.pipeline_parallel_size, c.pipeline_schedule, c.expert_parallel_size): c for c in result.feasible}
    one = by[(2, "1f1b", 2)]
    m = 32 // 2 // 2  # 8 micro-batches per step
    assert one.time.pipeline_bubble == pytest.approx(one.time.compute / m)  # (p-1) = 1 micro-batch of idle
    assert one.time.pipeline_p2p > 0
    assert by[(2, "interleaved", 2)].time.pipeline_bubble < one.time.pipeline_bubble
    assert by[(2, "zero_bubble", 2)].time.pipeline_bubble < by[(2, "interleaved", 2)].time.pipeline_bubble
    # Half the blocks per rank: fewer weights than the whole model at the same EP; the breakdown
    # names the worst pipeline rank (the first: the most micro-batches in flight) and its buffers.
    plain = next(c for c in _search(cfg, 2, tps=(1,), pps=(1,), recompute=("none",), shard=("none",),
                                    micro_batches=[2]).feasible if c.expert_parallel_size == 2)
    assert one.memory.device["params"] < plain.memory.device["params"]
    assert one.memory.device["pipeline rank 0 of 2 (stages 0): receive buffers (inputs, output gradients)"] > 0
    assert "parallel.pipeline_schedule=1f1b" in one.overrides()


def test_split_degrees_left_out_say_why():
    cfg = load("configs/tiny.yaml", [*SMALL, "model.qk_norm=full"])
    result = _search(cfg, 2, tps=(1, 2), pps=(1,), recompute=("none",), shard=("none",), micro_batches=[16])
    assert "model.qk_norm=full" in result.skipped_splits["tp 2"]
    assert all(c.tensor_parallel_size == 1 for c in result.feasible)


def test_cli_prints_whether_tp_or_pp_wins(capsys):
    from m6.plan.__main__ import main
    from m6.plan.search import pipeline_builds

    rc = main(["configs/tiny.yaml", *SMALL, "memory.host_optimizer=torch", "train.global_batch_size=4", "--gpus", "2",
               "--gpu", "h100", "--top", "1", "--shard", "none"])
    printed = capsys.readouterr().out
    assert rc == 0
    tp_line = next(line for line in printed.splitlines() if line.startswith("TP "))
    assert ("TP wins" in tp_line or "TP loses" in tp_line) and "tp collectives" in tp_line
    if not pipeline_builds():
        assert "PP: no fitting layout with it; left out: pp: this m6 has no parallel.pipeline_parallel_size" in printed


def test_pipelines_only_with_what_they_are_built_with():
    """The search combines pipelines with full recompute (built) and with tensor parallel (pp x tp,
    built; without sequence parallel, which a pipeline refuses; recompute none or full, as tp is
    searched), not with auto recompute or offload (refused with a pipeline); full recompute never
    needs more, and less where the activations set the rank's peak (not where the update's
    temporaries do)."""
    cfg = load("configs/tiny.yaml", SMALL)
    result = _search(cfg, 4, tps=(1, 2), pps=(1, 2), recompute=("none", "auto", "full"), shard=("none",),
                     micro_batches=[2])
    pp = [c for c in result.feasible if c.pipeline_parallel_size > 1]
    assert pp and all(c.recompute in ("none", "full") and c.offload == "none" for c in pp)
    both = [c for c in pp if c.tensor_parallel_size == 2]
    assert both and all(not c.sequence_parallel and c.time.tensor_parallel > 0
                        and c.time.pipeline_bubble > 0 for c in both)
    assert {c.recompute for c in both} == {"none", "full"}
    both = [c for c in both if c.recompute == "none"]
    assert both[0].layout_name().startswith("PP 2") and "TP 2" in both[0].layout_name()
    loaded = load("configs/tiny.yaml", [*SMALL, *both[0].overrides()])
    assert (loaded.parallel.pipeline_parallel_size, loaded.parallel.tensor_parallel_size) == (2, 2)
    # A tp rank of a stage holds half the stage's attention and dense MLP weights.
    alone = next(c for c in pp if c.tensor_parallel_size == 1 and c.pipeline_schedule == both[0].pipeline_schedule
                 and c.expert_parallel_size == both[0].expert_parallel_size and c.recompute == "none")
    assert both[0].memory.device["params"] < alone.memory.device["params"]
    by = {(c.pipeline_schedule, c.expert_parallel_size, c.recompute): c.memory.peak_device for c in pp
          if c.tensor_parallel_size == 1}
    pairs = [(v, by[(s, e, "none")]) for (s, e, r), v in by.items() if r == "full" and (s, e, "none") in by]
    assert pairs and all(full <= none for full, none in pairs) and any(full < none for full, none in pairs)
