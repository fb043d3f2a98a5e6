"""Bytes the M6 forward keeps for backward, from shapes and dtypes alone (no model is run).

The one formula for activation memory: m6.memory.estimate (so m6.inspect) and the planner
(m6.plan) read it. Each term names the tensor autograd saves, as
m6.memory.activation_meter counts it (per storage, parameters left out); a unit test holds the
sum to the meter's count on a real forward.

Shape legend: B micro-batch, S = image patches + text length, T = B*S rows, D d_model, F dense
or expert hidden size, H heads (Hkv key/value heads, Dh head dim; Q = H Dh, Kv = Hkv Dh), E experts (this rank's E/EP for the expert weights), K
assignments per token, N = T*K routed rows, V vocabulary, c bytes of the compute dtype (4 fp32,
2 bf16 or fp16).

Precision: c is the element size of the compute dtype; the residual stream, norms' statistics, the
router and the combine's accumulation stay fp32 whatever it is. Cast-on-use (train.precision bf16
and fp16) keeps no weight copy; plain autocast (bf16-autocast, ``weight_copies``) keeps a
compute-dtype copy of every weight a GEMM multiplies an input that needs a gradient by, until
backward (counted in the part or unit of that GEMM).

Expert kernels (``expert_kernel``): loop and grouped_mm save the same tensors (the gathered rows,
the hidden pre-activations and the activation); fused (m6.moe.fused_experts) saves the
pre-activations only, reads the token rows through the index, and takes the gather and the
weighted combine into its kernels, so no [N, D] tensor is kept at all. Locally it runs in
``GroupedExperts.forward_routed``, outside the recomputable ``experts.forward``: nothing of it is a
recomputable part there (under expert parallelism the grouped form runs inside the part).

Assumptions (the "densest" micro-batch the recompute planner also sizes for): an image in every
row, no padding, a label at every text position but the last; every assignment is kept (perfect
balance under the capacity limit), and under expert parallelism each rank receives as many rows
as it sends. What capacity drops and imbalance change is the guard's business at run time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from m6.config import (ModelConfig, expert_ffn_dim, head_dim, is_moe_block, num_kv_heads, num_patches,
                       shared_expert_ffn_dim)
from m6.model.chunked_cross_entropy import chunk_rows_for
from m6.moe.expert_gemm import fine_grained

# The residual stream stays fp32 (embeddings are fp32; x + bf16 promotes), except where the
# embedding weights themselves are 16-bit (memory.offload=zero's device weights): then every
# residual tensor, its norms' inputs and its gradient are in the compute dtype
# (ActivationShape.residual_bytes).
RESIDUAL_BYTES = 4
INDEX_BYTES = 8  # int64 permutation and label indices


@dataclass(frozen=True)
class ActivationShape:
    """One micro-batch's shape and the precision it runs in."""

    micro_batch: int
    seq_len: int  # text positions
    compute_bytes: int = 4  # 2 under bf16 (cast-on-use or autocast)
    a2a_bytes: int = 4  # the all-to-all payload's element size (model.moe.a2a_dtype)
    expert_parallel_size: int = 1
    # The expert kernel that runs: "loop", "grouped_mm" or "fused" (None: model.moe.expert_kernel,
    # with auto read as a non-fused kernel, what it picks off CUDA; see ``resolved_expert_kernel``).
    expert_kernel: str | None = None
    weight_copies: bool = False  # plain autocast (train.precision=bf16-autocast): weight casts kept
    residual_bytes: int = RESIDUAL_BYTES  # the residual stream's element size (c with 16-bit embeddings)
    norm_stats_bytes: int = 4  # LayerNorm's mean and rstd: fp32, but a 16-bit input's dtype on CPU


