"""The typed config tree of an m6 run, and its validation.

YAML file -> these dataclasses -> dotted CLI overrides -> Config.validate(): each section checks its
own keys in its validate(), and the rules between sections live in _check_cross_section. Builders
receive only their own section. Derived values (accumulation steps, patches per image) are functions, not keys.
The generic machinery (type checks, nearest-key suggestions, overrides) is in m6.config_loader.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from m6.config_loader import ConfigError, dump_yaml, load_config, to_dict

BYTE_VOCAB_SIZE = 261  # m6.data.byte_tokenizer.ByteTokenizer: 256 bytes + PAD, BOS, EOS, SEP, IMG
SYNTHETIC_MIN_IMAGE_SIZE = 9  # m6.data.synthetic: a GRID_SIZE (3) x 3 grid, cells >= 3 pixels


def _check_positive(values: dict[str, float]) -> None:
    """Raise for the first dotted key whose value is <= 0."""
    for key, value in values.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")


def _check_non_negative(values: dict[str, float]) -> None:
    """Raise for the first dotted key whose value is < 0 (0 means off or none)."""
    for key, value in values.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")


@dataclass
class MoEConfig:
    """Mixture-of-Experts FFN settings (see m6.moe.MoELayer for the semantics)."""

    every: int = 1  # MoE FFN in every n-th block (1 = all blocks, as M6-T); 0 = dense model
    num_experts: int = 8
    top_k: int = 2  # per prototype group when num_prototypes > 1
    num_prototypes: int = 1
    capacity_factor: Optional[float] = 1.25  # null = dropless
    min_capacity: int = 4
    # Capacity is decided per routing group. sequence: each sequence alone, so a run drops the same
    # assignments at any world size, micro-batch size and accumulation; batch: all tokens of one
    # process's micro-batch (Switch/DeepSpeed semantics; changes with how the batch is split).
    capacity_group: Literal["sequence", "batch"] = "sequence"
    ffn_dim: Optional[int] = None  # expert hidden size; null = model.ffn_dim
    activation: Literal["gelu", "swiglu"] = "gelu"
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    normalize_weights: bool = True
    router_jitter: float = 0.0
    # Benchmarking only (as Megatron's --moe-router-force-load-balancing): every expert gets the
    # same number of assignments whatever the router scores, so speed and memory are measured
    # under the balanced routing that planners and published MFU figures assume. Not for training.
    force_balance: bool = False
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    # global: balance statistics (f_e, P_e) and the z-loss summed over all data-parallel ranks
    # before the loss is formed, so the loss does not depend on how the batch is split.
    aux_loss_scope: Literal["global", "local"] = "global"
    a2a_dtype: Optional[Literal["bf16"]] = None  # expert-parallel all-to-all payload precision
    # Expert-parallel exchanges in this many chunks, each chunk's transfer overlapping the expert
    # compute of its neighbours (1 = one blocking exchange each way; auto = from the payload size,
    # m6.moe.chunked_all_to_all.auto_overlap_degree).
    a2a_overlap_degree: Union[int, Literal["auto"]] = 1
    # How the expert-parallel exchange crosses nodes: flat = one row per (token, expert) assignment
    # straight to the expert's rank; node_aware = one row per (token, node) to a relay rank on that
    # node, which forwards it inside the node and sums the outputs before sending one row back
    # (m6.moe.node_aware_all_to_all; chunked by an integer a2a_overlap_degree like the flat one).
    a2a_dispatch: Literal["flat", "node_aware"] = "flat"
    # Node-limited routing (DeepSeek-V3): the experts form node_groups contiguous groups (m6.parallel
    # places each group on one node when expert parallelism spans nodes) and each token picks its
    # top_k among the experts of its max_nodes_per_token best groups; 0 or null = off.
    node_groups: int = 1
    max_nodes_per_token: Optional[int] = 0
    # Expert GEMMs: loop = one torch.mm per expert; grouped_mm = one torch grouped GEMM per product
    # (on CUDA only in bf16 on compute capability 9.x/10.x, where torch has a fused kernel);
    # fused = m6's Triton kernels (gather in the GEMM load, activation in its epilogue, router-weighted
    # combine in the second GEMM's; needs the triton package; m6.moe.fused_experts);
    # auto = fused on CUDA bf16 with Triton for fine-grained experts (m6.moe.expert_gemm.choose_kernel),
    # else grouped_mm on CUDA bf16 there (d_model/ffn_dim multiples of 8), else loop.
    expert_kernel: Literal["auto", "loop", "grouped_mm", "fused"] = "auto"
    # The router GEMM's precision (weight and logits stay fp32): fp32 exact; tf32 = fp32 inputs on
    # TF32 tensor cores; bf16 = inputs cast to bf16 (Megatron-Core's default); auto = tf32 on CUDA,
    # fp32 elsewhere.
    router_dtype: Literal["auto", "fp32", "tf32", "bf16"] = "auto"
    # Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing
    # the top-k only, moved by this much after every optimizer step toward even load (from the
    # step's global counts); 0 = off. Works with or without aux_loss_coef.
    expert_bias_update_rate: float = 0.0
    # Shared experts (DeepSeek-MoE / Qwen2-MoE): a dense MLP every token goes through beside the
    # routed experts, of num_shared_experts * shared_expert_ffn_dim hidden units (null = the expert
    # ffn_dim), with the experts' activation and no biases; 0 = none. shared_expert_gate: its output
    # is scaled by sigmoid(a Linear D->1 of the token) (Qwen2-MoE).
    num_shared_experts: int = 0
    shared_expert_ffn_dim: Optional[int] = None
    shared_expert_gate: bool = False
    # The first this-many blocks have a dense FFN (model.ffn_dim, model.ffn_activation) whatever
    # model.moe.every says (DeepSeek-MoE's first_k_dense_replace).
    first_dense_blocks: int = 0
    # The routed experts' combined output is multiplied by this (DeepSeek-V2/V3); 1 = off.
    routed_scaling_factor: float = 1.0

    def validate(self) -> None:
        """Check the model.moe keys on their own."""
        _check_positive({"model.moe.num_experts": self.num_experts, "model.moe.top_k": self.top_k,
                         "model.moe.num_prototypes": self.num_prototypes})
        _check_non_negative({"model.moe.every": self.every, "model.moe.min_capacity": self.min_capacity,
                             "model.moe.aux_loss_coef": self.aux_loss_coef, "model.moe.z_loss_coef": self.z_loss_coef,
                             "model.moe.router_jitter": self.router_jitter,
                             "model.moe.num_shared_experts": self.num_shared_experts,
                             "model.moe.first_dense_blocks": self.first_dense_blocks})
        if self.shared_expert_ffn_dim is not None and self.shared_expert_ffn_dim <= 0:
            raise ConfigError(f"model.moe.shared_expert_ffn_dim must be > 0 or null, got {self.shared_expert_ffn_dim}")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ConfigError("model.moe.shared_expert_gate=true needs model.moe.num_shared_experts > 0")
        if not (0 < self.routed_scaling_factor < math.inf):
            raise ConfigError(f"model.moe.routed_scaling_factor must be a finite number > 0, "
                              f"got {self.routed_scaling_factor}")
        if self.num_experts % self.num_prototypes:
            raise ConfigError(f"model.moe.num_experts ({self.num_experts}) must be divisible by "
                              f"model.moe.num_prototypes ({self.num_prototypes})")
        if self.top_k > self.num_experts // self.num_prototypes:
            raise ConfigError(f"model.moe.top_k ({self.top_k}) must not exceed model.moe.num_experts "
                              f"({self.num_experts}) / model.moe.num_prototypes ({self.num_prototypes})")
        if self.capacity_group not in ("sequence", "batch"):
            raise ConfigError(f"model.moe.capacity_group must be 'sequence' or 'batch', got {self.capacity_group!r}")
        if self.capacity_factor is not None and not (0 < self.capacity_factor < math.inf):
            raise ConfigError(f"model.moe.capacity_factor must be a finite number > 0, or null for dropless "
                              f"(no capacity limit), got {self.capacity_factor}")
        if self.ffn_dim is not None and self.ffn_dim <= 0:
            raise ConfigError(f"model.moe.ffn_dim must be > 0 or null, got {self.ffn_dim}")
        if self.router_dtype not in ("auto", "fp32", "tf32", "bf16"):
            raise ConfigError(f"model.moe.router_dtype must be 'auto', 'fp32', 'tf32' or 'bf16', got {self.router_dtype!r}")
        if self.expert_kernel not in ("auto", "loop", "grouped_mm", "fused"):
            raise ConfigError(f"model.moe.expert_kernel must be 'auto', 'loop', 'grouped_mm' or 'fused', "
                              f"got {self.expert_kernel!r}")
        if self.expert_kernel == "fused" and importlib.util.find_spec("triton") is None:
            raise ConfigError("model.moe.expert_kernel=fused needs the 'triton' package, which is not installed "
                              "(pip install triton, or use model.moe.expert_kernel=auto, grouped_mm or loop)")
        if self.a2a_overlap_degree != "auto" and (isinstance(self.a2a_overlap_degree, bool)
                                                  or not isinstance(self.a2a_overlap_degree, int)
                                                  or self.a2a_overlap_degree < 1):
            raise ConfigError(f"model.moe.a2a_overlap_degree must be 'auto' or an integer >= 1, "
                              f"got {self.a2a_overlap_degree!r}")
        if self.a2a_dispatch not in ("flat", "node_aware"):
            raise ConfigError(f"model.moe.a2a_dispatch must be 'flat' or 'node_aware', got {self.a2a_dispatch!r}")
        if self.a2a_dispatch == "node_aware" and self.a2a_overlap_degree == "auto":
            raise ConfigError("model.moe.a2a_dispatch=node_aware takes an integer model.moe.a2a_overlap_degree "
                              "(its chunks are cut before the counts exchange), got 'auto'")
        if self.max_nodes_per_token:
            self._validate_node_limit()
        if not (0 <= self.expert_bias_update_rate < math.inf):
            raise ConfigError(f"model.moe.expert_bias_update_rate must be a finite number >= 0 (0 = off), "
                              f"got {self.expert_bias_update_rate}")
        if self.expert_bias_update_rate > 0 and self.force_balance:
            raise ConfigError("model.moe.expert_bias_update_rate > 0 and model.moe.force_balance=true exclude each "
                              "other: forced routing ignores the scores the bias steers")


    def _validate_node_limit(self) -> None:
        G, M = self.node_groups, self.max_nodes_per_token
        if G < 1 or self.num_experts % G:
            raise ConfigError(f"model.moe.node_groups ({G}) must be >= 1 and divide model.moe.num_experts "
                              f"({self.num_experts})")
        if not 1 <= M <= G:
            raise ConfigError(f"model.moe.max_nodes_per_token ({M}) must be 0 (off) or 1..model.moe.node_groups ({G})")
        if self.top_k > M * (self.num_experts // G):
            raise ConfigError(f"model.moe.top_k ({self.top_k}) must not exceed model.moe.max_nodes_per_token ({M}) "
                              f"x the {self.num_experts // G} experts of a node group")
        if self.num_prototypes != 1 or self.force_balance:
            raise ConfigError("model.moe.max_nodes_per_token needs model.moe.num_prototypes=1 and "
                              "model.moe.force_balance=false")


@dataclass
class ModelConfig:
    """The M6 transformer over [image patches | source text | target text]."""

    vocab_size: int = BYTE_VOCAB_SIZE
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    ffn_dim: int = 512  # dense FFN hidden size (and the expert default)
    max_text_len: int = 128
    image_size: int = 32
    image_channels: int = 3
    patch_size: int = 8
    patch_embed: Literal["linear", "conv"] = "linear"
    tie_embeddings: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Block architecture (defaults: the M6 paper's; the Hugging Face families set the others).
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # every norm: blocks', final, qk_norm's (always RMS)
    # Text positions: learned = a learned 1-D table added to the tokens; rope = 1-D rotary embeddings
    # of q and k (Hugging Face's rotate_half convention, text positions 0..L-1 from the first text token).
    positions: Literal["learned", "rope"] = "learned"
    # Image patch positions: learned 2-D (row + column tables) or 2-D rotary (half of each head's
    # rotary pairs turn with the row, half with the column; head_dim a multiple of 4).
    image_positions: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    num_kv_heads: Optional[int] = None  # grouped-query attention; null = num_heads (multi-head)
    head_dim: Optional[int] = None  # null = d_model / num_heads
    qk_norm: Literal["none", "head", "full"] = "none"  # RMSNorm of q and k: per head (Qwen3) or whole projection (OLMoE)
    linear_bias: bool = True  # biases on attention qkv/out and the dense MLPs (false: Mixtral, Qwen, OLMoE)
    attention_bias: bool = False  # q/k/v biases even when linear_bias is false (Qwen2)
    ffn_activation: Literal["gelu", "swiglu"] = "gelu"  # dense MLPs (shared experts take model.moe.activation)
    # Pseudo-to-real (M6-10T): blocks in consecutive groups of this many share one set of weights
    # (1 = off); delink with train.delink_at_step or `python -m m6.checkpoint delink`.
    share_layers: int = 1
    # The LM head's cross-entropy over chunks of this many target rows, never [targets, vocab]
    # logits at once (m6.model.chunked_cross_entropy): 0 = one pass over every row, auto = rows
    # for ~256 MiB of fp32 logits (a byte vocabulary never chunks; 152k entries: ~440 rows).
    loss_chunk_rows: Union[int, Literal["auto"]] = "auto"
    moe: MoEConfig = field(default_factory=MoEConfig)

    def validate(self) -> None:
        """Check the model keys on their own, then model.moe."""
        _check_positive({
            "model.vocab_size": self.vocab_size, "model.d_model": self.d_model, "model.num_layers": self.num_layers,
            "model.num_heads": self.num_heads, "model.ffn_dim": self.ffn_dim, "model.max_text_len": self.max_text_len,
            "model.image_size": self.image_size, "model.image_channels": self.image_channels,
            "model.patch_size": self.patch_size,
        })
        self._check_attention()
        if self.image_size % self.patch_size:
            raise ConfigError(f"model.image_size ({self.image_size}) must be divisible by "
                              f"model.patch_size ({self.patch_size})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        for key, value in (("model.norm_eps", self.norm_eps), ("model.init_std", self.init_std)):
            if not value > 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
        if self.loss_chunk_rows != "auto" and self.loss_chunk_rows < 0:
            raise ConfigError(f"model.loss_chunk_rows must be auto, 0 (no chunks) or a positive number of rows, "
                              f"got {self.loss_chunk_rows!r}")
        self.moe.validate()
        if self.moe.first_dense_blocks > self.num_layers:
            raise ConfigError(f"model.moe.first_dense_blocks ({self.moe.first_dense_blocks}) exceeds "
                              f"model.num_layers ({self.num_layers})")
        self._check_share_layers()
        expert_ffn = self.moe.ffn_dim if self.moe.ffn_dim is not None else self.ffn_dim
        if self.moe.expert_kernel == "grouped_mm" and (self.d_model % 8 or expert_ffn % 8):
            # The grouped GEMM needs 16-byte strides (8 bf16 elements); auto falls back to the loop instead.
            raise ConfigError(f"model.moe.expert_kernel=grouped_mm needs model.d_model ({self.d_model}) and the expert "
                              f"ffn_dim ({expert_ffn}, model.moe.ffn_dim or model.ffn_dim) to be multiples of 8; "
                              f"use model.moe.expert_kernel=auto or loop")


    def _check_attention(self) -> None:
        for key, value, allowed in (("model.norm", self.norm, ("layernorm", "rmsnorm")),
                                    ("model.positions", self.positions, ("learned", "rope")),
                                    ("model.image_positions", self.image_positions, ("learned", "rope")),
                                    ("model.qk_norm", self.qk_norm, ("none", "head", "full")),
                                    ("model.ffn_activation", self.ffn_activation, ("gelu", "swiglu"))):
            if value not in allowed:
                raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ConfigError(f"model.d_model ({self.d_model}) must be divisible by model.num_heads ({self.num_heads}) "
                              f"when model.head_dim is null")
        if self.head_dim is not None and self.head_dim <= 0:
            raise ConfigError(f"model.head_dim must be > 0 or null, got {self.head_dim}")
        kv = self.num_kv_heads
        if kv is not None and (kv <= 0 or self.num_heads % kv):
            raise ConfigError(f"model.num_kv_heads ({kv}) must be > 0 and divide model.num_heads ({self.num_heads})")
        dh = head_dim(self)
        if "rope" in (self.positions, self.image_positions) and dh % 2:
            raise ConfigError(f"rotary positions need an even head dim, got {dh} (model.head_dim or d_model/num_heads)")
        if self.image_positions == "rope" and dh % 4:
            raise ConfigError(f"model.image_positions=rope needs a head dim divisible by 4 (half the rotary pairs per "
                              f"image axis), got {dh}")
        if not (0 < self.rope_theta < math.inf):
            raise ConfigError(f"model.rope_theta must be a finite number > 0, got {self.rope_theta}")

    def _check_share_layers(self) -> None:
        k = self.share_layers
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"model.share_layers must be an integer >= 1 (1 = no sharing), got {k!r}")
        if self.num_layers % k:
            raise ConfigError(f"model.share_layers ({k}) must divide model.num_layers ({self.num_layers})")
        every = self.moe.every
        for start in range(0, self.num_layers, k):
            kinds = {is_moe_block(self, i) for i in range(start, start + k)}
            if len(kinds) > 1:
                raise ConfigError(f"model.share_layers ({k}) groups blocks {start}..{start + k - 1}, which mix MoE "
                                  f"and dense FFNs (model.moe.every={every}); a group shares one set of weights, so "
                                  f"its blocks must be of one kind: make model.moe.every 1 or a multiple of "
                                  f"model.share_layers")


@dataclass
class DataSourceConfig:
    """One training source: files (paths, globs or brace patterns), their format, and its mixture weight."""

    path: Union[str, list[str]] = ""
    format: Literal["tar", "jsonl", "text"] = "tar"
    weight: float = 1.0

    def validate(self, key: str) -> None:
        """Check this source; ``key`` is its place in the config, e.g. ``data.sources[0]``."""
        paths = [self.path] if isinstance(self.path, str) else list(self.path)
        if not paths or not all(p.strip() for p in paths):
            raise ConfigError(f"{key}.path is empty")
        if not self.weight >= 0:
            raise ConfigError(f"{key}.weight must be >= 0, got {self.weight}")


@dataclass
class SpecialTokensConfig:
    """The token of data.tokenizer's vocabulary that plays each role m6 needs (m6.data.hf_tokenizer).

    Roles may share a token (BERT: eos and sep both [SEP]): m6 finds every boundary by position.
    """

    pad: str = "<pad>"  # fills a row after the target
    bos: str = "<bos>"  # opens the source
    eos: str = "<eos>"  # closes the target (the last label of a row)
    sep: str = "<sep>"  # closes the source; the model predicts the first target token there
    img: Optional[str] = "<img>"  # null: no image token (no batch holds its id; images are patch embeddings)

    def validate(self) -> None:
        """Check that every mapped token is a non-empty string."""
        for role, token in to_dict(self).items():
            if token is not None and not token.strip():
                raise ConfigError(f"data.special_tokens.{role} is empty; name a token of data.tokenizer's vocabulary"
                                  + (" or null" if role == "img" else ""))


@dataclass
class DataConfig:
    """Training data: the built-in synthetic task, or files (WebDataset tars, JSONL manifests, text)."""

    kind: Literal["synthetic", "files"] = "synthetic"
    sources: list[DataSourceConfig] = field(default_factory=list)  # kind=files: a weighted mixture
    tokenizer: Optional[str] = None  # null/"byte" = byte-level; else the path of a tokenizer.json
    special_tokens: SpecialTokensConfig = field(default_factory=SpecialTokensConfig)  # roles -> tokens of it
    tasks: Optional[dict[str, float]] = None  # M6 task weights (caption, denoise, continue, image_denoise)
    # Per-channel mean/std of the corpus's [0, 1] pixels (default: ImageNet's, the usual choice for photos).
    image_mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    image_std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    num_workers: int = 2  # DataLoader worker processes per rank (0 = load in the training process)
    prefetch_factor: int = 2  # micro-batches each worker keeps ready
    num_samples: int = 20000  # kind=synthetic: samples per epoch
    eval_samples: int = 256  # held-out image-caption samples for the caption-loss eval
    seq_len: int = 96  # text tokens per sample (source + target), padded
    text_only_fraction: float = 0.2  # kind=synthetic

    def validate(self) -> None:
        """Check the data keys on their own (data.image_mean/std against the model: _check_cross_section)."""
        _check_positive({"data.num_samples": self.num_samples, "data.seq_len": self.seq_len})
        if self.seq_len < 3:
            raise ConfigError(f"data.seq_len must be >= 3 (BOS and SEP, and room for at least one target token "
                              f"to learn from), got {self.seq_len}")
        _check_non_negative({"data.eval_samples": self.eval_samples})
        if self.num_workers < 0 or self.prefetch_factor <= 0:
            raise ConfigError(f"data.num_workers ({self.num_workers}) must be >= 0 and data.prefetch_factor "
                              f"({self.prefetch_factor}) > 0")
        if self.kind == "files" and not self.sources:
            raise ConfigError("data.sources is empty: data.kind=files needs at least one source "
                              "({path: ..., format: tar|jsonl|text, weight: 1.0})")
        if self.kind == "synthetic" and self.sources:
            raise ConfigError("data.sources is set but data.kind is 'synthetic'; set data.kind=files to train on them")
        for i, src in enumerate(self.sources):
            src.validate(f"data.sources[{i}]")
        if self.sources and not any(src.weight > 0 for src in self.sources):
            raise ConfigError("data.sources: every weight is 0; give at least one source a weight > 0")
        if not 0.0 <= self.text_only_fraction <= 1.0:
            raise ConfigError(f"data.text_only_fraction must be in [0, 1], got {self.text_only_fraction}")
        self.special_tokens.validate()
        defaults = to_dict(SpecialTokensConfig())
        renamed = {role: token for role, token in to_dict(self.special_tokens).items() if token != defaults[role]}
        if self.tokenizer in (None, "byte") and renamed:
            keys = ", ".join(f"data.special_tokens.{role}={token!r}" for role, token in renamed.items())
            raise ConfigError(f"{keys} set, but data.tokenizer is the byte tokenizer, whose special ids are fixed "
                              f"(<pad> <bos> <eos> <sep> <img> = 256..260): remove data.special_tokens, or set "
                              f"data.tokenizer to the tokenizer.json whose tokens you map")


@dataclass
class TrainConfig:
    max_steps: int = 300
    global_batch_size: int = 32
    micro_batch_size: Optional[int] = None  # null = global_batch_size (no accumulation)
    # bf16: cast-on-use (fp32 masters, no bf16 weight copy kept for backward); bf16-autocast: plain
    # torch.autocast (weight casts cached and kept until backward); auto: bf16 on CUDA, fp32 on CPU.
    # fp16: cast-on-use in fp16 with dynamic loss scaling (m6.train.loss_scale; for GPUs without bf16).
    precision: Literal["auto", "fp32", "bf16", "bf16-autocast", "fp16"] = "auto"
    loss_scale_init: float = 65536.0  # fp16: the first loss scale (2**16, torch.amp.GradScaler's)
    loss_scale_growth_interval: int = 2000  # fp16: finite steps in a row before the scale doubles
    loss_scale_min: float = 1.0  # fp16: the floor; an overflow there counts as a bad step
    grad_clip: float = 1.0  # 0 = off
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops
    eval_every: int = 100  # 0 = only at the end
    eval_batches: int = 4
    device: Literal["auto", "cpu", "cuda"] = "auto"
    peak_tflops: Optional[float] = None  # device peak for MFU when m6 does not know the device
    # Bitwise reproducible on CUDA too (torch's deterministic algorithms, pinned cuDNN and cuBLAS
    # workspace; slower there). On CPU m6 is bitwise reproducible either way. See m6.train.determinism.
    deterministic: bool = False
    # Pseudo-to-real: after this step the model.share_layers blocks are delinked in the run (its
    # checkpoint is delinked and the real model resumes from it); 0 = never.
    delink_at_step: int = 0
    # blocks: torch.compile of each block's dense parts (attention sub-block, FFN norm, dense MLP);
    # the MoE layers stay eager (m6.parallel.compile). false: everything eager.
    compile: Literal[False, "blocks"] = False
    # bf16 (or fp16) weights: per_use casts each fp32 weight on use, in forward and again
    # in backward, every micro-batch (cast-on-use); per_step keeps a bf16 copy of those weights, made
    # once per step after the update, with fp32 masters and fp32 gradient accumulation on the device
    # (m6.memory.master_weights: +2 B per weight, no per-use casts).
    weight_copy: Literal["per_use", "per_step"] = "per_use"

    def validate(self) -> None:
        """Check the train keys on their own."""
        _check_positive({"train.max_steps": self.max_steps, "train.global_batch_size": self.global_batch_size,
                         "train.max_bad_steps": self.max_bad_steps, "train.eval_batches": self.eval_batches})
        _check_non_negative({"train.grad_clip": self.grad_clip, "train.eval_every": self.eval_every})
        if self.micro_batch_size is not None:
            if self.micro_batch_size <= 0 or self.global_batch_size % self.micro_batch_size:
                raise ConfigError(f"train.micro_batch_size ({self.micro_batch_size}) must be > 0 and divide "
                                  f"train.global_batch_size ({self.global_batch_size})")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"train.peak_tflops must be > 0 or null, got {self.peak_tflops}")
        if not 0 <= self.delink_at_step < self.max_steps:
            raise ConfigError(f"train.delink_at_step must be >= 0 (0 = never) and below train.max_steps "
                              f"({self.max_steps}), got {self.delink_at_step}")
        _check_positive({"train.loss_scale_init": self.loss_scale_init,
                         "train.loss_scale_growth_interval": self.loss_scale_growth_interval,
                         "train.loss_scale_min": self.loss_scale_min})
        if self.loss_scale_min > self.loss_scale_init:
            raise ConfigError(f"train.loss_scale_min ({self.loss_scale_min}) must not exceed train.loss_scale_init "
                              f"({self.loss_scale_init})")
        defaults = TrainConfig()
        changed = [f"train.{k}={getattr(self, k)}" for k in ("loss_scale_init", "loss_scale_growth_interval",
                                                             "loss_scale_min") if getattr(self, k) != getattr(defaults, k)]
        if changed and self.precision != "fp16":
            raise ConfigError(f"{', '.join(changed)} only apply with train.precision=fp16 (it is "
                              f"{self.precision!r}): loss scaling is for fp16 only")


@dataclass
class MemoryConfig:
    """Memory features (Whale's tricks); each keeps the math unchanged."""

    # zero: ZeRO-Offload's layout (m6.memory.offload): 16-bit weights on the device, fp32 masters
    # and optimizer state on the host, 16-bit gradients to the host, 16-bit weights back.
    offload: Literal["none", "optimizer", "optimizer+params", "zero"] = "none"
    # optimizer+params and zero: which blocks' weights live on the host and stream in (the next one
    # prefetched); the rest stay on the device. all, a list of block indices ([]: none), or auto (as
    # many blocks kept on the device as the memory estimate fits in the CUDA device's memory).
    offload_blocks: Union[Literal["all", "auto"], list[int]] = "all"
    # The optimizer of the offloaded (host) update: DeepSpeed's CPU Adam, torch's AdamW, or auto
    # (DeepSpeed when its C++ op builds or loads, else torch with one console line saying why).
    host_optimizer: Literal["auto", "deepspeed", "torch"] = "auto"
    # The offloaded gradients' dtype on the host: fp32, or the compute dtype (bf16/fp16: half the
    # host bytes). They are never summed on the host (a 16-bit sum would round every add): with
    # accumulation they add up on the device in fp32 and leave once, in the last micro-batch; the
    # update reads each group's gradients back in fp32.
    host_grad_dtype: Literal["fp32", "compute"] = "fp32"
    # zero's streamed blocks: home = a gradient lands in its block's 16-bit host home (one host
    # buffer per parameter for weights and gradient, m6.memory.home_grads); separate = its own
    # buffer; auto = home with host_grad_dtype=compute and without optim.delayed_update.
    zero_grad_landing: Literal["auto", "home", "separate"] = "auto"
    activation_checkpointing: Literal["none", "full", "auto"] = "none"
    # auto: recompute the cheapest parts until saved activations fit this budget. Give GiB, or a
    # fraction of the no-checkpointing activation bytes of the densest micro-batch (no padding,
    # profiled on step 1); neither = 0.5 of them.
    activation_budget_gb: Optional[float] = None
    activation_budget_fraction: Optional[float] = None
    check_checkpointing: bool = False  # step 1: compare gradients with and without checkpointing

    def validate(self) -> None:
        """Check the memory keys: the budget is GiB or a fraction, and applies only to auto."""
        if self.activation_budget_gb is not None and self.activation_budget_fraction is not None:
            raise ConfigError("set memory.activation_budget_gb or memory.activation_budget_fraction, not both")
        if self.activation_budget_gb is not None and self.activation_budget_gb <= 0:
            raise ConfigError(f"memory.activation_budget_gb must be > 0, got {self.activation_budget_gb}")
        if self.activation_budget_fraction is not None and not 0.0 <= self.activation_budget_fraction <= 1.0:
            raise ConfigError(f"memory.activation_budget_fraction must be in [0, 1], got {self.activation_budget_fraction}")
        budget_set = self.activation_budget_gb is not None or self.activation_budget_fraction is not None
        if budget_set and self.activation_checkpointing != "auto":
            raise ConfigError("memory.activation_budget_gb/activation_budget_fraction only apply with "
                              f"memory.activation_checkpointing=auto (it is {self.activation_checkpointing!r})")
        if self.check_checkpointing and self.activation_checkpointing == "none":
            raise ConfigError("memory.check_checkpointing needs memory.activation_checkpointing full or auto")
        if self.offload_blocks != "all" and self.offload not in ("optimizer+params", "zero"):
            raise ConfigError(f"memory.offload_blocks={self.offload_blocks} only applies with "
                              f"memory.offload=optimizer+params or zero (it is {self.offload!r})")
        if isinstance(self.offload_blocks, list) and (
                len(set(self.offload_blocks)) != len(self.offload_blocks)
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in self.offload_blocks)):
            raise ConfigError(f"memory.offload_blocks must be all, auto or a list of distinct block indices, "
                              f"got {self.offload_blocks}")
        if self.host_grad_dtype != "fp32" and self.offload == "none":
            raise ConfigError(f"memory.host_grad_dtype={self.host_grad_dtype} only applies with memory.offload "
                              "optimizer or optimizer+params (without offload no gradient is on the host)")
        if self.zero_grad_landing == "home" and (self.offload != "zero" or self.host_grad_dtype != "compute"):
            raise ConfigError(f"memory.zero_grad_landing=home with memory.offload={self.offload}, memory.host_grad_dtype="
                              f"{self.host_grad_dtype}: the gradient lands in a streamed block's 16-bit home only with "
                              "memory.offload=zero and memory.host_grad_dtype=compute")
        if self.host_optimizer == "deepspeed" and self.offload == "none":
            raise ConfigError("memory.host_optimizer=deepspeed only applies with memory.offload optimizer or "
                              "optimizer+params (without offload the update runs on the device with torch's AdamW)")


