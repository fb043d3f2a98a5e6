"""Print a config's model size, FLOPs and memory estimate without allocating the model.

    python -m m6.inspect configs/m6-10t.yaml [key=value ...]
"""

from __future__ import annotations

import argparse
import sys

import torch

from m6 import config as m6config
from m6.config_loader import ConfigError
from m6.model.flops import count_parameters, memory_estimate_bytes, training_flops_per_token
from m6.model.m6_model import M6Model
from m6.memory.estimate import COMPONENTS, estimate_memory
from m6.train.optim import no_decay_ids


def build_meta_model(cfg: m6config.ModelConfig) -> M6Model:
    """The model with shapes only (no storage): counts are exact at any scale."""
    with torch.device("meta"):
        return M6Model(cfg)


def _human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def _bytes(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def report(cfg: m6config.Config) -> dict:
    model = build_meta_model(cfg.model)
    size = count_parameters(model)
    mb = m6config.micro_batch_size(cfg.train)
    mem = memory_estimate_bytes(cfg.model, size, cfg.data.seq_len, mb)
    return {
        "total_params": size.total, "active_params": size.active, "expert_params": size.expert,
        "embedding_params": size.embedding,
        "flops_per_token": training_flops_per_token(cfg.model, size, cfg.data.seq_len),
        "memory_bytes": mem, "micro_batch_size": mb, "moe_layers": len(model.moe_layers()),
        "memory_with_features": estimate_memory(cfg, model, no_decay_ids(model)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.moe.num_experts=64")
    args = p.parse_args(argv)
    try:
        cfg = m6config.load(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    r = report(cfg)
    m, moe = cfg.model, cfg.model.moe
    print(f"config            {args.config}")
    print(f"layers            {m.num_layers} x d_model {m.d_model}, {m.num_heads} heads, ffn {m.ffn_dim}")
    print(f"MoE               {r['moe_layers']} layers x {moe.num_experts} experts, top-{moe.top_k}"
          + (f" in each of {moe.num_prototypes} prototypes" if moe.num_prototypes > 1 else ""))
    print(f"total params      {_human(r['total_params'])} ({r['total_params']:,})")
    print(f"active params     {_human(r['active_params'])} per token (experts x K/E, LM head included)")
    print(f"expert params     {_human(r['expert_params'])}")
    print(f"train FLOPs/token {_human(r['flops_per_token'], 'FLOP')} (6 N_active + 12 L D S, every position "
          f"real and a target: an upper bound)")
    mem = r["memory_bytes"]
    print(f"memory estimate   (fp32 AdamW, one process, micro-batch {r['micro_batch_size']}, no memory features)")
    for k, v in mem.items():
        print(f"  {k:<15} {v / 2**30:,.1f} GiB")
    print(f"  {'total':<15} {sum(mem.values()) / 2**30:,.1f} GiB")
    feat = r["memory_with_features"]
    print(f"with memory features (optim.apply_groups={cfg.optim.apply_groups}, memory.offload={cfg.memory.offload})")
    print(f"  {'':<30} {'device':>14} {'host':>14}")
    for k in COMPONENTS:
        print(f"  {k:<30} {_bytes(feat.device.get(k, 0.0)):>14} {_bytes(feat.host.get(k, 0.0)):>14}")
    print(f"  {'total':<30} {_bytes(feat.total('device')):>14} {_bytes(feat.total('host')):>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
