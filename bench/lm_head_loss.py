"""The LM head + cross-entropy at a real vocabulary: unchunked (fp32 [targets, vocab] logits kept
for backward) vs m6's chunked head (model.loss_chunk_rows), forward + backward under bf16 autocast
with an fp32 head weight: peak device bytes above the inputs, milliseconds, and the loss and
gradient agreement.

    python -m bench.lm_head_loss --out DIR                       # 16,384 targets, d 2048, V 151,936
    python -m bench.lm_head_loss --out DIR --targets 64 --d-model 32 --vocab 1000   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from m6.model.chunked_cross_entropy import chunk_rows_for, linear_cross_entropy_sum


def _step(kind: str, h, w, labels, chunk_rows: int):
    with torch.autocast(h.device.type, dtype=torch.bfloat16):
        if kind == "unchunked":
            loss = F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum")
        else:
            loss = linear_cross_entropy_sum(h, w, labels, chunk_rows, torch.bfloat16)
    return loss, torch.autograd.grad(loss, (h, w))


def measure(targets: int, d_model: int, vocab: int, device: torch.device, reps: int = 5) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(targets, d_model, generator=g).to(device).requires_grad_()
    w = (torch.randn(vocab, d_model, generator=g) * 0.02).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (targets,), generator=g).to(device)
    chunk_rows = chunk_rows_for("auto", vocab)
    out = {"targets": targets, "d_model": d_model, "vocab": vocab, "chunk_rows": chunk_rows, "device": str(device)}
    results = {}
    for kind in ("unchunked", "chunked"):
        times = []
        for i in range(reps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            loss, grads = _step(kind, h, w, labels, chunk_rows)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first call warms up
                times.append((time.perf_counter() - t0) * 1e3)
        entry = {"ms_median": statistics.median(times), "loss": float(loss)}
        if device.type == "cuda":
            entry["peak_bytes_above_inputs"] = torch.cuda.max_memory_allocated(device) - base
        results[kind] = (entry, grads)
        out[kind] = entry
    (dh_u, dw_u), (dh_c, dw_c) = results["unchunked"][1], results["chunked"][1]
    out["rel_diff_dh"] = float((dh_c - dh_u).norm() / dh_u.norm())
    out["rel_diff_dw"] = float((dw_c - dw_u).norm() / dw_u.norm())
    out["rel_diff_loss"] = abs(out["chunked"]["loss"] - out["unchunked"]["loss"]) / abs(out["unchunked"]["loss"])
    return out


def markdown(r: dict) -> list[str]:
    rows = [f"LM head + cross-entropy, {r['targets']:,} targets, d {r['d_model']}, vocab {r['vocab']:,} "
            f"(chunks of {r['chunk_rows']} rows), bf16 autocast, {r['device']}:",
            "| head | ms fwd+bwd | peak bytes above inputs |", "|---|---|---|"]
    for kind in ("unchunked", "chunked"):
        e = r[kind]
        peak = e.get("peak_bytes_above_inputs")
        rows.append(f"| {kind} | {e['ms_median']:.2f} | {'-' if peak is None else f'{peak / 2**30:.2f} GiB'} |")
    rows.append(f"relative difference chunked vs unchunked: loss {r['rel_diff_loss']:.1e}, "
                f"d hidden {r['rel_diff_dh']:.1e}, d weight {r['rel_diff_dw']:.1e}")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--targets", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    result = measure(args.targets, args.d_model, args.vocab, torch.device(args.device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lm_head_loss.json").write_text(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