def resolved_expert_kernel(setting: str, device_type: str, precision: str, deterministic: bool,
                           num_experts: int, expert_ffn_dim: int) -> str:
    """The kernel ``model.moe.expert_kernel`` = ``setting`` runs with (m6.moe.expert_gemm's rule,
    from the config alone): auto takes the fused kernels on CUDA in bf16 for fine-grained experts
    outside deterministic mode (assuming compute capability 8.0+ and Triton, which come with a
    CUDA torch), else a non-fused one (loop and grouped_mm save the same tensors)."""
    if setting != "auto":
        return setting
    bf16 = precision in ("bf16", "bf16-autocast") or (precision == "auto" and device_type == "cuda")
    if device_type == "cuda" and bf16 and not deterministic and fine_grained(num_experts, expert_ffn_dim):
        return "fused"
    return "loop"


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
    # The same per unit (kept_by_unit's names: "blocks.<i>", "head"): what that unit's backward
    # makes at its worst point, on top of the activations not yet released when it runs (the
    # head's at all of them); a pipeline stage's backward sees its own (m6.plan.pipeline_memory).
    transient_by_unit: dict[str, float] = field(default_factory=dict)

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

    def _add_transient(self, unit: str, nbytes: float) -> None:
        self.transient_by_unit[unit] = max(self.transient_by_unit.get(unit, 0.0), nbytes)
        self.backward_transient = max(self.backward_transient, nbytes)

    def _add_outside(self, unit: str, nbytes: float) -> None:
        self.outside_by_unit[unit] = self.outside_by_unit.get(unit, 0.0) + nbytes


def norm_saved(cfg: ModelConfig, rows: int, stats_bytes: int = 4) -> float:
    """What one norm saves besides its input: LayerNorm its mean and rstd (fp32, or on CPU in the
    dtype of a 16-bit input: ``stats_bytes``); RMSNorm (torch's composite rms_norm) its rstd and
    the normalised input it multiplies the weight by, both fp32 (it computes in fp32)."""
    if cfg.norm == "rmsnorm":
        return RESIDUAL_BYTES * rows * cfg.d_model + 4 * rows
    return 2 * stats_bytes * rows


def qk_saved(cfg: ModelConfig, T: int, S: int, c: int) -> float:
    """What q/k normalisation and rotary positions add to the attention part, as measured on
    torch's ops. An RMSNorm of q or k keeps its normalised input in fp32 and its output (in fp32:
    the output itself; below fp32, where torch's rms_norm meets a low-precision input and an fp32
    weight and computes in fp32, also the fp32 copy of its input, and SDPA keeps its own
    low-precision copy of the output) and an rstd per row and head;
    the per-head norm also leaves SDPA one more q-sized copy. Rotary positions keep the rotated q
    and k (in place of the norms' outputs); below fp32 also the cos/sin tables cast for this
    block. (The fp32 tables, shared by all blocks: rotary_tables.)"""
    H, Hkv, Dh = cfg.num_heads, num_kv_heads(cfg), head_dim(cfg)
    Q, Kv = H * Dh, Hkv * Dh
    rope = "rope" in (cfg.positions, cfg.image_positions)
    tables = 2 * c * S * Dh if rope and c != 4 else 0.0
    per_normed = 8 if c == 4 else 4 + 4 + c  # bytes per element of a normalised q or k
    if cfg.qk_norm == "head":
        return tables + per_normed * T * (Q + Kv) + c * T * Q + 4 * T * (H + Hkv)
    if cfg.qk_norm == "full":
        return tables + per_normed * T * (Q + Kv) + 4 * T * 2
    return tables + (c * T * (Q + Kv) if rope else 0.0)


def rotary_tables(cfg: ModelConfig, S: int, c: int) -> float:
    """The fp32 rotary cos and sin [S, Dh] that every block's q and k multiply by, kept once for all
    blocks in fp32 (below fp32 each block keeps its own cast: qk_saved); 0 without rotary positions."""
    rope = "rope" in (cfg.positions, cfg.image_positions)
    return 2 * 4 * S * head_dim(cfg) if rope and c == 4 else 0.0


