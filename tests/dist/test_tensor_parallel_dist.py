"""Tensor parallel on real gloo processes: tp 2 (and tp 2 x ep 2 at world 4) train with the
single-process losses and gradient norms (dropless, fp32) over 10 steps."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import train_ranks
from test_train_world_sizes import SMALL, TINY, assert_same_curve, train_rows

# Dense and MoE blocks (every second block MoE); checkpoints only where a test resumes.
COMMON = ["train.max_steps=10", "model.moe.every=2", "model.num_layers=2"]
NO_CHECKPOINTS = "checkpoint.enabled=false"
# The M6 block (layernorm, gelu, learned positions, biases) and a Llama/Qwen3-style one (rmsnorm,
# swiglu, rotary, grouped-query attention with 4 query and 2 key/value heads, per-head q/k norm,
# q/k/v biases only), whose fused qkv rows must be split per section, with a gated shared expert
# and the aux-free expert bias in its MoE layer (both replicated across the tp group).
ARCHS = {
    "m6": ["model.num_heads=2"],
    "gqa-swiglu": ["model.num_heads=4", "model.num_kv_heads=2", "model.norm=rmsnorm", "model.ffn_activation=swiglu",
                   "model.positions=rope", "model.qk_norm=head", "model.linear_bias=false",
                   "model.attention_bias=true", "model.moe.num_shared_experts=1", "model.moe.shared_expert_gate=true",
                   "model.moe.expert_bias_update_rate=0.01"],
}


def run(run_dir, nproc: int, *overrides: str) -> list[dict]:
    """The metrics rows of a run (checkpoint.every=5 from SMALL: a checkpoint at step 5 unless
    NO_CHECKPOINTS is among the overrides); rank 0's console output in ``run.stdout``."""
    results = train_ranks(nproc, ["--config", TINY, *SMALL, *COMMON, f"run.dir={run_dir}", *overrides])
    for rank, r in enumerate(results):
        assert r.code == 0, f"rank {rank} exited {r.code}: {r.stderr[-3000:]}"
    run.stdout = results[0].stdout
    return train_rows(run_dir)


def assert_same_weights(run_a, run_b, step: int) -> None:
    """The two runs' checkpoints at ``step``, exported whole, hold the same weights (a replicated
    weight whose gradient missed a tp rank's share drifts here long before the loss shows it)."""
    from safetensors.torch import load_file

    from m6.checkpoint.__main__ import main as checkpoint_cli

    weights = []
    for run_dir in (run_a, run_b):
        out = run_dir / "export.safetensors"
        assert checkpoint_cli(["export", str(run_dir / "checkpoints" / f"step_{step:08d}"), str(out)]) == 0
        weights.append(load_file(out))
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tp2_trains_like_one_process(tmp_path, arch):
    reference = run(tmp_path / "w1", 1, *ARCHS[arch])
    tp = run(tmp_path / "tp2", 2, *ARCHS[arch], "parallel.tensor_parallel_size=2")
    assert_same_curve(tp, reference)
    assert_same_weights(tmp_path / "tp2", tmp_path / "w1", 10)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tp2_sequence_parallel_trains_like_one_process(tmp_path, arch):
    """Sequence parallel: the residual stream in chunks of S over the tp group. Text of 79 tokens
    + 16 image patches: S = 95 does not divide by 2 (chunks of 48 and 47). The curve and the
    weights after 10 steps match one process."""
    args = (*ARCHS[arch], "data.seq_len=79")
    reference = run(tmp_path / "w1", 1, *args)
    tp = run(tmp_path / "sp2", 2, *args, "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true")
    assert_same_curve(tp, reference)
    assert_same_weights(tmp_path / "sp2", tmp_path / "w1", 10)


