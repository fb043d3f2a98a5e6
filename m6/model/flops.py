"""Parameter counts, training FLOPs and a memory estimate for the M6 model.

Works on a model built on the ``meta`` device, so a 10T-parameter config is counted without
allocating it.

FLOPs per token of a training step (forward + backward = 3 x forward; PaLM appendix B):
    6 * N_active  +  12 * num_layers * d_model * S
N_active counts every weight a token multiplies by: attention, dense FFNs, routers, patch
projection and the LM head, plus experts scaled by (assignments per token / num_experts) since a
token only visits K of the E experts. Embedding lookups are free. 12 * L * D * S is QK^T and AV
(2 * 2 * S * D multiply-adds per token and layer, x3 for backward) over the full prefix-LM
context S = image patches + text length.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from m6.config import ModelConfig, num_patches
from m6.moe import GroupedExperts, MoELayer


@dataclass
class ModelSize:
    total: int  # every parameter
    expert: int  # parameters inside expert FFNs
    embedding: int  # token, position and modality tables (lookups: no FLOPs)
    active: int  # parameters a token multiplies by (experts scaled by K/E, LM head included)


def count_parameters(model: nn.Module) -> ModelSize:
    """Exact counts from the module tree (meta tensors welcome)."""
    total = sum(p.numel() for p in model.parameters())
    expert = active_expert = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            n = sum(p.numel() for p in module.experts.parameters())
            expert += n
            active_expert += n * module.router.num_assignments / module.num_experts
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    head = 0
    lm_head = getattr(model, "lm_head", None)
    text_embed = getattr(model, "text_embed", None)
    if lm_head is None and text_embed is not None:
        head = text_embed.tokens.weight.numel()  # tied: the embedding table is used as a matmul
    active = total - expert - embedding + head + int(active_expert)
    return ModelSize(total=total, expert=expert, embedding=embedding, active=active)


def training_flops_per_token(cfg: ModelConfig, size: ModelSize, seq_len: int) -> float:
    """Forward+backward FLOPs per token for a context of ``seq_len`` text + the image patches."""
    context = num_patches(cfg) + seq_len
    return 6.0 * size.active + 12.0 * cfg.num_layers * cfg.d_model * context


def memory_estimate_bytes(cfg: ModelConfig, size: ModelSize, seq_len: int, micro_batch: int) -> dict[str, float]:
    """Rough per-process training memory with fp32 AdamW and no memory features.

    Model states: 4 B params + 4 B grads + 8 B Adam moments = 16 B/param. Activations (fp32,
    saved for backward, per layer and token): ~8 D for attention (norm in, qkv, output, residual),
    2 D + 2 F for a dense FFN (norm in, hidden, activation, output), and K * (D + 2 F_e) + 2 E for an MoE FFN (permuted input, hidden,
    activation; router logits/probs). An estimate: the memory issue measures and refines it.
    """
    d, f, moe = cfg.d_model, cfg.ffn_dim, cfg.moe
    fe = moe.ffn_dim or f
    k = moe.num_prototypes * moe.top_k
    tokens = micro_batch * (num_patches(cfg) + seq_len)
    per_token = 0.0
    for i in range(cfg.num_layers):
        per_token += 8 * d
        if moe.every > 0 and (i + 1) % moe.every == 0:
            per_token += k * (d + 2 * fe) + 2 * moe.num_experts
        else:
            per_token += 2 * d + 2 * f
    return {
        "params": 4.0 * size.total,
        "grads": 4.0 * size.total,
        "optimizer": 8.0 * size.total,
        "activations": 4.0 * per_token * tokens,
    }