def input_casts(activation: str, c: int, residual_bytes: int = RESIDUAL_BYTES) -> int:
    """Copies of its input (a norm's output, in the residual stream's dtype) a DenseMLP keeps:
    none where that is the compute dtype already (fp32, or a 16-bit residual stream: the input
    itself is kept, by whoever owns it, once for every projection); below fp32 one low-precision
    cast per input projection (fc_in, and fc_gate for SwiGLU), each cast by its own op."""
    return 0 if c == residual_bytes else (2 if activation == "swiglu" else 1)


def weight_mats(activation: str) -> int:
    """Weight matrices of an FFN: in and out (+ gate for SwiGLU)."""
    return 3 if activation == "swiglu" else 2


def mlp_hidden_saved(activation: str, rows: int, ffn_dim: int, c: int) -> float:
    """A DenseMLP's saved hidden tensors: GELU keeps fc_in's output and the activation; SwiGLU
    fc_in's and fc_gate's outputs, silu(gate) and the product."""
    return (4 if activation == "swiglu" else 2) * c * rows * ffn_dim


def router_input_saved(cfg: ModelConfig, T: int) -> float:
    """What the router's GEMM keeps of its input: it runs outside autocast, on the (fp32) norm
    output, which it keeps (fp32 and tf32), or on a bf16 cast of it and of its weight
    (router_dtype bf16). Training-mode jitter keeps the fp32 noise beside the jittered copy."""
    D, E = cfg.d_model, cfg.moe.num_experts
    saved = 2 * T * D + 2 * E * D if cfg.moe.router_dtype == "bf16" else 4 * T * D
    return saved + (4 * T * D if cfg.moe.router_jitter > 0 else 0.0)


def expert_kernel_saved(kernel: str, activation: str, N: int, D: int, F: int, c: int) -> float:
    """What the expert FFN of ``kernel`` keeps of N rows (beside its input): loop and grouped_mm the
    hidden output and the activation (+ the gate's output for SwiGLU); fused the pre-activations
    only (h, + g for SwiGLU), the activation recomputed in backward."""
    if kernel == "fused":
        return (2 if activation == "swiglu" else 1) * c * N * F
    return (3 if activation == "swiglu" else 2) * c * N * F


def activation_bytes(cfg: ModelConfig, shape: ActivationShape) -> ActivationBytes:
    """What one micro-batch of ``shape`` keeps for backward in ``cfg``'s model, by part.

    A pure function of the model config's fields and ``shape``: the planner asks for the same
    pair for many candidate layouts, so the result is memoised (bounded) by the config's repr
    (every field, nested ones included) and the shape; each caller gets its own copy."""
    return _copy_of(_activation_bytes_cached(repr(cfg), shape, cfg))


def _copy_of(acts: ActivationBytes) -> ActivationBytes:
    return ActivationBytes(dict(acts.outside_by_unit), dict(acts.parts), acts.a2a_buffers, acts.backward_transient,
                           dict(acts.transient_by_unit))


_ACTIVATION_CACHE: OrderedDict = OrderedDict()
_ACTIVATION_CACHE_SIZE = 4096


def _activation_bytes_cached(key: str, shape: ActivationShape, cfg: ModelConfig) -> ActivationBytes:
    """``_activation_bytes(cfg, shape)`` remembered under (``key`` = repr(cfg), ``shape``); least
    recently used entries dropped past ``_ACTIVATION_CACHE_SIZE``."""
    entry = (key, shape)
    acts = _ACTIVATION_CACHE.get(entry)
    if acts is None:
        acts = _ACTIVATION_CACHE[entry] = _activation_bytes(cfg, shape)
        if len(_ACTIVATION_CACHE) > _ACTIVATION_CACHE_SIZE:
            _ACTIVATION_CACHE.popitem(last=False)
    else:
        _ACTIVATION_CACHE.move_to_end(entry)
    return acts