@dataclass
class OptimConfig:
    # adamw: torch's AdamW (DeepSpeed's CPU Adam for the offloaded host update, memory.host_optimizer);
    # adafactor: torch.optim.Adafactor, factored second moments (row and column means of a matrix's
    # squared gradients: O(rows + cols) state instead of O(rows x cols)), no first moment.
    name: Literal["adamw", "adafactor"] = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 30
    schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = 0.1  # never applied to norms, biases and embeddings
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    apply_groups: int = 1  # run the update over N size-balanced parameter groups, one after another
    # AdamW's kernels: fused = one kernel per group reading each tensor once (torch's fused AdamW,
    # no temporaries); foreach = torch's multi-tensor ops (a pass per op, temporaries of the largest
    # call); auto = fused where the update runs on CUDA, foreach elsewhere (the host update included).
    implementation: Literal["auto", "foreach", "fused"] = "auto"
    # With memory.offload (unsharded): step t's host update runs in the background while step t+1's
    # forward/backward runs (one step stale, ZeRO-Offload's delayed parameter update); the first
    # delayed_update_after steps update synchronously (the early steps, where the weights move most).
    delayed_update: bool = False
    delayed_update_after: int = 40

    def adamw_kernel(self, on_cuda: bool) -> str:
        """'fused' or 'foreach': the AdamW kernels of an update whose tensors are on CUDA or not.

        auto takes the fused kernel on CUDA: one pass over param, grad and both moments per tensor
        (on an H100 the foreach update of a 2.7B-parameter model took 80 ms of a 272 ms step). On
        the host it keeps foreach, whose results the CPU tests compare bitwise with DeepSpeed's
        and the device's. Adafactor is always foreach.
        """
        if self.name != "adamw":
            return "foreach"
        if self.implementation == "auto":
            return "fused" if on_cuda else "foreach"
        return self.implementation

    def validate(self) -> None:
        """Check the optim keys on their own."""
        _check_non_negative({"optim.warmup_steps": self.warmup_steps, "optim.weight_decay": self.weight_decay})
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= optim.min_lr ({self.min_lr}) <= optim.lr ({self.lr}) and optim.lr > 0")
        for key, value in (("optim.beta1", self.beta1), ("optim.beta2", self.beta2)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{key} must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}")
        if self.apply_groups <= 0:
            raise ConfigError(f"optim.apply_groups must be >= 1, got {self.apply_groups}")
        if self.delayed_update_after < 0:
            raise ConfigError(f"optim.delayed_update_after must be >= 0, got {self.delayed_update_after}")
        if not self.delayed_update and self.delayed_update_after != OptimConfig.delayed_update_after:
            raise ConfigError(f"optim.delayed_update_after={self.delayed_update_after} only applies with "
                              "optim.delayed_update=true")
        if self.name == "adafactor" and self.implementation == "fused":
            raise ConfigError("optim.implementation=fused is AdamW's (torch.optim.Adafactor has no fused kernel): "
                              "use auto or foreach with optim.name=adafactor")
        if self.name == "adafactor":
            defaults = OptimConfig()
            changed = [f"optim.{k}={getattr(self, k)}" for k in ("beta1", "beta2", "eps")
                       if getattr(self, k) != getattr(defaults, k)]
            if changed:
                raise ConfigError(f"{', '.join(changed)} set, but optim.name=adafactor does not use them (no first "
                                  f"moment; its second-moment decay and eps are torch.optim.Adafactor's defaults)")


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "m6"
    name: Optional[str] = None  # null = the run dir's name
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"


