"""The M6 transformer: one stack over [image patch tokens | source text | target text].

Shape legend: B batch, N image patches, L text length, S = N + L, D d_model, V vocab.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from m6.batch_format import IGNORE_INDEX, SEG_PAD, SEG_SOURCE, SEG_TARGET
from m6.config import ModelConfig, expert_ffn_dim, head_dim, is_moe_block, num_kv_heads, shared_expert_ffn_dim
from m6.model.attention import Rotary, SelfAttention
from m6.model.block import DenseMLP, TransformerBlock, build_norm
from m6.model.cast_on_use import Linear, linear
from m6.model.chunked_cross_entropy import chunk_rows_for, linear_cross_entropy_sum
from m6.model.embeddings import PatchEmbedding, TextEmbedding
from m6.model.host_drawn_init import HostDrawnInit
from m6.model.mask import prefix_lm_mask
from m6.model.recomputable import RecomputablePart
from m6.model.rope import cos_sin, grid_angles, text_angles
from m6.model.shared_blocks import share_block_weights
from m6.moe import MoELayer

IMAGE, TEXT = 0, 1  # rows of the modality embedding


def build_attention(cfg: ModelConfig) -> SelfAttention:
    """One block's attention with the model's head layout, q/k norm and biases."""
    return SelfAttention(cfg.d_model, cfg.num_heads, cfg.dropout, num_kv_heads=num_kv_heads(cfg),
                         head_dim=head_dim(cfg), qk_norm=cfg.qk_norm,
                         qkv_bias=cfg.linear_bias or cfg.attention_bias, out_bias=cfg.linear_bias,
                         norm_eps=cfg.norm_eps)


def build_ffn(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """MoE FFN in every ``moe.every``-th block (counting from 1) after the first
    ``moe.first_dense_blocks``, dense MLP elsewhere (m6.config.is_moe_block)."""
    moe = cfg.moe
    if is_moe_block(cfg, layer_idx):
        shared = gate = None
        if moe.num_shared_experts:
            shared = DenseMLP(cfg.d_model, shared_expert_ffn_dim(cfg), moe.activation, bias=False)
            gate = Linear(cfg.d_model, 1, bias=False) if moe.shared_expert_gate else None
        return MoELayer(
            cfg.d_model, expert_ffn_dim(cfg), moe.num_experts, top_k=moe.top_k,
            capacity_factor=moe.capacity_factor, min_capacity=moe.min_capacity,
            capacity_group=moe.capacity_group,
            num_prototypes=moe.num_prototypes, activation=moe.activation,
            score_function=moe.score_function, normalize_weights=moe.normalize_weights,
            router_jitter=moe.router_jitter, force_balance=moe.force_balance, aux_loss_coef=moe.aux_loss_coef,
            z_loss_coef=moe.z_loss_coef, init_std=cfg.init_std, expert_kernel=moe.expert_kernel,
            router_dtype=moe.router_dtype, expert_bias_update_rate=moe.expert_bias_update_rate,
            node_groups=moe.node_groups, max_nodes_per_token=moe.max_nodes_per_token or 0,
            shared_experts=shared, shared_expert_gate=gate, routed_scaling_factor=moe.routed_scaling_factor,
        )
    return DenseMLP(cfg.d_model, cfg.ffn_dim, cfg.ffn_activation, bias=cfg.linear_bias)


def block_recomputable_parts(index: int, block: nn.Module) -> list[RecomputablePart]:
    """Block ``index``'s recomputable parts, named as in the whole model: its attention sub-block,
    and its FFN's local computation (the experts and shared experts, or the dense MLP)."""
    parts = [RecomputablePart(f"blocks.{index}.attention", block, "attention_residual")]
    if block.is_moe:
        parts.append(RecomputablePart(f"blocks.{index}.experts", block.ffn.experts, "forward"))
        if block.ffn.shared_experts is not None:
            parts.append(RecomputablePart(f"blocks.{index}.shared_experts", block.ffn.shared_experts, "forward"))
    else:
        parts.append(RecomputablePart(f"blocks.{index}.mlp", block.ffn, "forward"))
    return parts


