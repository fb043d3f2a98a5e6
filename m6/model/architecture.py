"""A one-line description of a model config's block options where they differ from the M6 block
(model.norm, positions, heads, q/k norm, biases, activations, shared experts), for the banner."""

from __future__ import annotations

from m6.config import ModelConfig, head_dim, num_kv_heads


def block_options(cfg: ModelConfig) -> str:
    """The non-default block options, comma-separated ("" for the M6 block)."""
    parts = []
    if cfg.norm != "layernorm":
        parts.append(cfg.norm)
    rope = [name for name, kind in (("text", cfg.positions), ("image", cfg.image_positions)) if kind == "rope"]
    if rope:
        parts.append(f"RoPE ({'+'.join(rope)}, theta {cfg.rope_theta:g})")
    if num_kv_heads(cfg) != cfg.num_heads:
        parts.append(f"GQA {num_kv_heads(cfg)} key/value heads")
    if cfg.head_dim is not None:
        parts.append(f"head dim {head_dim(cfg)}")
    if cfg.qk_norm != "none":
        parts.append(f"q/k norm {'per head' if cfg.qk_norm == 'head' else 'over the projection'}")
    if not cfg.linear_bias:
        parts.append("q/k/v biases only" if cfg.attention_bias else "no biases")
    if cfg.ffn_activation != "gelu":
        parts.append(f"{cfg.ffn_activation} dense MLPs")
    moe = cfg.moe
    if moe.num_shared_experts:
        parts.append(f"{moe.num_shared_experts} shared expert{'s' if moe.num_shared_experts > 1 else ''}"
                     + (" (gated)" if moe.shared_expert_gate else ""))
    if moe.first_dense_blocks:
        parts.append(f"first {moe.first_dense_blocks} block{'s' if moe.first_dense_blocks > 1 else ''} dense")
    if moe.routed_scaling_factor != 1.0:
        parts.append(f"routed output x{moe.routed_scaling_factor:g}")
    return ", ".join(parts)