@dataclass
class TensorBoardConfig:
    enabled: bool = False  # needs the tensorboard package: pip install tensorboard
    dir: Optional[str] = None  # event files' folder; null = <run.dir>/tb


@dataclass
class LoggingConfig:
    every: int = 10
    console: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)

    def validate(self) -> None:
        """Check the logging keys (logging.wandb has no rules beyond its types)."""
        _check_positive({"logging.every": self.every})
        if self.tensorboard.dir is not None and not self.tensorboard.dir.strip():
            raise ConfigError("logging.tensorboard.dir must be a folder path or null (= <run.dir>/tb), got ''")


@dataclass
class CheckpointConfig:
    every: int = 100  # 0 = only at the end
    # false: no checkpoint is written (benchmark runs: a 2.7B model's final save is 30 GiB); a
    # SIGTERM then stops after the step without one. Resuming from earlier checkpoints still works.
    enabled: bool = True
    keep: int = 2
    # "auto": continue from the latest checkpoint in run.dir if there is one (a requeued or
    # restarted job picks up where it stopped); "none": start fresh (and say so when run.dir
    # already holds checkpoints, which this run's saves then replace); or a checkpoint path.
    resume: Optional[str] = "auto"
    async_save: bool = True  # the step waits only for the copy to host memory; files are written behind it
    # Weights only, from another run's checkpoint (step dir, or run dir: its latest), when this run
    # does not resume: fresh optimizer, schedule and data; a dense FFN fills every expert of an MoE
    # layer at the same place (upcycling, m6.checkpoint.init_from).
    init_from: Optional[str] = None

    def validate(self) -> None:
        """Check the checkpoint keys on their own."""
        _check_positive({"checkpoint.keep": self.keep})
        _check_non_negative({"checkpoint.every": self.every})
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from.strip()):
            raise ConfigError(f"checkpoint.init_from must be a checkpoint path or null, got {self.init_from!r}")