class M6Model(nn.Module):
    """Prefix-LM multimodal transformer with MoE FFNs; loss is computed on target text only."""

    cast_on_use: bool = False  # the LM head's weight (m6.model.cast_on_use.set_cast_on_use)
    # Pipeline parallel: state-dict names of the parts other ranks' stages hold (m6.parallel.pipeline)
    other_stages_state: frozenset = frozenset()
    tied_embedding_copy: bool = False  # ... and whether its text_embed.tokens is the tied head's copy

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.text_embed = TextEmbedding(cfg.vocab_size, cfg.max_text_len, cfg.d_model,
                                        learned_positions=cfg.positions == "learned")
        self.patch_embed = PatchEmbedding(cfg.image_size, cfg.patch_size, cfg.image_channels, cfg.d_model,
                                          cfg.patch_embed, learned_positions=cfg.image_positions == "learned")
        self.modality = nn.Embedding(2, cfg.d_model)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(cfg.d_model, cfg.num_heads, build_ffn(cfg, i), cfg.dropout, cfg.norm_eps,
                             norm=cfg.norm, attention=build_attention(cfg))
            for i in range(cfg.num_layers)
        )
        share_block_weights(self.blocks, cfg.share_layers)  # pseudo-to-real: the pseudo giant
        self.final_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv2d)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        # GPT-2: residual-branch outputs scaled down so the residual stream's variance does not
        # grow with depth.
        for block in self.blocks:
            nn.init.normal_(block.attn.out.weight, std=std / math.sqrt(2 * self.cfg.num_layers))
            mlp = block.ffn.shared_experts if block.is_moe else block.ffn
            if mlp is not None:
                nn.init.normal_(mlp.fc_out.weight, std=std / math.sqrt(2 * self.cfg.num_layers))

    def materialize(self, device: torch.device, seed: int, partial: bool = False) -> None:
        """Allocate a model built on ``meta`` on ``device`` and initialise it from ``seed``.

        Every submodule re-runs its own reset_parameters in module order, then the model-level
        init; experts draw from their own (layer seed, global id) generators. So the values do not
        depend on which experts this process holds, nor on ``device`` (every draw is the host's).

        ``partial``: the caller has allocated the modules it keeps (a pipeline stage's) and the
        rest stays on ``meta``; their random fills are drawn on the host and dropped, so the
        generator advances as for the whole model and the kept weights equal the whole model's.
        """
        if not partial:
            self.to_empty(device=device)
        for index, layer in enumerate(self.moe_layers().values()):
            layer.experts.init_seed = seed * 100_003 + index  # per layer, from the run seed alone
        torch.manual_seed(seed)
        # Drawn on the host wherever the weights live: the same seed gives the same model on any
        # device and offload setting (m6.model.host_drawn_init). Experts draw on the host already.
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                with nullcontext() if getattr(module, "draws_on_host", False) else HostDrawnInit(draw_meta=partial):
                    module.reset_parameters()
        with HostDrawnInit(draw_meta=partial):
            self.reset_parameters()

    def recomputable_parts(self) -> list[RecomputablePart]:
        """Every region that may be recomputed in backward, in forward order: each block's
        attention sub-block, and its FFN's local computation (the experts on the tokens this
        process received, not the routing, dispatch or combine, and the shared experts; or the
        dense MLP)."""
        return [part for i, block in enumerate(self.blocks) for part in block_recomputable_parts(i, block)]

    def moe_layers(self) -> dict[str, MoELayer]:
        """``block<i>`` -> the MoE layer of block i (i counts all blocks, as configs do), for routing statistics."""
        return {f"block{i}": b.ffn for i, b in enumerate(self.blocks) if b.is_moe}

    def forward(self, images_BCHW: torch.Tensor, has_image_B: torch.Tensor, text_ids_BL: torch.Tensor,
                segment_ids_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the text positions [B, L, D] and the summed MoE auxiliary loss."""
        x = self.embed(images_BCHW, text_ids_BL)
        N = x.shape[1] - text_ids_BL.shape[1]
        mask, real_BS, rotary = self.block_context(has_image_B, segment_ids_BL, N, x.device)
        x, aux_total = self._run_blocks(x, mask, real_BS, rotary)
        return self.final_norm(x[:, N:]), aux_total

    def embed(self, images_BCHW: torch.Tensor, text_ids_BL: torch.Tensor) -> torch.Tensor:
        """The block stack's input [B, S, D]: image patch tokens, then text tokens, each with its
        modality embedding (the first pipeline stage's part)."""
        image_BND = self.patch_embed(images_BCHW) + self.modality.weight[IMAGE]
        text_BLD = self.text_embed(text_ids_BL) + self.modality.weight[TEXT]
        return self.embed_dropout(torch.cat([image_BND, text_BLD], dim=1))

    def block_context(self, has_image_B: torch.Tensor, segment_ids_BL: torch.Tensor, num_patches: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Rotary]:
        """What every block reads besides the residual stream: the prefix-LM mask [B, 1, S, S], the
        real (non-padding) tokens [B, S] and the rotary (cos, sin); from the batch alone, so each
        pipeline stage rebuilds it instead of receiving it."""
        N = num_patches
        # Image patches are prefix; a sample without an image has its patch slots masked as padding.
        image_seg_BN = torch.where(has_image_B, SEG_SOURCE, SEG_PAD).unsqueeze(1).expand(-1, N)
        segments_BS = torch.cat([image_seg_BN, segment_ids_BL], dim=1)
        return prefix_lm_mask(segments_BS), segments_BS != SEG_PAD, self.rotary(N, segment_ids_BL.shape[1], device)

    def _run_blocks(self, x_BSD: torch.Tensor, mask_B1SS: torch.Tensor, real_BS: torch.Tensor,
                    rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        aux_total = x_BSD.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x_BSD, aux = block(x_BSD, mask_B1SS, real_BS, rotary)
            if aux is not None:
                aux_total = aux_total + aux
        return x_BSD, aux_total

    def rotary(self, num_patches: int, text_len: int, device: torch.device) -> Rotary:
        """(cos, sin) fp32 [num_patches + text_len, Dh] for the sequence [image patches | text], or
        None when neither uses rotary positions. Text positions are 0..L-1 from the first text
        token (1-D), patches their (row, column) (2-D); a part with learned positions gets angle 0."""
        cfg = self.cfg
        if cfg.positions != "rope" and cfg.image_positions != "rope":
            return None
        dh, half = head_dim(cfg), head_dim(cfg) // 2
        if cfg.image_positions == "rope" and num_patches:
            image = grid_angles(cfg.image_size // cfg.patch_size, dh, cfg.rope_theta, device)
        else:
            image = torch.zeros(num_patches, half, device=device)
        if cfg.positions == "rope":
            text = text_angles(text_len, dh, cfg.rope_theta, device)
        else:
            text = torch.zeros(text_len, half, device=device)
        return cos_sin(torch.cat([image, text], dim=0))

    def text_logits(self, ids_BL: torch.Tensor) -> torch.Tensor:
        """Causal next-token logits of text alone: token ids int [B, L] -> [B, L, V] (no image, no
        padding: every position attends to itself and the positions before it; position i's
        logits predict token i + 1). For evaluation and for comparing with other implementations
        of the same weights (Hugging Face's causal LMs)."""
        segments_BL = torch.full_like(ids_BL, SEG_TARGET)  # target-only rows: a plain causal mask
        x = self.embed_dropout(self.text_embed(ids_BL) + self.modality.weight[TEXT])
        x, _ = self._run_blocks(x, prefix_lm_mask(segments_BL), segments_BL != SEG_PAD,
                                self.rotary(0, ids_BL.shape[1], x.device))
        return self.logits(self.final_norm(x))

    def head_weight(self) -> torch.Tensor:
        """The LM head's [V, D] weight (the token embedding when tied)."""
        return self.text_embed.tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., V]."""
        # The tied [V, D] embedding is the largest weight: a bf16 copy of it kept until backward
        # is what cast-on-use avoids most.
        return linear(hidden, self.head_weight(), None, self.cast_on_use)

    def target_loss_sum(self, hidden_BLD: torch.Tensor, labels_BL: torch.Tensor,
                        num_targets: int | None = None) -> torch.Tensor:
        """Sum of cross-entropy over positions with a label; the caller divides by the (global) count.

        Only loss-bearing positions go through the LM head: with a large vocabulary the [B, L, V]
        logits of prefix positions would be most of the memory and all of it wasted.
        ``num_targets``: how many labels are not IGNORE_INDEX, when the caller knows it on the host
        (MultimodalBatch.num_target_tokens): the positions are then gathered without a host sync.
        Without it, selecting them needs the count, read back from the device (a sync on a GPU).
        """
        keep_BL = labels_BL != IGNORE_INDEX
        if num_targets is None:
            hidden_TD, labels_T = hidden_BLD[keep_BL], labels_BL[keep_BL]
        else:
            # The same positions in the same (row-major) order as boolean indexing, sized from the
            # host: nonzero_static pads or truncates to num_targets, so a wrong count must not pass.
            torch._assert_async(keep_BL.sum() == num_targets, "target_loss_sum: num_targets is not the number of labels")
            rows_T = torch.nonzero_static(keep_BL.reshape(-1), size=num_targets).squeeze(1)
            hidden_TD = hidden_BLD.reshape(-1, hidden_BLD.shape[-1]).index_select(0, rows_T)
            labels_T = labels_BL.reshape(-1).index_select(0, rows_T)
        chunk_rows = chunk_rows_for(self.cfg.loss_chunk_rows, self.cfg.vocab_size)
        if 0 < chunk_rows < hidden_TD.shape[0]:
            # [targets, V] logits never exist at once (m6.model.chunked_cross_entropy).
            device_type = hidden_TD.device.type
            dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
            return linear_cross_entropy_sum(hidden_TD, self.head_weight(), labels_T, chunk_rows, dtype)
        logits = self.logits(hidden_TD)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits, labels_T, reduction="sum")


def build_meta_model(cfg: ModelConfig) -> M6Model:
    """The model with shapes only (no storage): parameter counts are exact at any scale."""
    with torch.device("meta"):
        return M6Model(cfg)
