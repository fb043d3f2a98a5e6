"""Every tensor one forward keeps for backward, by module, producer, shape and dtype, beside the
activation formula's parts (m6.model.activation_bytes): where a device's saved bytes part from the
formula, this says which tensors do.

    python -m bench.saved_tensors --device cuda --out DIR    # bench/memory's CUDA model, bf16
    python -m bench.saved_tensors --device cpu --out DIR --smoke

Writes DIR/saved_tensors-<device>.json (each saved storage once: module, producer, shape, dtype,
bytes) and prints the per-module totals against the formula's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections import defaultdict
from pathlib import Path

import torch

from m6.memory.activation_meter import is_parameter_cast, storage_key


def saved_by_module(trainer, batch) -> tuple[list[dict], float]:
    """One forward of ``batch`` under saved-tensor hooks: each storage autograd keeps, once, with
    the innermost module running when it was first saved; and the loss."""
    stack: list[str] = ["(outside)"]
    handles = []

    def leave(module, args, output) -> None:  # returns None: the module's output stays as it is
        stack.pop()

    for name, module in trainer.model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name or "(model)")))
        handles.append(module.register_forward_hook(leave))
    params = {storage_key(p) for p in trainer.model.parameters()}
    seen: dict = {}

    def pack(t: torch.Tensor):
        key = storage_key(t)
        if key not in params and key not in seen:
            seen[key] = {"module": stack[-1], "producer": type(t.grad_fn).__name__ if t.grad_fn else "leaf",
                         "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                         "bytes": t.untyped_storage().nbytes(), "parameter_cast": is_parameter_cast(t)}
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lm_sum, _ = trainer.forward_loss(batch)
            lm_sum = lm_sum.detach()
    finally:
        for h in handles:
            h.remove()
    return list(seen.values()), float(lm_sum)


def formula_by_unit(cfg, device_type: str) -> dict[str, float]:
    from m6.memory.estimate import activation_report

    acts = activation_report(cfg, 1, 1, device_type)
    out = dict(acts.outside_by_unit)
    for name, (saved, _) in acts.parts.items():
        out[name] = saved
    return out


def unit_of(module: str, units: set[str]) -> str:
    """The formula's unit (``units``) of what ``module`` saved: blocks.<i>.attention for the
    attention norm and attention, blocks.<i>.mlp for a dense FFN, blocks.<i>.experts for the
    experts, blocks.<i> for the rest of a block (FFN norm, router, dispatch and combine),
    embeddings for the embeddings, head for the final norm and the loss (outside every module)."""
    parts = module.split(".")
    if parts[0] == "blocks" and len(parts) >= 3:
        block = f"blocks.{parts[1]}"
        if parts[2] in ("attn", "attn_norm"):
            return f"{block}.attention"
        if parts[2] == "ffn" and f"{block}.mlp" in units:
            return f"{block}.mlp"
        if parts[2] == "ffn" and len(parts) >= 4 and parts[3] == "experts":
            return f"{block}.experts"
        return block
    if parts[0] in ("patch_embed", "text_embed"):
        return "embeddings"
    return "head"


def main(argv: list[str] | None = None) -> None:
    from bench.memory import COMMON, MODEL
    from m6.config import load
    from m6.train.loop import Trainer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="bench/memory's quick model")
    ap.add_argument("--override", action="append", default=[], help="a config override (repeatable), e.g. "
                    "model.moe.force_balance=true: every assignment kept, the formula's assumption")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    overrides = [*COMMON, *MODEL["quick" if args.smoke else "cuda"], "train.precision=bf16",
                 f"train.device={args.device}", f"run.dir={args.out / 'saved_tensors_run'}", *args.override]
    cfg = load("configs/tiny.yaml", overrides)
    trainer = Trainer(cfg)
    loaded, _ = trainer.loader.next_step()
    batch = loaded[0].batch.to(trainer.device)
    trainer.model.train()
    records, loss = saved_by_module(trainer, batch)
    formula = formula_by_unit(cfg, args.device)
    measured: dict[str, float] = defaultdict(float)
    for r in records:
        measured[unit_of(r["module"], set(formula))] += r["bytes"]
    units = list(dict.fromkeys([*formula, *measured]))
    mib = 2.0 ** 20
    lines = [f"{'unit':<24} {'measured MiB':>12} {'formula MiB':>12}"]
    for u in units:
        lines.append(f"{u:<24} {measured.get(u, 0.0) / mib:>12.2f} {formula.get(u, 0.0) / mib:>12.2f}")
    lines.append(f"{'total':<24} {sum(measured.values()) / mib:>12.2f} {sum(formula.values()) / mib:>12.2f}")
    print("\n".join(lines))
    stem = f"saved_tensors-{args.device}" + ("-" + "-".join(o.split("=")[0].split(".")[-1] for o in args.override)
                                              if args.override else "")
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"device": args.device, "torch": torch.__version__, "overrides": overrides, "loss": loss,
         "measured_by_unit": measured, "formula_by_unit": formula, "records": records}, indent=1))


if __name__ == "__main__":
    main()