@dataclass
class ParallelConfig:
    """Process layout. Data parallel over all ranks; experts split over expert_parallel_size ranks."""

    expert_parallel_size: Union[int, Literal["auto"]] = "auto"  # auto: largest divisor of world and experts
    bucket_size_mb: float = 25.0  # gradient all-reduce bucket size
    timeout_s: int = 600  # a collective waiting longer than this (a dead rank) fails the run
    # After a failed collective: how long a survivor waits for the other ranks to mark themselves
    # alive before naming those that did not (m6.parallel.peer_check).
    peer_wait_s: float = 10.0
    # Each rank's share of the global batch: even, auto (measured speeds), or one weight per rank.
    balance: Union[Literal["even", "auto"], list[float]] = "even"
    # Sharded data parallel (m6.parallel.fsdp): none = replicas hold everything; optimizer =
    # gradients and optimizer state sharded, parameters gathered once per step (ZeRO-2); full =
    # parameters too, gathered per block and freed after use (FSDP2, ZeRO-3).
    shard: Literal["none", "optimizer", "full"] = "none"
    # Tensor parallel (m6.parallel.tensor_parallel): attention heads and dense FFNs split over this
    # many ranks (the innermost mesh dim); data and expert parallelism run over the rest.
    tensor_parallel_size: int = 1
    # With tensor parallel: the residual stream between split regions cut along the sequence
    # over the tp group (norms and residual adds at 1/tp per rank; m6.parallel.sequence_parallel).
    sequence_parallel: bool = False
    # Pipeline parallel (m6.parallel.pipeline): the block stack cut into stages over this many ranks
    # (the outermost mesh dim); data and expert parallelism run inside each stage.
    pipeline_parallel_size: int = 1
    # The first block of each stage, in stage order (pipeline_parallel_size x stages per rank of
    # them, starting at 0); null = as even a cut as the blocks allow.
    pipeline_stages: Optional[list[int]] = None
    pipeline_schedule: Literal["1f1b", "interleaved", "zero_bubble"] = "1f1b"
    # Stages each pipeline rank runs: 1f1b 1; interleaved >= 2 (default 2); zero_bubble exactly 2
    # (torch's V-shaped ScheduleZBVZeroBubble). null = the schedule's default.
    pipeline_stages_per_rank: Optional[int] = None

    def validate(self) -> None:
        """Check the parallel keys on their own (the world size is known only at start-up)."""
        check_pipeline_keys(self)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size <= 0:
            raise ConfigError(f"parallel.tensor_parallel_size must be a positive integer, got "
                              f"{self.tensor_parallel_size!r}")
        if self.bucket_size_mb <= 0 or self.timeout_s <= 0 or self.peer_wait_s <= 0:
            raise ConfigError(f"parallel.bucket_size_mb ({self.bucket_size_mb}), parallel.timeout_s "
                              f"({self.timeout_s}) and parallel.peer_wait_s ({self.peer_wait_s}) must be > 0")
        if isinstance(self.expert_parallel_size, int) and self.expert_parallel_size <= 0:
            raise ConfigError(f"parallel.expert_parallel_size must be > 0 or 'auto', got {self.expert_parallel_size}")
        if isinstance(self.balance, list) and (not self.balance or not all(0 < w < float("inf") for w in self.balance)):
            raise ConfigError(f"parallel.balance must be even, auto or a list of one weight > 0 per rank, got "
                              f"{self.balance}")


