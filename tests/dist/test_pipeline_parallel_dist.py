"""Pipeline parallel on real gloo processes: pp 2 (each schedule; with full recompute; with
compiled blocks), pp 4 (1f1b), pp 2 x ep 2 and pp 2 x tp 2 at world 4 train with the
single-process losses and gradient norms (dropless, fp32) over 10 steps."""

from __future__ import annotations

import json

import pytest
from dist_helpers import train_ranks
from test_train_world_sizes import SMALL, TINY, assert_same_curve, train_rows

# 4 blocks, every second one MoE (blocks 1 and 3: stages of dense and MoE blocks alike) with the
# aux-free expert bias; 4 micro-batches of 2 per step at world 1 (global batch 8), the pipeline's
# micro-batches. The LM head is tied to the token embedding (the default): the last stage's copy
# and the first stage's sum their gradients (zero_bubble: both stages on rank 0, one weight).
# The caption eval (8 held-out samples, micro-batches of 2) runs at the last step.
COMMON = ["train.max_steps=10", "model.moe.every=2", "model.num_layers=4", "train.micro_batch_size=2",
          "model.moe.expert_bias_update_rate=0.01"]
NO_CHECKPOINTS = "checkpoint.enabled=false"


def run(run_dir, nproc: int, *overrides: str) -> list[dict]:
    """The metrics rows of a run; rank 0's console output in ``run.stdout``."""
    results = train_ranks(nproc, ["--config", TINY, *SMALL, *COMMON, f"run.dir={run_dir}", *overrides])
    for rank, r in enumerate(results):
        assert r.code == 0, f"rank {rank} exited {r.code}: {r.stderr[-3000:]}"
    run.stdout = results[0].stdout
    return train_rows(run_dir)


def assert_same_eval(run_dir, reference_dir) -> None:
    """The caption eval at the last step (through the pipeline's stages) gives one process's losses."""
    def evals(d):
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "eval/caption_loss" in r]
    (a,), (b,) = evals(run_dir), evals(reference_dir)
    for key in ("eval/caption_loss", "eval/caption_loss_shuffled_images"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a[key], b[key])


