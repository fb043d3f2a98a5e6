"""Print a config's model size, FLOPs and per-rank memory estimate without allocating the model.

    python -m m6.inspect configs/m6-10t.yaml [--world-size 512] [--device cuda|cpu] [key=value ...]

The memory is one estimate (m6.memory.estimate, the one the planner sizes layouts with): one
rank's at the layout ``--world-size`` ranks and parallel.expert_parallel_size (auto: the largest
divisor of both the world size and the expert count) give, on ``--device`` (default cuda, whatever
this host has), with the config's memory features; the report prints these assumptions.
"""

from __future__ import annotations

import argparse
import sys

import torch

from m6 import config as m6config
from m6.console_output import write_report
from m6.config_loader import ConfigError
from m6.model.flops import count_parameters, training_flops_per_token
from m6.model.m6_model import build_meta_model
from m6.memory.estimate import COMPONENTS
from m6.memory.memory_report import estimate_memory
from m6.memory.shard_estimate import data_parallel_traffic, shard_layout
from m6.model.param_groups import no_decay_ids
from m6.parallel.layout import LayoutError, resolve_expert_parallel_size
from m6.plan.memory import rank_model


def _human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def _bytes(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def _tied_head(model) -> int:
    """The tied LM head's parameters: counted in ``active`` already as the head's matmul."""
    return model.text_embed.tokens.weight.numel() if model.lm_head is None else 0


def report(cfg: m6config.Config, world_size: int = 1, device_type: str = "cuda") -> dict:
    """Counts and FLOPs of the whole model; memory of one rank at ``world_size`` ranks on ``device_type``."""
    model = build_meta_model(cfg.model)
    ep = resolve_expert_parallel_size(cfg.parallel.expert_parallel_size, world_size, cfg.model.moe.num_experts)
    rank = rank_model(cfg, world_size, ep)
    size = count_parameters(model)
    return {
        "total_params": size.total, "active_params": size.active, "expert_params": size.expert,
        "embedding_params": size.embedding,
        # What a text token uses, counted as published MoE sizes are (Mixtral's 12.9B, Qwen3-30B-A3B's
        # 3.3B): the embedding tables included, the image side (patch projection and positions) not.
        "text_active_params": size.active + size.embedding - _tied_head(model)
                              - sum(p.numel() for p in model.patch_embed.parameters()),
        "flops_per_token": training_flops_per_token(cfg.model, size, cfg.data.seq_len),
        "micro_batch_size": m6config.micro_batch_size(cfg.train, world_size), "moe_layers": len(model.moe_layers()),
        "memory_with_features": estimate_memory(cfg, rank, no_decay_ids(rank), world_size, ep, device_type),
        "world_size": world_size, "expert_parallel_size": ep,
        "data_parallel_traffic": data_parallel_traffic(
            cfg, shard_layout(cfg, rank, no_decay_ids(rank), world_size, ep), world_size, ep, device_type),
    }


def _compute_dtype(cfg: m6config.Config, device_type: str) -> str:
    precision = cfg.train.precision
    if precision == "auto":
        return "bf16 (train.precision=auto on cuda)" if device_type == "cuda" else "fp32 (train.precision=auto on cpu)"
    return f"train.precision={precision}"


def report_lines(cfg: m6config.Config, r: dict, config_name: str, device_type: str) -> list[str]:
    """The printed report: model counts and FLOPs, then the one memory estimate with its assumptions."""
    m, moe, t = cfg.model, cfg.model.moe, cfg.train
    world, ep, mb = r["world_size"], r["expert_parallel_size"], r["micro_batch_size"]
    accumulation = t.global_batch_size // (mb * world)
    cuda_here = torch.cuda.is_available()
    kv = f" ({m6config.num_kv_heads(m)} key/value)" if m6config.num_kv_heads(m) != m.num_heads else ""
    lines = [
        f"config            {config_name}",
        f"layers            {m.num_layers} x d_model {m.d_model}, {m.num_heads} heads{kv} of "
        f"{m6config.head_dim(m)}, ffn {m.ffn_dim}",
        f"MoE               {r['moe_layers']} layers x {moe.num_experts} experts, top-{moe.top_k}"
        + (f" in each of {moe.num_prototypes} prototypes" if moe.num_prototypes > 1 else "")
        + (f", {moe.num_shared_experts} shared" if moe.num_shared_experts else ""),
        f"total params      {_human(r['total_params'])} ({r['total_params']:,})",
        f"active params     {_human(r['active_params'])} per token (experts x K/E, LM head included); "
        f"{_human(r['text_active_params'])} per text token with the embedding tables (as published MoE counts)",
        f"expert params     {_human(r['expert_params'])}",
        f"train FLOPs/token {_human(r['flops_per_token'], 'FLOP')} (6 N_active + 12 L H Dh S, every position "
        f"real and a target: an upper bound)",
        f"memory of one rank, assuming: world size {world} (--world-size), expert-parallel size {ep} "
        f"(parallel.expert_parallel_size={cfg.parallel.expert_parallel_size}), device {device_type} (--device"
        f"{'' if device_type == 'cpu' or cuda_here else '; this host has no CUDA device'}), "
        f"{_compute_dtype(cfg, device_type)}, micro-batch {mb} x accumulation {accumulation} of global batch "
        f"{t.global_batch_size}, every row full (the densest micro-batch)",
    ]
    sharded = "" if cfg.parallel.shard == "none" else f", parallel.shard={cfg.parallel.shard}"
    feat = r["memory_with_features"]
    lines += [f"memory features   optim.apply_groups={cfg.optim.apply_groups}, memory.offload={cfg.memory.offload}, "
              f"recompute {cfg.memory.activation_checkpointing}{sharded}",
              f"  {'':<30} {'device':>14} {'host':>14}"]
    # COMPONENTS, then any a layout adds (memory.offload=zero's 16-bit weight staging).
    names = [*COMPONENTS, *(k for k in {**feat.device, **feat.host} if k not in COMPONENTS)]
    lines += [f"  {k:<30} {_bytes(feat.device.get(k, 0.0)):>14} {_bytes(feat.host.get(k, 0.0)):>14}" for k in names]
    lines += [f"  {'sum of components':<30} {_bytes(feat.total('device')):>14} {_bytes(feat.total('host')):>14}",
              f"  {'peak over a step':<30} {_bytes(feat.peak_device):>14} {_bytes(feat.peak_host):>14}"]
    traffic = r["data_parallel_traffic"]
    lines.append("data-parallel traffic per rank and step (tensor bytes gathered / reduced; a ring sends (n-1)/n of "
                 "them): " + ", ".join(f"{k} {_bytes(v)}" for k, v in traffic.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.moe.num_experts=64")
    p.add_argument("--world-size", type=int, default=1, help="ranks of the job the memory is sized for (default 1)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where the job runs, whatever this host has (default cuda; train.precision=auto is bf16 "
                        "on cuda, fp32 on cpu)")
    args = p.parse_intermixed_args(argv)
    try:
        cfg = m6config.load(args.config, args.overrides)
        if args.world_size <= 0:
            raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
        r = report(cfg, args.world_size, args.device)
    except (ConfigError, LayoutError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    write_report(report_lines(cfg, r, args.config, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