@dataclass
class RunConfig:
    dir: Optional[str] = None  # null = runs/<name>
    name: str = "m6"
    seed: int = 0


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def validate(self) -> None:
        """Check every section on its own (run has no rules beyond its types), then the rules between them."""
        for section in (self.model, self.data, self.train, self.optim, self.logging, self.checkpoint,
                        self.parallel, self.memory):
            section.validate()
        _check_cross_section(self)


def _check_cross_section(cfg: Config) -> None:
    """The rules that tie one section to another, each naming every key involved."""
    m, d = cfg.model, cfg.data
    blocks = cfg.memory.offload_blocks
    if cfg.train.delink_at_step and m.share_layers == 1:
        raise ConfigError(f"train.delink_at_step={cfg.train.delink_at_step} needs model.share_layers > 1 (blocks "
                          f"that share weights to delink)")
    if cfg.train.delink_at_step and not cfg.checkpoint.enabled:
        raise ConfigError(f"train.delink_at_step={cfg.train.delink_at_step} with checkpoint.enabled=false: the "
                          f"delink goes through a checkpoint of the pseudo giant; enable checkpoints")
    streams = cfg.memory.offload == "optimizer+params" or (cfg.memory.offload == "zero" and blocks != [])
    if m.share_layers > 1 and streams:
        raise ConfigError(f"model.share_layers > 1 with memory.offload={cfg.memory.offload}, memory.offload_blocks="
                          f"{blocks}: parameter streaming moves each block's weights on its own and a shared weight "
                          "belongs to several blocks; use memory.offload=none or optimizer (or zero with "
                          "memory.offload_blocks=[])")
    if m.share_layers > 1 and cfg.memory.activation_checkpointing != "none":
        raise ConfigError("model.share_layers > 1 with memory.activation_checkpointing="
                          f"{cfg.memory.activation_checkpointing}: recompute of shared blocks is not supported yet; "
                          "use memory.activation_checkpointing=none")
    if isinstance(blocks, list) and not all(0 <= i < m.num_layers for i in blocks):
        raise ConfigError(f"memory.offload_blocks {blocks}: block indices must be in [0, model.num_layers = "
                          f"{m.num_layers})")
    if d.seq_len > m.max_text_len:
        raise ConfigError(f"data.seq_len ({d.seq_len}) exceeds model.max_text_len ({m.max_text_len})")
    if m.vocab_size < BYTE_VOCAB_SIZE:
        raise ConfigError(f"model.vocab_size ({m.vocab_size}) is smaller than the byte tokenizer's "
                          f"{BYTE_VOCAB_SIZE} ids (data.kind={d.kind})")
    if m.image_channels != 3:
        raise ConfigError(f"model.image_channels must be 3, got {m.image_channels}: m6 decodes every image as RGB "
                          f"(data.kind=files) and renders RGB (data.kind=synthetic)")
    if d.kind == "synthetic" and m.image_size < SYNTHETIC_MIN_IMAGE_SIZE:
        raise ConfigError(f"model.image_size ({m.image_size}) is too small for data.kind=synthetic, which draws "
                          f"shapes on a 3x3 grid of cells at least 3 pixels wide: use >= {SYNTHETIC_MIN_IMAGE_SIZE}")
    if len(d.image_mean) != m.image_channels or len(d.image_std) != m.image_channels or min(d.image_std) <= 0:
        raise ConfigError(f"data.image_mean {d.image_mean} and data.image_std {d.image_std} need "
                          f"model.image_channels ({m.image_channels}) values each, std > 0")
    check_zero_offload(cfg)
    check_shard_offload(cfg)
    check_tensor_parallel(cfg)
    check_pipeline(cfg)
    check_delayed_update(cfg)
    check_weight_copy(cfg)
    if cfg.parallel.shard != "none" and m.share_layers > 1:
        raise ConfigError(f"parallel.shard={cfg.parallel.shard} with model.share_layers={m.share_layers}: FSDP2 shards "
                          "each block's parameters on their own and a shared weight belongs to several blocks; not "
                          "supported together yet (train the pseudo giant with parallel.shard=none, delink, then shard)")
    # (zero's partitioned host states keep every 16-bit weight resident: nothing swapped, auto measures.)
    if cfg.parallel.shard != "none" and cfg.memory.activation_checkpointing == "auto" \
            and cfg.memory.offload != "zero":
        raise ConfigError(f"parallel.shard={cfg.parallel.shard} with memory.activation_checkpointing=auto: the auto "
                          "plan measures saved activations by telling them apart from the parameters' storages, "
                          "which FSDP2 swaps for gathered copies during forward; use activation_checkpointing "
                          "full (or none) with sharding")
    if cfg.optim.name == "adafactor" and cfg.memory.host_optimizer == "deepspeed":
        raise ConfigError("optim.name=adafactor with memory.host_optimizer=deepspeed: DeepSpeed's CPU op is Adam only; "
                          "use memory.host_optimizer=torch or auto (the host update then runs torch's Adafactor)")
    if m.moe.expert_kernel == "grouped_mm" and cfg.train.device == "cuda" and cfg.train.precision == "fp32":
        # On CUDA torch fuses the grouped GEMM only in bf16 (m6.moe.expert_gemm); with train.device=auto
        # the device is known only at start-up, and the first MoE forward refuses it there.
        raise ConfigError("model.moe.expert_kernel=grouped_mm with train.precision=fp32 on train.device=cuda: torch's "
                          "CUDA grouped GEMM is fused only in bf16, in fp32 it loops over experts with a host sync "
                          "per GEMM; use train.precision=bf16 (or bf16-autocast), or model.moe.expert_kernel=auto or loop")