def test_tp2_by_ep2_at_world_4_trains_like_one_process(tmp_path):
    """Ranks (0, 1) and (2, 3) are the tp groups; the experts split over ranks 0/2 and 1/3 (each tp
    coordinate runs its own all-to-all over the same tokens)."""
    arch = ARCHS["gqa-swiglu"]
    reference = run(tmp_path / "w1", 1, *arch)
    tp = run(tmp_path / "tp2ep2", 4, *arch, "parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=2")
    assert "parallel world 4 = tensor-parallel 2 x expert-parallel 2 x expert-data-parallel 1" in run.stdout
    assert "x 2 tp groups" in run.stdout  # the batch is split over the 2 data-parallel tp groups
    assert_same_curve(tp, reference)
    assert_same_weights(tmp_path / "tp2ep2", tmp_path / "w1", 10)


def test_tp2_bf16_cast_on_use_follows_one_process(tmp_path):
    """bf16 cast-on-use on the local shards: each split Linear casts its own rows; the partial sums
    meet in bf16, so the curve follows one process's bf16 run to 1e-3, not to 1e-5 (measured: 4e-5 on
    the loss, 2e-4 on the gradient norm over 4 steps)."""
    args = (*ARCHS["gqa-swiglu"], NO_CHECKPOINTS, "train.precision=bf16", "train.max_steps=4")
    reference = run(tmp_path / "w1", 1, *args)
    tp = run(tmp_path / "tp2", 2, *args, "parallel.tensor_parallel_size=2")
    for a, b in zip(tp, reference, strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3), (a["step"], key, a[key], b[key])


@pytest.fixture(scope="module")
def gqa_reference(tmp_path_factory):
    """One process, 10 steps, checkpoint at step 5: the curve and the checkpoint both resumes use."""
    run_dir = tmp_path_factory.mktemp("w1")
    return run_dir, run(run_dir, 1, *ARCHS["gqa-swiglu"])


def test_checkpoint_saved_at_tp2_resumes_at_tp1(gqa_reference, tmp_path):
    """tp 2 writes each split tensor as chunks of the global one (the fused qkv: a chunk of each of
    q, k, v per rank), under the names and global shapes one process uses: one process resumes it
    and continues the single-process curve (weights and Adam moments)."""
    reference_dir, reference = gqa_reference
    run(tmp_path / "tp2", 2, *ARCHS["gqa-swiglu"], "parallel.tensor_parallel_size=2", "train.max_steps=5")
    ckpt = tmp_path / "tp2" / "checkpoints" / "step_00000005"
    resumed = run(tmp_path / "tp1", 1, *ARCHS["gqa-swiglu"], NO_CHECKPOINTS, f"checkpoint.resume={ckpt}")
    assert "tensor-parallel size 2 -> 1" in run.stdout
    assert_same_curve(resumed, reference[5:])
    # The export tool reads the chunks back as the global tensors one process saves at step 5.
    assert_same_weights(tmp_path / "tp2", reference_dir, 5)


def test_checkpoint_saved_at_tp1_resumes_at_tp2(gqa_reference, tmp_path):
    reference_dir, reference = gqa_reference
    ckpt = reference_dir / "checkpoints" / "step_00000005"
    resumed = run(tmp_path / "tp2", 2, *ARCHS["gqa-swiglu"], NO_CHECKPOINTS, "parallel.tensor_parallel_size=2",
                  f"checkpoint.resume={ckpt}")
    assert_same_curve(resumed, reference[5:])


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_tp2_recompute_full_trains_like_one_process(tmp_path, sequence_parallel):
    """memory.activation_checkpointing=full at tp 2: every attention sub-block and dense MLP runs
    again in backward, its tp collectives (the row-parallel all-reduce; under sequence parallel the
    all-gather and reduce-scatter) issued again in the same order on both tp ranks; the curve
    matches one process without recompute, and memory.check_checkpointing's gradient comparison
    (with vs without recompute, on every rank) passes."""
    args = (*ARCHS["gqa-swiglu"], NO_CHECKPOINTS, "data.seq_len=79")
    reference = run(tmp_path / "w1", 1, *args)
    sp = ["parallel.sequence_parallel=true"] if sequence_parallel else []
    tp = run(tmp_path / "tp2", 2, *args, *sp, "parallel.tensor_parallel_size=2",
             "memory.activation_checkpointing=full", "memory.check_checkpointing=true", "logging.console=true")
    assert "checkpointing check: largest gradient difference" in run.stdout
    assert_same_curve(tp, reference)