def _activation_bytes(cfg: ModelConfig, shape: ActivationShape) -> ActivationBytes:
    """``activation_bytes`` computed."""
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
    r = shape.residual_bytes
    # What a norm keeps of its input (the residual stream): LayerNorm the input itself; torch's
    # RMSNorm computes in fp32 and keeps the fp32 upcast of a 16-bit input instead.
    rn = r if cfg.norm == "layernorm" else RESIDUAL_BYTES
    Q, Kv = H * head_dim(cfg), num_kv_heads(cfg) * head_dim(cfg)
    norm_stats = norm_saved(cfg, T, shape.norm_stats_bytes)
    kernel = shape.expert_kernel or ("loop" if moe.expert_kernel == "auto" else moe.expert_kernel)
    wc = c if shape.weight_copies else 0  # bytes per element of autocast's kept weight copies
    out = ActivationBytes()

    # Embeddings: the flattened patches (the linear projection's input, or the conv stem's: the
    # same bytes; the linear's weight is not kept, the images need no gradient) and small index
    # tensors: the token ids, and the position ids of learned position tables (text [L], image
    # rows/columns [grid]).
    index_ids = B * L + (L if cfg.positions == "learned" else 0) \
        + (cfg.image_size // cfg.patch_size if cfg.image_positions == "learned" and P else 0)
    out._add_outside("embeddings", B * P * cfg.image_channels * cfg.patch_size ** 2 * c + INDEX_BYTES * index_ids
                     + rotary_tables(cfg, S, c))
    if cfg.patch_embed == "conv" and P:
        # The conv stem (PatchEmbedding): its output and its GELU's (the projection's input), each
        # [B, stem, H, W]; under plain autocast both convs' weight copies (a conv keeps its weight
        # even where its input needs no gradient).
        stem, C, p = max(16, D // 4), cfg.image_channels, cfg.patch_size
        out._add_outside("embeddings", 2 * c * B * stem * cfg.image_size ** 2 + wc * stem * (C * 9 + D * p * p))
    for i in range(cfg.num_layers):
        # Attention part: its input (the block input: the residual stream), norm stats, the
        # qkv input (norm output), the qkv output (q, k, v views), SDPA's float mask [B,1,S,S]
        # and logsumexp [B,H,S], and its output (the out projection's input, a view).
        # q/k norms and rotary positions add their own (qk_saved); plain autocast the qkv and
        # out projections' weight copies.
        attn_saved = (rn * T * D + norm_stats + c * T * D + c * T * (Q + 2 * Kv) + c * B * S * S + 4 * B * H * S
                      + c * T * Q + qk_saved(cfg, T, S, c) + wc * D * (2 * Q + 2 * Kv))
        attn_inputs = r * T * D + B * S * S  # the block input and the boolean mask (shared by all layers)
        out.parts[f"blocks.{i}.attention"] = (attn_saved, attn_inputs)
        # Outside the parts: the FFN norm's input (residual after attention) and stats.
        out._add_outside(f"blocks.{i}", rn * T * D + norm_stats)
        if is_moe_block(cfg, i):
            # Router (outside): its input (router_input_saved), logits and probabilities [T, E],
            # top-k ids and weights; dispatch indices and weights.
            router = router_input_saved(cfg, T) + 2 * 4 * T * moe.num_experts + K * T * (INDEX_BYTES + 4) + 6 * 4 * T
            dispatch = 2 * INDEX_BYTES * N + 4 * N
            gates = 3 if moe.activation == "swiglu" else 2  # hidden and activation (+ gate)
            if ep > 1:
                dispatch += INDEX_BYTES * N  # the received rows' local order
            if kernel == "fused" and ep == 1:
                # The routed form (forward_routed, outside the experts part): the token rows it
                # reads through the index (below fp32 the experts' cast of the norm output) and
                # the pre-activations; no [N, D] tensor, no weight copy.
                dispatch += (c * T * D if c != 4 else 0.0) + expert_kernel_saved(kernel, moe.activation, N, D, Fe, c)
            else:
                # The combine keeps the expert outputs it weighs (for the router weights'
                # gradient; m6.moe.dispatch.sum_rows), not their weighted fp32 copy: the
                # compute dtype locally, the payload dtype of the rows received back under expert
                # parallelism (ungroup, which puts the experts' outputs back in arrival order,
                # keeps only its index).
                dispatch += (c if ep == 1 else shape.a2a_bytes) * N * D
                # The experts part: its rows and the kernel's hidden tensors; plain autocast casts
                # each whole expert weight stack once per layer (the fused kernels cast tiles).
                weights = 0 if kernel == "fused" else \
                    wc * weight_mats(moe.activation) * (moe.num_experts // ep) * D * Fe
                experts_saved = c * N * D + expert_kernel_saved(kernel, moe.activation, N, D, Fe, c) + weights
                out.parts[f"blocks.{i}.experts"] = (experts_saved, c * N * D)
            out._add_outside(f"blocks.{i}", router + dispatch)
            if ep > 1:
                # Sent and received payload of the dispatch (the combine's is the same size).
                out.a2a_buffers = max(out.a2a_buffers, 2 * shape.a2a_bytes * N * D)
            layer_transient = c * N * Fe * (gates - 1) + 2 * c * N * D + 4 * T * D
            if moe.num_shared_experts:
                # In fp32 its input is the router's (kept outside already); below fp32 each of its
                # input projections keeps its own low-precision cast of the input. The gate keeps
                # the shared output it scales and its sigmoid (and its own input cast). With a
                # 16-bit residual stream the norm's 16-bit output is kept once for all of them
                # (the router keeps its own fp32 cast).
                Fs = shared_expert_ffn_dim(cfg)
                casts = input_casts(moe.activation, c, r) if r != c else int(c != 4)
                copies = wc * weight_mats(moe.activation) * D * Fs
                out.parts[f"blocks.{i}.shared_experts"] = (mlp_hidden_saved(moe.activation, T, Fs, c)
                                                           + casts * c * T * D + copies, casts * c * T * D)
                if moe.shared_expert_gate:
                    out._add_outside(f"blocks.{i}", c * T * D + 4 * T + (c * T * D if c != r else 0) + wc * D)
                layer_transient = max(layer_transient, mlp_hidden_saved(moe.activation, T, Fs, c) / 2 + 4 * T * D)
        else:
            hidden = mlp_hidden_saved(cfg.ffn_activation, T, Fd, c)
            inputs = max(1, input_casts(cfg.ffn_activation, c, r)) * c * T * D
            copies = wc * weight_mats(cfg.ffn_activation) * D * Fd
            out.parts[f"blocks.{i}.mlp"] = (inputs + hidden + copies, inputs)
            layer_transient = hidden / 2 + 2 * c * T * Fd * (cfg.ffn_activation == "swiglu") + 4 * T * D
        # Attention's backward: dq, dk, dv and the incoming gradient, beside the residual's.
        layer_transient = max(layer_transient, c * T * (2 * Q + 2 * Kv) + r * T * D)
        out._add_transient(f"blocks.{i}", layer_transient)
    # Head: final norm input (last residual) and stats, the gathered target rows (the output
    # projection's input: in the compute dtype, and under plain autocast its weight copy), fp32
    # logits and labels. The backward's first transients: the gradient of the log-probabilities
    # (nll_loss_backward, fp32, the logits' size) and the logits' (log_softmax_backward, the same),
    # both alive while the second is made, beside every activation.
    # Chunked (model.loss_chunk_rows): the fp32 target rows and one fp32 log-sum-exp per row
    # instead of the logits, no weight copy kept; one chunk's logits (compute dtype and fp32)
    # formed again in backward.
    targets = B * (L - 1)
    head_norm = norm_stats if cfg.norm == "layernorm" else norm_saved(cfg, B * L)
    chunk = chunk_rows_for(cfg.loss_chunk_rows, V)
    if 0 < chunk < targets:
        out._add_outside("head", rn * T * D + head_norm + targets * (r * D + 4 + INDEX_BYTES) + B * L)
        out._add_transient("head", (c + 4) * chunk * V)
    else:
        out._add_outside("head", rn * T * D + head_norm + targets * (c * D + 4 * V + INDEX_BYTES) + B * L + wc * V * D)
        out._add_transient("head", 2 * 4 * targets * V)
    return out