def check_tensor_parallel(cfg: Config) -> None:
    """parallel.tensor_parallel_size > 1: the sizes it splits must divide by it, and the features
    not built with it yet are refused by name (the world size is checked at start-up, in
    m6.parallel.layout)."""
    tp, m = cfg.parallel.tensor_parallel_size, cfg.model
    if cfg.parallel.sequence_parallel and tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor_parallel_size > 1 (the sequence is "
                          "cut over the tensor-parallel group)")
    if tp == 1:
        return
    key = f"parallel.tensor_parallel_size={tp}"
    for name, value in (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.num_kv_heads or m.num_heads),
                        ("model.ffn_dim", m.ffn_dim), ("model.d_model", m.d_model)):
        if value % tp:
            raise ConfigError(f"{key} must divide {name} ({value})")
    refused = [
        (cfg.memory.offload != "none", f"memory.offload={cfg.memory.offload}"),
        (cfg.parallel.balance != "even", f"parallel.balance={cfg.parallel.balance}"),
        (m.share_layers > 1, f"model.share_layers={m.share_layers}"),
        (m.moe.a2a_dispatch == "node_aware", "model.moe.a2a_dispatch=node_aware"),
        (m.moe.aux_loss_scope == "local", "model.moe.aux_loss_scope=local"),
        # auto's budget guard decides on each rank, as a part starts, whether to recompute it; a
        # recomputed attention or dense MLP issues its tp collectives again in backward, so a tp
        # group whose ranks decided apart would mismatch them (full recomputes the same parts everywhere)
        (cfg.memory.activation_checkpointing == "auto", "memory.activation_checkpointing=auto"),
        (m.qk_norm == "full", "model.qk_norm=full"),  # an RMSNorm over all heads: a tp rank holds some
        (cfg.checkpoint.init_from is not None, f"checkpoint.init_from={cfg.checkpoint.init_from}"),
    ]
    for hit, what in refused:
        if hit:
            raise ConfigError(f"{key} with {what}: not built together yet (docs/parallelism.md, Tensor parallel); "
                              f"use parallel.tensor_parallel_size=1 or change {what.split('=')[0]}")


