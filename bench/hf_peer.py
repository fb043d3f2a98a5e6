"""The Hugging Face peer of an m6 MoE config: transformers' Qwen3MoeForCausalLM at the same shapes
(d_model, blocks, heads, experts, top-k, expert ffn, vocabulary, sequence length), trained as a
plain HF user would: bf16 parameters, fused AdamW (bf16 moments), SDPA attention, grouped_mm
experts, the router's aux loss on, full rows of random token ids.

    python -m bench.hf_peer --config configs/m6-gpu-finegrained.yaml --micro-batch 16 --accumulation 4

It is not the same model (RMSNorm, RoPE and q/k norms instead of m6's LayerNorm and learned
positions; bf16 weights and moments instead of m6's fp32 masters): the comparison is the cost of
the same MoE shapes and tokens per step, which dominate both.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def qwen3_moe_config(model_cfg, seq_len: int):
    """A Qwen3MoeConfig with an m6 ModelConfig's shapes (every block MoE when moe.every == 1)."""
    from transformers import Qwen3MoeConfig

    moe = model_cfg.moe
    if moe.every != 1:
        raise ValueError(f"the HF peer is built for MoE in every block (model.moe.every=1), got {moe.every}")
    return Qwen3MoeConfig(
        vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.d_model, num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads, num_key_value_heads=model_cfg.num_heads,
        head_dim=model_cfg.d_model // model_cfg.num_heads, intermediate_size=model_cfg.ffn_dim,
        moe_intermediate_size=moe.ffn_dim or model_cfg.ffn_dim, num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, decoder_sparse_step=1, norm_topk_prob=True,
        max_position_embeddings=seq_len, output_router_logits=True, router_aux_loss_coef=moe.aux_loss_coef,
        tie_word_embeddings=model_cfg.tie_embeddings, use_cache=False)


def build(model_cfg, seq_len: int, device: torch.device, experts: str = "grouped_mm"):
    """The peer model in bf16 on ``device`` and the experts implementation it runs."""
    from transformers import AutoModelForCausalLM

    config = qwen3_moe_config(model_cfg, seq_len)
    kwargs = dict(attn_implementation="sdpa", dtype=torch.bfloat16)
    try:
        model = AutoModelForCausalLM.from_config(config, experts_implementation=experts, **kwargs)
    except (TypeError, ValueError):  # a transformers without selectable experts kernels
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    ran = getattr(model.config, "_experts_implementation", None) or "eager"
    return model.to(device), ran


def train_rate(model_cfg, seq_len: int, micro_batch: int, accumulation: int, device: torch.device,
               steps: int = 6, warmup: int = 2, experts: str = "grouped_mm") -> dict:
    """Tokens/s and peak device memory of the peer over ``steps`` timed steps after ``warmup``."""
    torch.manual_seed(0)
    model, ran = build(model_cfg, seq_len, device, experts)
    model.train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused)
    gen = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len), generator=gen).to(device)
               for _ in range(accumulation)]

    def step() -> float:
        for ids in batches:
            out = model(input_ids=ids, labels=ids)
            (out.loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())  # the float() syncs
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    tokens = micro_batch * accumulation * seq_len
    result = {"model": "transformers Qwen3MoeForCausalLM", "experts_implementation": ran,
              "params": sum(p.numel() for p in model.parameters()), "tokens_per_step": tokens,
              "step_time_s_median": median, "tokens_per_s": tokens / median, "loss_last": losses[-1]}
    if device.type == "cuda":
        result["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return result


def main(argv: list[str] | None = None) -> None:
    from m6.config import load

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load(args.config, args.overrides)
    result = train_rate(cfg.model, cfg.data.seq_len, args.micro_batch, args.accumulation, torch.device(args.device),
                        steps=args.steps)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