def assert_same_layer_logs(rows: list[dict], reference: list[dict]) -> None:
    """Rank 0 (stage 0) logs every stage's MoE layers: their load and bias equal one process's."""
    assert reference[-1]["moe/block3/expert_bias_max_abs"] > 0  # the bias really moved
    for a, b in zip(rows, reference, strict=True):
        for key in ("moe/block1/max_tokens", "moe/block3/max_tokens", "moe/block3/router_entropy",
                    "moe/block1/expert_bias_max_abs", "moe/block3/expert_bias_max_abs"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key, a[key], b[key])


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One process, 10 steps, checkpoint at step 5 (SMALL's checkpoint.every): the curve every
    layout must reproduce and the checkpoint the pp 1 -> 2 resume starts from."""
    run_dir = tmp_path_factory.mktemp("w1")
    return run_dir, run(run_dir, 1)


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[1]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero_bubble"])
def test_pp2_trains_like_one_process(tmp_path, reference_run, schedule):
    # zero_bubble: no caption eval (torch's ZBV schedule runs backward actions in its eval; refused)
    no_eval = ["data.eval_samples=0"] if schedule == "zero_bubble" else []
    rows = run(tmp_path, 2, NO_CHECKPOINTS, "parallel.pipeline_parallel_size=2", f"parallel.pipeline_schedule={schedule}",
               *no_eval)
    reference_dir, reference = reference_run
    assert "parallel world 2 = pipeline-parallel 2" in run.stdout
    assert_same_curve(rows, reference)
    assert_same_layer_logs(rows, reference)
    if not no_eval:
        assert_same_eval(tmp_path, reference_dir)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pp2_with_full_recompute_trains_like_one_process(tmp_path, reference, schedule):
    """memory.activation_checkpointing=full at pp 2: each stage recomputes its blocks' parts in the
    schedule's backwards (zero_bubble: in its split input- and weight-gradient backwards); fp32
    recompute is exact, so the curve is one process's without it."""
    rows = run(tmp_path, 2, NO_CHECKPOINTS, "parallel.pipeline_parallel_size=2", "memory.activation_checkpointing=full",
               f"parallel.pipeline_schedule={schedule}", "data.eval_samples=0")
    assert "recompute full" in run.stdout
    assert_same_curve(rows, reference)


def test_pp2_with_compiled_blocks_trains_like_one_process(tmp_path, reference):
    """train.compile=blocks at pp 2 (1f1b): each rank compiles its own stage's blocks' dense parts
    (the MoE layers and the stage's sends eager), on the one-process eager curve. About 15 s on 2
    CPU cores, nearly all of it inductor compiling each rank's regions in the first step."""
    rows = run(tmp_path, 2, NO_CHECKPOINTS, "parallel.pipeline_parallel_size=2", "train.compile=blocks",
               "data.eval_samples=0")
    assert "compile: blocks compiled in" in run.stdout  # rank 0 (stage 0) compiled during step 1
    assert_same_curve(rows, reference)


def test_pp4_trains_like_one_process(tmp_path, reference_run):
    """Four stages of one block each; 4 micro-batches fill the 1F1B pipeline once."""
    reference_dir, reference = reference_run
    rows = run(tmp_path, 4, NO_CHECKPOINTS, "parallel.pipeline_parallel_size=4")
    assert_same_curve(rows, reference)
    assert_same_layer_logs(rows, reference)
    assert_same_eval(tmp_path, reference_dir)


def test_pp2_by_ep2_at_world_4_trains_like_one_process(tmp_path):
    """Stage 0 on ranks 0-1, stage 1 on ranks 2-3; in each stage the experts split over its two
    ranks, which see different batches (their pipelines are (0, 2) and (1, 3)), 2 micro-batches of
    2 each. aux_loss_scope=local: each micro-batch's balance statistics are its own 2 sequences',
    as in the 4 micro-batches of world 1 (global would pool the two ranks' micro-batch i, rows
    another cut than world 1's). An uneven cut: stage 0 holds block 0, stage 1 blocks 1-3; an
    untied LM head."""
    local = ("model.moe.aux_loss_scope=local", NO_CHECKPOINTS, "model.tie_embeddings=false")
    reference = run(tmp_path / "w1", 1, *local)
    rows = run(tmp_path / "pp2ep2", 4, *local, "parallel.pipeline_parallel_size=2", "parallel.expert_parallel_size=2",
               "parallel.pipeline_stages=[0,1]")
    assert "parallel world 4 = pipeline-parallel 2 (1f1b) x expert-parallel 2 x expert-data-parallel 1" in run.stdout
    assert_same_curve(rows, reference)


def test_pp2_by_tp2_at_world_4_trains_like_one_process_and_resumes_at_world_1(tmp_path, reference):
    """The 4-D mesh (pp, edp, ep, tp): stage 0 on ranks 0-1, stage 1 on ranks 2-3, each stage's
    attention and dense MLP split over its tp pair, whose ranks read the same batch (one pipeline
    per tp coordinate: (0, 2) and (1, 3)). Its step-5 checkpoint (each stage's tp shards under the
    whole model's names) resumes at world 1 on the one-process curve."""
    rows = run(tmp_path / "pp2tp2", 4, "parallel.pipeline_parallel_size=2", "parallel.tensor_parallel_size=2",
               "data.eval_samples=0")
    assert "parallel world 4 = pipeline-parallel 2 (1f1b) x tensor-parallel 2 x expert-parallel 1 x " \
           "expert-data-parallel 1" in run.stdout
    assert_same_curve(rows, reference)
    ckpt = tmp_path / "pp2tp2" / "checkpoints" / "step_00000005"
    resumed = run(tmp_path / "w1", 1, NO_CHECKPOINTS, f"checkpoint.resume={ckpt}", "data.eval_samples=0")
    assert "pipeline-parallel size 2 -> 1" in run.stdout
    assert_same_curve(resumed, reference[5:])


def test_bad_pipeline_layouts_exit_2_naming_the_key(tmp_path):
    """One spawn of 2 ranks each: a step of one micro-batch cannot fill 2 stages; 2 pipeline
    stages at world 3 do not divide it (every rank refuses before any collective)."""
    base = ["--config", TINY, *SMALL, *COMMON, NO_CHECKPOINTS, "parallel.pipeline_parallel_size=2"]
    results = train_ranks(2, [*base, f"run.dir={tmp_path / 'a'}", "train.micro_batch_size=null"])
    assert [r.code for r in results] == [2, 2]
    assert "parallel.pipeline_parallel_size=2 needs at least 2 micro-batches per step" in results[0].stderr
    results = train_ranks(3, [*base, f"run.dir={tmp_path / 'b'}", "train.global_batch_size=6"])
    assert [r.code for r in results] == [2, 2, 2]
    assert "parallel.pipeline_parallel_size (2) must divide the number of processes (3)" in results[0].stderr


def test_checkpoint_saved_at_pp2_resumes_at_pp1(reference, tmp_path):
    """Each stage's ranks write its parameters and optimizer state under the whole model's names:
    one process resumes the pp 2 checkpoint (DCP, by name) and continues the single-process curve."""
    run(tmp_path / "pp2", 2, "parallel.pipeline_parallel_size=2", "train.max_steps=5")
    ckpt = tmp_path / "pp2" / "checkpoints" / "step_00000005"
    resumed = run(tmp_path / "pp1", 1, NO_CHECKPOINTS, f"checkpoint.resume={ckpt}")
    assert "pipeline-parallel size 2 -> 1" in run.stdout
    assert_same_curve(resumed, reference[5:])


def test_checkpoint_saved_at_pp1_resumes_at_pp2(reference_run, tmp_path):
    """Each stage loads its own parameters' share of the single-process checkpoint, 1F1B over 2 stages."""
    reference_dir, reference = reference_run
    ckpt = reference_dir / "checkpoints" / "step_00000005"
    resumed = run(tmp_path / "pp2", 2, NO_CHECKPOINTS, "parallel.pipeline_parallel_size=2", f"checkpoint.resume={ckpt}")
    assert "pipeline-parallel size 1 -> 2" in run.stdout
    assert_same_curve(resumed, reference[5:])


@pytest.mark.parametrize("shard", ["full", "optimizer"])
def test_pp2_with_fsdp2_inside_each_stage_trains_like_one_process(tmp_path, shard):
    """parallel.shard inside each stage at world 4: stage 0 on ranks 0-1, stage 1 on ranks 2-3, each
    stage's blocks and its root (embeddings; final norm and the tied head's copy) FSDP2 units over
    its 2 ranks, the experts (EP 1) over the same 2. aux_loss_scope=local as in the pp 2 x ep 2 test
    (2 data-parallel ranks per stage)."""
    local = ("model.moe.aux_loss_scope=local", NO_CHECKPOINTS, "parallel.expert_parallel_size=1")
    reference = run(tmp_path / "w1", 1, *local)
    rows = run(tmp_path / "pp2", 4, *local, "parallel.pipeline_parallel_size=2", f"parallel.shard={shard}")
    assert "parallel world 4 = pipeline-parallel 2 (1f1b) x expert-parallel 1 x expert-data-parallel 2, sharded" \
        in run.stdout
    assert_same_curve(rows, reference)


def test_pp2_fp16_follows_one_process(tmp_path):
    """fp16 cast-on-use with dynamic loss scaling: the losses carry the scale through the schedule's
    backwards (the last stage's loss and every stage's aux), the clip divides it out; the scale's
    search (a skipped first step at 2**16 if it overflows) and the curve match one process's."""
    args = (NO_CHECKPOINTS, "train.precision=fp16", "train.max_steps=4", "train.loss_scale_growth_interval=2")
    reference = run(tmp_path / "w1", 1, *args)
    rows = run(tmp_path / "pp2", 2, *args, "parallel.pipeline_parallel_size=2")
    for a, b in zip(rows, reference, strict=True):
        for key in ("loss", "grad_norm", "loss_scale"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key, a[key], b[key])