def pipeline_stages_per_rank(parallel: ParallelConfig) -> int:
    """The stages each pipeline rank runs: parallel.pipeline_stages_per_rank, or the schedule's
    default (1 for 1f1b, 2 for interleaved and zero_bubble)."""
    if parallel.pipeline_stages_per_rank is not None:
        return parallel.pipeline_stages_per_rank
    return 1 if parallel.pipeline_schedule == "1f1b" else 2


def check_pipeline_keys(parallel: ParallelConfig) -> None:
    """The pipeline keys on their own: sizes, the schedule's stages per rank, the boundaries' order."""
    pp = parallel.pipeline_parallel_size
    if not isinstance(pp, int) or isinstance(pp, bool) or pp <= 0:
        raise ConfigError(f"parallel.pipeline_parallel_size must be a positive integer, got {pp!r}")
    v, schedule = pipeline_stages_per_rank(parallel), parallel.pipeline_schedule
    if not isinstance(v, int) or v <= 0:
        raise ConfigError(f"parallel.pipeline_stages_per_rank must be a positive integer, got {v!r}")
    if schedule == "1f1b" and v != 1:
        raise ConfigError(f"parallel.pipeline_schedule=1f1b runs one stage per rank, got "
                          f"parallel.pipeline_stages_per_rank={v}: use interleaved for several")
    if schedule == "interleaved" and v < 2:
        raise ConfigError(f"parallel.pipeline_schedule=interleaved needs parallel.pipeline_stages_per_rank >= 2, got {v}")
    if schedule == "zero_bubble" and v != 2:
        raise ConfigError(f"parallel.pipeline_schedule=zero_bubble (torch's ScheduleZBVZeroBubble) runs exactly 2 "
                          f"stages per rank, got parallel.pipeline_stages_per_rank={v}")
    stages = parallel.pipeline_stages
    if stages is None:
        return
    if pp == 1:
        raise ConfigError(f"parallel.pipeline_stages={stages} needs parallel.pipeline_parallel_size > 1")
    if len(stages) != pp * v:
        raise ConfigError(f"parallel.pipeline_stages={stages}: one first block per stage, "
                          f"parallel.pipeline_parallel_size ({pp}) x stages per rank ({v}) = {pp * v} of them")
    if stages[0] != 0 or any(b <= a for a, b in zip(stages, stages[1:])):
        raise ConfigError(f"parallel.pipeline_stages={stages} must start at block 0 and increase strictly (each "
                          f"stage's first block)")


def check_pipeline(cfg: Config) -> None:
    """parallel.pipeline_parallel_size > 1: enough blocks for the stages, boundaries in range, and
    the features not built with pipelining yet refused by name (the world size is checked at
    start-up, in m6.parallel.layout; the micro-batch count in m6.parallel.pipeline)."""
    p, m = cfg.parallel, cfg.model
    pp = p.pipeline_parallel_size
    if pp == 1:
        return
    key, num_stages = f"parallel.pipeline_parallel_size={pp}", pp * pipeline_stages_per_rank(p)
    if m.num_layers < num_stages:
        raise ConfigError(f"{key} with {num_stages // pp} stage(s) per rank needs model.num_layers >= {num_stages} "
                          f"(one block per stage at least), got {m.num_layers}")
    if p.pipeline_stages is not None and p.pipeline_stages[-1] >= m.num_layers:
        raise ConfigError(f"parallel.pipeline_stages={p.pipeline_stages}: every stage's first block must be below "
                          f"model.num_layers ({m.num_layers})")
    refused = [
        # a stage's output would be its tp rank's sequence chunk: the sends are built for whole sequences
        (p.sequence_parallel, "parallel.sequence_parallel=true"),
        (p.balance != "even", f"parallel.balance={p.balance}"),
        (m.share_layers > 1, f"model.share_layers={m.share_layers}"),
        # the check compares a forward of the whole model with and without recompute: no pipeline rank holds it
        (cfg.memory.check_checkpointing, "memory.check_checkpointing=true"),
        (cfg.train.weight_copy != "per_use", f"train.weight_copy={cfg.train.weight_copy}"),
        (bool(cfg.train.delink_at_step), f"train.delink_at_step={cfg.train.delink_at_step}"),
        (cfg.checkpoint.init_from is not None, f"checkpoint.init_from={cfg.checkpoint.init_from}"),
    ]
    check_pipeline_offload(cfg)
    if p.pipeline_schedule == "zero_bubble" and cfg.data.eval_samples > 0:
        # torch's ScheduleZBVZeroBubble runs backward actions in its forward-only eval (torch 2.13)
        raise ConfigError(f"parallel.pipeline_schedule=zero_bubble with data.eval_samples={cfg.data.eval_samples}: "
                          f"the caption eval does not run on torch's zero-bubble schedule yet; use "
                          f"data.eval_samples=0 or parallel.pipeline_schedule=1f1b or interleaved")
    for hit, what in refused:
        if hit:
            raise ConfigError(f"{key} with {what}: not built together yet (docs/parallelism.md, Pipeline parallel); "
                              f"use parallel.pipeline_parallel_size=1 or change {what.split('=')[0]}")


def check_pipeline_offload(cfg: Config) -> None:
    """Pipeline parallel with memory.offload: m6's own offload of each rank's stages composes
    (docs/parallelism.md); what does not is refused with its reason."""
    p, mem = cfg.parallel, cfg.memory
    key = f"parallel.pipeline_parallel_size={p.pipeline_parallel_size}"
    if mem.offload == "none":
        return
    if p.shard != "none":
        raise ConfigError(f"{key} with parallel.shard={p.shard} and memory.offload={mem.offload}: FSDP2's CPU offload "
                          "of the stages' units is not built with the pipeline schedules yet; use parallel.shard=none "
                          "(m6's offload of each rank's stages) or memory.offload=none")
    streams = mem.offload in ("optimizer+params", "zero")
    if streams and mem.offload_blocks == "auto":
        raise ConfigError(f"{key} with memory.offload={mem.offload} and memory.offload_blocks=auto: auto sizes the "
                          "streamed blocks by the whole model's memory estimate, not a pipeline rank's stages; name "
                          "the blocks (memory.offload_blocks=all or a list)")
    if streams and p.pipeline_schedule == "zero_bubble":
        raise ConfigError(f"{key} with parallel.pipeline_schedule=zero_bubble and memory.offload={mem.offload}: a "
                          "streamed block is fetched for its backward and released after it, and zero_bubble splits "
                          "that backward into input- and weight-gradient passes run apart; use pipeline_schedule=1f1b "
                          "or interleaved, or memory.offload=optimizer")


def check_shard_offload(cfg: Config) -> None:
    """parallel.shard with memory.offload: FSDP2's CPU offload keeps each rank's parameter shards,
    their gradients and the optimizer state on the host together, and the host optimizer
    (memory.host_optimizer) steps them there: offload=optimizer+params, every block."""
    shard, mem = cfg.parallel.shard, cfg.memory
    if shard == "none" or mem.offload in ("none", "zero"):  # zero partitions itself: check_zero_offload
        return
    if mem.offload == "optimizer":
        raise ConfigError(f"parallel.shard={shard} with memory.offload=optimizer: FSDP2's CPU offload moves each "
                          "rank's parameter shards to the host together with their gradients and optimizer state; "
                          "use memory.offload=optimizer+params with sharding")
    if mem.host_grad_dtype != "fp32":
        raise ConfigError(f"parallel.shard={shard} with memory.host_grad_dtype={mem.host_grad_dtype}: FSDP2's CPU "
                          "offload keeps the gradient shards in the parameters' dtype; 16-bit host gradients are "
                          "m6's unsharded offload (parallel.shard=none)")
    if mem.offload_blocks != "all":
        raise ConfigError(f"parallel.shard={shard} with memory.offload_blocks={mem.offload_blocks}: FSDP2 offloads "
                          "every unit's shards; granular offload is m6's unsharded offload (parallel.shard=none)")