# tp 2 x FSDP2 over 2 data-parallel ranks at world 4: ranks (0, 1) and (2, 3) are the tp groups;
# each tp coordinate's ranks (0, 2) and (1, 3) shard its own parameters (its split shards, the
# replicated rest and, at EP 1, the experts over the expert-data-parallel dim).
TP2_SHARD = ["parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=1"]


@pytest.mark.parametrize("shard, extra", [("optimizer", []), ("full", ["memory.activation_checkpointing=full"]),
                                          ("full", ["parallel.sequence_parallel=true"])],
                         ids=["optimizer", "full-recompute", "full-sequence-parallel"])
def test_tp2_by_shard_over_edp2_at_world_4_trains_like_one_process(gqa_reference, tmp_path, shard, extra):
    """The clip norm counts each tp shard once and every replicated and expert gradient once (each
    tp coordinate holds its own sharded copy of those); the checkpoint's chunks (the FSDP2 rows of
    each tp shard, the fused qkv's q, k and v sections cut by both) export to the one-process
    weights. shard full with full recompute: torchtitan's 2-D layout with activation checkpointing;
    with sequence parallel, the norms' weights (summed over the tp group) are FSDP2's gathered copies."""
    reference_dir, reference = gqa_reference
    tp = run(tmp_path / "tp2", 4, *ARCHS["gqa-swiglu"], *TP2_SHARD, f"parallel.shard={shard}", *extra)
    assert ("tensor-parallel 2 x expert-parallel 1 x expert-data-parallel 2, sharded" in run.stdout
            and f"parallel.shard={shard}" in run.stdout)
    assert_same_curve(tp, reference)
    assert_same_weights(tmp_path / "tp2", reference_dir, 10)


def test_checkpoint_saved_at_tp2_by_shard_resumes_at_world_1_and_back(gqa_reference, tmp_path):
    """tp 2 x shard full at world 4 writes step 5; one process resumes it (weights and Adam moments,
    each a DTensor shard of a tp shard) and continues the one-process curve; and the one-process
    checkpoint resumes at tp 2 x shard and continues it too."""
    reference_dir, reference = gqa_reference
    run(tmp_path / "tp2", 4, *ARCHS["gqa-swiglu"], *TP2_SHARD, "parallel.shard=full", "train.max_steps=5")
    ckpt = tmp_path / "tp2" / "checkpoints" / "step_00000005"
    resumed = run(tmp_path / "tp1", 1, *ARCHS["gqa-swiglu"], NO_CHECKPOINTS, f"checkpoint.resume={ckpt}")
    assert "tensor-parallel size 2 -> 1" in run.stdout
    assert_same_curve(resumed, reference[5:])
    back = run(tmp_path / "back", 4, *ARCHS["gqa-swiglu"], *TP2_SHARD, "parallel.shard=full", NO_CHECKPOINTS,
               f"checkpoint.resume={reference_dir / 'checkpoints' / 'step_00000005'}")
    assert_same_curve(back, reference[5:])


def test_pp2_by_tp2_with_shard_and_recompute_trains_like_one_process(tmp_path):
    """Pipeline 2 x tp 2 at world 4 (mesh ("pp", "edp", "ep", "tp")) with FSDP2 over each stage's
    tp coordinate (one rank: the units, their reduce-scatters and the sharded norm's 1/tp count
    all run) and full recompute of each stage's blocks: the one-process curve over 3 steps."""
    from test_pipeline_parallel_dist import run as pipeline_run

    base = ("data.eval_samples=0", NO_CHECKPOINTS, "train.max_steps=3")
    reference = pipeline_run(tmp_path / "w1", 1, *base)
    rows = pipeline_run(tmp_path / "pp2tp2", 4, *base, "parallel.pipeline_parallel_size=2",
                        "parallel.tensor_parallel_size=2", "parallel.shard=full", "memory.activation_checkpointing=full")
    assert_same_curve(rows, reference)
