"""Parameter counts, training FLOPs and a memory estimate for the M6 model.

Works on a model built on the ``meta`` device, so a 10T-parameter config is counted without
allocating it. Forward + backward = 3 x forward throughout (PaLM appendix B); only matmuls are
counted (norms, softmax, activations and embedding lookups are free).

Two counts, for two questions:

* ``training_flops_per_token`` (what ``m6.inspect`` prints): an upper bound per position,
      6 * N_active  +  12 * num_layers * num_heads * head_dim * S,
  as if every position of the full context S = image patches + text length were a real token
  that goes through every weight, the LM head included. N_active counts every weight a token
  multiplies by (experts scaled by K/E, the patch projection and the LM head for every position).

* ``step_flops`` (what the training loop's TFLOP/s and MFU divide by time): the FLOPs of the
  work a step actually asked of the model, per micro-batch, from host-side counts
  (``TokenCounts``) and the expert assignments the MoE layers kept:
      attention projections, dense FFNs, routers   x real (non-padding) positions
      patch projection                             x real image patches (rows with an image)
      LM head                                      x target positions (the only ones it runs on)
      expert FFNs                                  x kept assignments (MoEStats.kept: padding is
                                                     never routed; dropped assignments do no work)
      QK^T and AV (4 H Dh per pair and layer)      x real_len**2 of each sequence
  Attention is charged the full real_len**2, not the prefix-LM mask's allowed pairs: SDPA with a
  boolean mask computes every (query, key) entry and masks afterwards (no kernel skips masked
  blocks of an arbitrary mask), so that is what the hardware executes on the real tokens. Work
  done on padding (the dense layers and attention run over the padded [B, S] shape) is not
  useful and not counted, nor is recompute (activation checkpointing): this is model FLOPs, not
  hardware FLOPs. Shared experts (and their gate) count with the dense FFNs, per real position
  (they run on every token); qk norms and rotary positions are elementwise (free). The patch projection's backward needs no input gradient (images take none), so
  3x overstates it slightly (under 1% of a tiny-config step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from m6.batch_format import SEG_PAD
from m6.config import ModelConfig, head_dim, num_patches
from m6.model.m6_model import M6Model
from m6.moe import MoELayer


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
    counted: set[int] = set()  # experts shared by several MoE layers (model.share_layers) count once
    for module in model.modules():
        if isinstance(module, MoELayer) and id(module.experts) not in counted:
            counted.add(id(module.experts))
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
    """Forward+backward FLOPs per position for a context of ``seq_len`` text + the image patches:
    the all-positions upper bound (no padding, every position a target; see the module docstring)."""
    context = num_patches(cfg) + seq_len
    return 6.0 * size.active + 12.0 * cfg.num_layers * cfg.num_heads * head_dim(cfg) * context


@dataclass(frozen=True)
class ForwardFlopRates:
    """Forward matmul FLOPs per unit of work, read from the module tree (meta tensors welcome)."""

    per_position: int  # every block's attention projections, dense FFN (or shared experts) and router, per real position
    per_patch: int  # patch projection (conv stem included) per real image patch
    per_target: int  # LM head per target position
    per_attention_pair: int  # QK^T and AV per (query, key) pair of one sequence, all blocks
    per_assignment: int  # one expert FFN on one kept token assignment (the same in every MoE layer)
    router_per_position: int = 0  # the routers' part of per_position (their GEMM may run at another precision)


def forward_flop_rates(model: M6Model) -> ForwardFlopRates:
    """What each unit of work costs this model's forward; with expert parallelism the experts
    held here have the shapes of every expert, so any rank's share of the model gives the same."""
    per_position = per_pair = router = 0
    per_assignment: set[int] = set()
    for block in model.blocks:
        per_position += 2 * (block.attn.qkv.weight.numel() + block.attn.out.weight.numel())
        per_pair += 2 * 2 * block.attn.num_heads * block.attn.head_dim  # q.k and p.v over all heads: 2 H Dh each
        if isinstance(block.ffn, MoELayer):
            router += 2 * block.ffn.router.weight.numel()
            for dense in (block.ffn.shared_experts, block.ffn.shared_expert_gate):
                if dense is not None:
                    per_position += 2 * sum(p.numel() for n, p in dense.named_parameters() if n.endswith("weight"))
            experts = block.ffn.experts
            mats = [w for w in (experts.w_in, experts.w_out, experts.w_gate) if w is not None]
            per_assignment.add(2 * sum(w[0].numel() for w in mats))
        else:
            per_position += 2 * sum(p.numel() for n, p in block.ffn.named_parameters() if n.endswith("weight"))
    assert len(per_assignment) <= 1, "M6Model builds every MoE layer with the same expert shapes"
    patch = model.patch_embed
    per_patch = 2 * patch.proj.weight.numel()
    if patch.kind == "conv":  # the 3x3 stem runs at every pixel: patch_size**2 of them per patch
        per_patch += 2 * patch.stem[0].weight.numel() * patch.patch_size ** 2
    head = model.text_embed.tokens.weight if model.lm_head is None else model.lm_head.weight
    return ForwardFlopRates(per_position=per_position + router, per_patch=per_patch, per_target=2 * head.numel(),
                            per_attention_pair=per_pair, per_assignment=next(iter(per_assignment), 0),
                            router_per_position=router)


@dataclass(frozen=True)
class TokenCounts:
    """What one micro-batch (or a sum of them) asks of the model, apart from the experts."""

    positions: int = 0  # real positions: image patches of rows with an image + text positions not SEG_PAD
    image_patches: int = 0  # the real image patches among them
    targets: int = 0  # positions with a label: the LM head runs on these only
    attention_pairs: int = 0  # sum over rows of real_len**2

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(self.positions + other.positions, self.image_patches + other.image_patches,
                           self.targets + other.targets, self.attention_pairs + other.attention_pairs)


def count_tokens(segment_ids_BL: torch.Tensor, has_image_B: torch.Tensor, patches_per_image: int,
                 num_targets: int) -> TokenCounts:
    """Counts of one micro-batch from its host tensors: segment ids int [B, L], has_image bool [B]
    (a row without an image has its patch slots as padding), and its target count."""
    patches_B = has_image_B.to(torch.int64) * patches_per_image
    real_len_B = (segment_ids_BL != SEG_PAD).sum(dim=1) + patches_B
    return TokenCounts(positions=int(real_len_B.sum()), image_patches=int(patches_B.sum()),
                       targets=int(num_targets), attention_pairs=int((real_len_B * real_len_B).sum()))


def step_flops(rates: ForwardFlopRates, counts: TokenCounts, kept_assignments: float) -> float:
    """Forward+backward FLOPs (3 x forward) of the work in ``counts`` plus ``kept_assignments``
    expert assignments (MoEStats.kept summed over MoE layers and micro-batches)."""
    forward = (rates.per_position * counts.positions + rates.per_patch * counts.image_patches
               + rates.per_target * counts.targets + rates.per_attention_pair * counts.attention_pairs
               + rates.per_assignment * kept_assignments)
    return 3.0 * forward