def check_zero_offload(cfg: Config) -> None:
    """memory.offload=zero stores the device weights in the compute dtype: it needs a 16-bit train
    precision, and is m6's own offload, unsharded or (parallel.shard=optimizer) with its host states
    partitioned over the data-parallel ranks, every block resident, AdamW (FSDP2's CPU offload keeps
    fp32 shards)."""
    if cfg.memory.offload != "zero":
        return
    if cfg.train.precision == "fp32":
        raise ConfigError("memory.offload=zero with train.precision=fp32: zero keeps 16-bit weights on the device "
                          "(the compute dtype); use train.precision=bf16 or fp16, or memory.offload=optimizer")
    if cfg.parallel.shard != "none":
        check_partitioned_zero(cfg)
    if cfg.memory.zero_grad_landing == "home" and cfg.optim.delayed_update:
        raise ConfigError("memory.zero_grad_landing=home with optim.delayed_update=true: the next step's forward reads "
                          "the streamed blocks' homes while the update still reads its gradients there; use "
                          "memory.zero_grad_landing=separate (or auto)")


def fsdp_shards(cfg: Config) -> bool:
    """Whether parallel.shard wraps the model in FSDP2 units: every sharded run but memory.offload=zero's,
    which partitions its gradients and host states itself (m6.memory.zero_partition)."""
    return cfg.parallel.shard != "none" and cfg.memory.offload != "zero"


def check_partitioned_zero(cfg: Config) -> None:
    """memory.offload=zero with parallel.shard=optimizer: ZeRO-Offload's partitioned layout (ZeRO-2
    with offload_optimizer): gradients reduce-scattered, each rank's fp32 masters and optimizer
    state for its dim-0 chunks only, the 16-bit weights whole and resident on every rank."""
    p, mem = cfg.parallel, cfg.memory
    if p.shard == "full":
        raise ConfigError("memory.offload=zero with parallel.shard=full: zero keeps the 16-bit weights resident and "
                          "whole on every rank; use parallel.shard=optimizer (gradients and host states partitioned)")
    refused = [
        (mem.offload_blocks != [], f"memory.offload_blocks={mem.offload_blocks}",
         "the partitioned zero keeps every weight resident; set memory.offload_blocks=[]"),
        (cfg.optim.name == "adafactor", "optim.name=adafactor",
         "Adafactor's factored moments are not elementwise over dim-0 chunks; use optim.name=adamw"),
        (p.tensor_parallel_size > 1, f"parallel.tensor_parallel_size={p.tensor_parallel_size}",
         "not built together (nor is any offload with tensor parallel)"),
        (p.pipeline_parallel_size > 1, f"parallel.pipeline_parallel_size={p.pipeline_parallel_size}",
         "not built together; the pipeline takes the unsplit zero (parallel.shard=none)"),
    ]
    for hit, what, why in refused:
        if hit:
            raise ConfigError(f"memory.offload=zero with parallel.shard=optimizer and {what}: {why}")


def check_delayed_update(cfg: Config) -> None:
    """optim.delayed_update runs m6's offloaded host update in the background: it needs m6's own
    offload (memory.offload optimizer, optimizer+params or zero, unsharded or zero partitioned), with host gradients
    fp32 or 16-bit (both double-buffered)."""
    if not cfg.optim.delayed_update:
        return
    mem = cfg.memory
    if mem.offload == "none":
        raise ConfigError("optim.delayed_update=true with memory.offload=none: the delayed update overlaps the host "
                          "optimizer with the device's next step; set memory.offload=optimizer (or optimizer+params)")
    if fsdp_shards(cfg):  # zero's partitioned states (parallel.shard=optimizer) are m6's own: they compose
        raise ConfigError(f"optim.delayed_update=true with parallel.shard={cfg.parallel.shard}: FSDP2's CPU offload "
                          "steps its shards in place; the delayed update is built for m6's unsharded offload "
                          "(parallel.shard=none)")


def check_weight_copy(cfg: Config) -> None:
    """train.weight_copy=per_step is built for bf16 on an unsharded model with its optimizer on the
    device; the rest is refused by name."""
    if cfg.train.weight_copy == "per_use":
        return
    refused = [
        (cfg.train.precision not in ("bf16", "fp16"),
         f"train.precision={cfg.train.precision} (per_step needs bf16 or fp16)"),
        (cfg.memory.offload != "none", f"memory.offload={cfg.memory.offload}"),
        (cfg.parallel.shard != "none", f"parallel.shard={cfg.parallel.shard}"),
        (cfg.parallel.tensor_parallel_size > 1, f"parallel.tensor_parallel_size={cfg.parallel.tensor_parallel_size}"),
        (cfg.memory.check_checkpointing, "memory.check_checkpointing=true"),
        (cfg.train.delink_at_step > 0, f"train.delink_at_step={cfg.train.delink_at_step}"),
    ]
    for hit, what in refused:
        if hit:
            raise ConfigError(f"train.weight_copy=per_step with {what}: not built together; use "
                              f"train.weight_copy=per_use or change {what.split('=')[0]}")


def expert_ffn_dim(model: ModelConfig) -> int:
    """Hidden size of each expert FFN."""
    return model.moe.ffn_dim if model.moe.ffn_dim is not None else model.ffn_dim


def is_moe_block(model: ModelConfig, index: int) -> bool:
    """Whether block ``index`` (from 0) has an MoE FFN: every moe.every-th block (counting from 1),
    after the first moe.first_dense_blocks."""
    every = model.moe.every
    return every > 0 and index >= model.moe.first_dense_blocks and (index + 1) % every == 0


def head_dim(model: ModelConfig) -> int:
    """Per-head size of q, k and v (model.head_dim, or d_model / num_heads)."""
    return model.head_dim if model.head_dim is not None else model.d_model // model.num_heads


def num_kv_heads(model: ModelConfig) -> int:
    """Key/value heads (model.num_kv_heads, or num_heads: multi-head attention)."""
    return model.num_kv_heads if model.num_kv_heads is not None else model.num_heads


def shared_expert_ffn_dim(model: ModelConfig) -> int:
    """Hidden size of the shared-expert MLP: num_shared_experts x (shared_expert_ffn_dim or the experts')."""
    moe = model.moe
    per_expert = moe.shared_expert_ffn_dim if moe.shared_expert_ffn_dim is not None else expert_ffn_dim(model)
    return moe.num_shared_experts * per_expert


def num_patches(model: ModelConfig) -> int:
    """Image tokens per sample."""
    return (model.image_size // model.patch_size) ** 2


def per_rank_batch_size(train: TrainConfig, world_size: int = 1) -> int:
    """Samples each data-parallel rank processes per optimizer step."""
    if train.global_batch_size % world_size:
        raise ConfigError(f"train.global_batch_size ({train.global_batch_size}) must be divisible by the "
                          f"number of processes ({world_size})")
    return train.global_batch_size // world_size


def micro_batch_size(train: TrainConfig, world_size: int = 1) -> int:
    """Samples per forward/backward on one rank; default: the whole per-rank batch (no accumulation)."""
    per_rank = per_rank_batch_size(train, world_size)
    if train.micro_batch_size is None:
        return per_rank
    if per_rank % train.micro_batch_size:
        raise ConfigError(f"train.micro_batch_size ({train.micro_batch_size}) must divide the per-rank batch "
                          f"(train.global_batch_size {train.global_batch_size} / {world_size} processes = {per_rank})")
    return train.micro_batch_size


def accumulation_steps(train: TrainConfig, world_size: int = 1) -> int:
    """Micro-batches per optimizer step on each rank."""
    return per_rank_batch_size(train, world_size) // micro_batch_size(train, world_size)


def run_dir(cfg: Config) -> str:
    return cfg.run.dir if cfg.run.dir is not None else os.path.join("runs", cfg.run.name)


def load(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply ``a.b.c=value`` overrides and validate."""
    return load_config(Config, path, overrides)


__all__ = ["Config", "ConfigError", "DataConfig", "LoggingConfig", "ModelConfig", "MoEConfig", "OptimConfig",
           "TrainConfig", "WandbConfig", "TensorBoardConfig", "MemoryConfig", "DataSourceConfig", "SpecialTokensConfig", "CheckpointConfig", "RunConfig", "ParallelConfig", "load", "dump_yaml", "to_dict",
           "expert_ffn_dim", "num_patches", "micro_batch_size", "accumulation_steps", "per_rank_batch_size", "run_dir"]
