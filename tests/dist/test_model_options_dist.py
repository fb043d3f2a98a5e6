"""The Hugging Face families' block options trained on gloo: EP 2 over two ranks follows world 1's
curve, and a resume at EP 2 from world 1's checkpoint continues it (the shared experts, q/k norms and
dense SwiGLU blocks are replicated weights, the routed experts split, in the checkpoint and on resume).
"""

from __future__ import annotations

from test_train_world_sizes import assert_same_curve, ranks, single, train_rows

OPTIONS = [
    "model.num_layers=3", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8", "model.norm=rmsnorm",
    "model.positions=rope", "model.image_positions=rope", "model.qk_norm=head", "model.linear_bias=false",
    "model.attention_bias=true", "model.ffn_activation=swiglu", "model.tie_embeddings=false",
    "model.moe.activation=swiglu", "model.moe.num_shared_experts=1", "model.moe.shared_expert_ffn_dim=24",
    "model.moe.shared_expert_gate=true", "model.moe.first_dense_blocks=1", "model.moe.routed_scaling_factor=1.5",
    "train.max_steps=6", "checkpoint.every=3",
]


def test_options_train_alike_at_ep2_and_resume_there(tmp_path):
    """Three short runs (world 1; world 2 at EP 2; EP 2 resumed from world 1's step 3): about 25 s
    on a loaded 2-core machine, the price of one real launch per layout."""
    single(tmp_path / "w1", *OPTIONS)
    ranks(tmp_path / "ep2", 2, *OPTIONS, "parallel.expert_parallel_size=2")
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    ranks(resumed, 2, *OPTIONS, "parallel.expert_parallel_size=2",
          f"checkpoint.resume={tmp_path / 'w1' / 'checkpoints' / 'step_00000003'}")
    w1, ep2, rows = (train_rows(tmp_path / name) for name in ("w1", "ep2", "resumed"))
    assert [r["step"] for r in w1] == list(range(1, 7))
    assert w1[-1]["lm_loss"] < w1[0]["lm_loss"]
    assert_same_curve(ep2, w1)
    assert_same_curve(rows, w1[3:])
