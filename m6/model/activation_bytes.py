"""Bytes the M6 forward keeps for backward, from shapes and dtypes alone (no model is run).

The one formula for activation memory: m6.memory.estimate (so m6.inspect) and the planner
(m6.plan) read it. Each term names the tensor autograd saves, as
m6.memory.activation_meter counts it (per storage, parameters left out); a unit test holds the
sum to the meter's count on a real forward.

Shape legend: B micro-batch, S = image patches + text length, T = B*S rows, D d_model, F dense
or expert hidden size, H heads, E experts (this rank's E/EP for the expert weights), K
assignments per token, V vocabulary, c bytes of the compute dtype (4 fp32, 2 bf16).

Assumptions (the "densest" micro-batch the recompute planner also sizes for): an image in every
row, no padding, a label at every text position but the last; every assignment is kept (perfect
balance under the capacity limit), and under expert parallelism each rank receives as many rows
as it sends. What capacity drops and imbalance change is the guard's business at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from m6.config import ModelConfig, expert_ffn_dim, num_patches

RESIDUAL_BYTES = 4  # the residual stream stays fp32 (embeddings are fp32; x + bf16 promotes)
INDEX_BYTES = 8  # int64 permutation and label indices


@dataclass(frozen=True)
class ActivationShape:
    """One micro-batch's shape and the precision it runs in."""

    micro_batch: int
    seq_len: int  # text positions
    compute_bytes: int = 4  # 2 under bf16 (cast-on-use or autocast)
    a2a_bytes: int = 4  # the all-to-all payload's element size (model.moe.a2a_dtype)
    expert_parallel_size: int = 1


@dataclass
class ActivationBytes:
    """Saved bytes of one micro-batch: per recomputable part (kept when not recomputed / kept when
    recomputed), what is kept outside every part, and the largest transient of one layer."""

    # What is kept outside every part, by where backward releases it: "embeddings", "blocks.<i>"
    # or "head" (backward runs head, blocks last to first, embeddings).
    outside_by_unit: dict[str, float] = field(default_factory=dict)
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (saved, inputs)
    a2a_buffers: float = 0.0  # send + receive payload of one MoE layer's exchange (transient)
    backward_transient: float = 0.0  # gradient buffers alive at once at the backward's worst point

    @property
    def outside(self) -> float:
        return sum(self.outside_by_unit.values())

    def kept(self, recompute: set[str] | None = None) -> float:
        """Bytes kept for backward when the parts ``recompute`` are recomputed (None: none)."""
        recompute = recompute or set()
        return self.outside + sum(inp if name in recompute else saved for name, (saved, inp) in self.parts.items())

    def kept_full(self) -> float:
        return self.kept(set(self.parts))

    def kept_by_unit(self, recompute: set[str] | None = None) -> dict[str, float]:
        """``kept(recompute)`` split by unit (see ``outside_by_unit``), in backward order."""
        recompute = recompute or set()
        units = dict(self.outside_by_unit)
        for name, (saved, inp) in self.parts.items():
            unit = name.rsplit(".", 1)[0]  # blocks.<i>.attention -> blocks.<i>
            units[unit] = units.get(unit, 0.0) + (inp if name in recompute else saved)
        order = ["head", *sorted((u for u in units if u.startswith("blocks.")), key=lambda u: -int(u.split(".")[1])),
                 "embeddings"]
        return {u: units.get(u, 0.0) for u in order}

    def _add_outside(self, unit: str, nbytes: float) -> None:
        self.outside_by_unit[unit] = self.outside_by_unit.get(unit, 0.0) + nbytes


def activation_bytes(cfg: ModelConfig, shape: ActivationShape) -> ActivationBytes:
    """What one micro-batch of ``shape`` keeps for backward in ``cfg``'s model, by part."""
    B, L, c = shape.micro_batch, shape.seq_len, shape.compute_bytes
    P = num_patches(cfg)
    S = P + L
    T = B * S
    D, H, V = cfg.d_model, cfg.num_heads, cfg.vocab_size
    moe = cfg.moe
    K = moe.top_k * moe.num_prototypes
    Fe, Fd = expert_ffn_dim(cfg), cfg.ffn_dim
    N = T * K  # assignments kept (sent by this rank; received, by the balance assumption)
    ep = shape.expert_parallel_size
    r = RESIDUAL_BYTES
    norm_stats = 2 * 4 * T  # LayerNorm's mean and rstd, fp32
    out = ActivationBytes()

    # Embeddings: the flattened patches (the projection's input) and small index tensors.
    out._add_outside("embeddings", B * P * cfg.image_channels * cfg.patch_size ** 2 * c + INDEX_BYTES * B * L)
    for i in range(cfg.num_layers):
        # Attention part: its input (the block input: the residual stream), norm stats, the
        # qkv input (norm output), the qkv output (q, k, v views), SDPA's float mask [B,1,S,S]
        # and logsumexp [B,H,S], and its output (the out projection's input, a view).
        attn_saved = r * T * D + norm_stats + c * T * D + 3 * c * T * D + c * B * S * S + 4 * B * H * S + c * T * D
        attn_inputs = r * T * D + B * S * S  # the block input and the boolean mask (shared by all layers)
        out.parts[f"blocks.{i}.attention"] = (attn_saved, attn_inputs)
        # Outside the parts: the FFN norm's input (residual after attention) and stats.
        out._add_outside(f"blocks.{i}", r * T * D + norm_stats)
        if moe.every > 0 and (i + 1) % moe.every == 0:
            # Router (outside): its input (norm output), logits and probabilities [T, E], top-k
            # ids and weights; dispatch indices; the combine's inputs (expert outputs and their
            # weighted copy) and weights.
            router = c * T * D + 2 * 4 * T * moe.num_experts + K * T * (INDEX_BYTES + 4) + 6 * 4 * T
            dispatch = 2 * INDEX_BYTES * N + 4 * N + 2 * c * N * D
            if ep > 1:
                dispatch += INDEX_BYTES * N  # the received rows' local order
            out._add_outside(f"blocks.{i}", router + dispatch)
            gates = 3 if moe.activation == "swiglu" else 2  # hidden and activation (+ gate)
            experts_saved = c * N * D + gates * c * N * Fe
            out.parts[f"blocks.{i}.experts"] = (experts_saved, c * N * D)
            if ep > 1:
                # Sent and received payload of the dispatch (the combine's is the same size).
                out.a2a_buffers = max(out.a2a_buffers, 2 * shape.a2a_bytes * N * D)
            layer_transient = c * N * Fe * (gates - 1) + 2 * c * N * D + 4 * T * D
        else:
            out.parts[f"blocks.{i}.mlp"] = (c * T * D + 2 * c * T * Fd, c * T * D)
            layer_transient = 2 * c * T * Fd + 4 * T * D
        # Attention's backward: dq, dk, dv and the incoming gradient, beside the residual's.
        layer_transient = max(layer_transient, 4 * c * T * D + r * T * D)
        out.backward_transient = max(out.backward_transient, layer_transient)
    # Head: final norm input (last residual) and stats, the gathered target rows, fp32 logits and
    # labels. The logits' gradient (same size) is the backward's first transient.
    targets = B * (L - 1)
    out._add_outside("head", r * T * D + norm_stats + targets * (4 * D + 4 * V + INDEX_BYTES) + B * L)
    out.backward_transient = max(out.backward_transient, 4 * targets * V)
    return out
