"""Pipeline stages: the M6 block stack cut into stages, each rank keeping only its stages' modules.

Stage i of S runs blocks [first[i], first[i + 1]); stage 0 also embeds the image patches and the
text, stage S - 1 also applies the final norm (its loss, the LM head's, is the schedule's loss_fn:
m6.train.pipeline_step). A pipeline rank runs ``v`` stages (parallel.pipeline_stages_per_rank):
stage r alone for 1f1b; r, r + p, ... for interleaved (torch's loop order); r and 2p - 1 - r for
zero_bubble (torch's V order, ScheduleZBVZeroBubble). Ranks of one stage form its data- and
expert-parallel groups (m6.parallel.layout); the stages talk through torch.distributed.pipelining.

Tied embeddings (model.tie_embeddings): the LM head reads the token embedding, which the first
stage owns; a last stage on another rank keeps a copy (``text_embed.tokens``, drawn as the whole
model draws it, under the same name), whose gradient is summed with the first stage's over the
two ranks (m6.train.pipeline_step) and counted once in the norm, as Megatron's embedding group does.

Every rank keeps the whole model's module tree and names, with the parts its stages do not own
removed (embeddings and head set to None, blocks replaced by an empty ``StageGap``), as torchtitan
does: a parameter keeps its fully qualified name (``blocks.5.attn.qkv.weight``) on every layout, so
a DCP checkpoint saved at one pipeline size loads at another by name. The kept weights are drawn
exactly as in the whole model (M6Model.materialize with ``partial``), so a pipelined run starts
from the single-process run's weights.
"""

from __future__ import annotations

import torch
from torch import nn

from m6.config import ParallelConfig, pipeline_stages_per_rank
from m6.model import M6Model, RecomputablePart, block_recomputable_parts

FIRST_STAGE_MODULES = ("text_embed", "patch_embed", "modality", "embed_dropout")
LAST_STAGE_MODULES = ("final_norm", "lm_head")


def stage_first_blocks(parallel: ParallelConfig, num_layers: int) -> list[int]:
    """The first block of every stage, and num_layers at the end (so stage i is
    [result[i], result[i + 1])): parallel.pipeline_stages, or as even a cut as the blocks allow,
    the stages nearer the start one block longer (the last stage also holds the LM head)."""
    num_stages = parallel.pipeline_parallel_size * pipeline_stages_per_rank(parallel)
    if parallel.pipeline_stages is not None:
        return [*parallel.pipeline_stages, num_layers]
    base, extra = divmod(num_layers, num_stages)
    firsts = [0]
    for i in range(num_stages):
        firsts.append(firsts[-1] + base + (i < extra))
    return firsts


def rank_stage_indices(pp_rank: int, pipeline_parallel_size: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs, in the order torch's schedule expects them."""
    p = pipeline_parallel_size
    if schedule == "zero_bubble":
        return [pp_rank, 2 * p - 1 - pp_rank]
    return [pp_rank + k * p for k in range(stages_per_rank)]


class StageGap(nn.Module):
    """Where a block another pipeline rank owns sits in this rank's ``blocks`` (no parameters), so
    the blocks this rank owns keep their indices and names."""

    is_moe = False


class AttachAuxLoss(torch.autograd.Function):
    """Returns a copy of ``x``; in backward also gives the MoE aux loss ``aux`` the gradient
    ``scale``. A stage's aux loss is not part of the pipeline's one loss (the last stage's), so it
    rides on the stage's output instead (Megatron-Core's MoEAuxLossAutoScaler): the backward of
    the output reaches the router through it as if ``scale * aux`` were added to the loss. A copy,
    not ``x`` itself: an input returned by a Function comes out as a view, and the zero-bubble
    schedule detaches stage outputs in place, which views refuse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_x, torch.full_like(aux, ctx.scale), None


class PipelineStageModule(nn.Module):
    """One stage's forward: (text ids | the previous stage's [B, S, D]) -> [B, S, D], or the text
    positions' final-normed hidden states [B, L, D] at the last stage.

    Its submodules are the rank model's modules this stage owns (the same objects: the optimizer,
    gradient sync and checkpoints see them through the rank model, under their model names). The
    mask, real-token mask and rotary tables are rebuilt from the micro-batch's ``has_image`` and
    ``segment_ids``, which every stage receives as keyword inputs (torch's schedules pass kwargs to
    all stages). ``aux_scale``: the gradient each micro-batch's summed aux loss gets (set per step);
    ``terms``: per micro-batch, this stage's [aux, balance, z, kept] (detached, float64);
    ``routed``: per micro-batch, block index -> the routed counts [E] of its MoE layers with an
    aux-free expert bias (model.moe.expert_bias_update_rate > 0).
    """

    def __init__(self, model: M6Model, stage_index: int, num_stages: int, blocks: range) -> None:
        super().__init__()
        self.__dict__["rank_model"] = model  # not a submodule: its other stages' parts are not this stage's
        self.stage_index, self.is_first, self.is_last = stage_index, stage_index == 0, stage_index == num_stages - 1
        self.block_indices = blocks
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        for name in (FIRST_STAGE_MODULES if self.is_first else ()) + (LAST_STAGE_MODULES if self.is_last else ()):
            if getattr(model, name) is not None:
                setattr(self, name, getattr(model, name))
        if self.is_last and model.lm_head is None:  # the tied head: its weight is this stage's too
            self.head_tokens = model.text_embed.tokens
        self.aux_scale = 0.0
        self.terms: list[torch.Tensor] = []
        self.routed: list[dict[int, torch.Tensor]] = []

    def recomputable_parts(self) -> list[RecomputablePart]:
        """This stage's blocks' recomputable parts, under the whole model's names (the stage's
        recompute: m6.train.pipeline_step)."""
        return [part for i, block in zip(self.block_indices, self.blocks)
                for part in block_recomputable_parts(i, block)]

    def forward(self, x: torch.Tensor, *, images: torch.Tensor, has_image: torch.Tensor,
                segment_ids: torch.Tensor) -> torch.Tensor:
        model = self.rank_model
        if self.is_first:
            x = model.embed(images, x)
        N = x.shape[1] - segment_ids.shape[1]
        mask, real_BS, rotary = model.block_context(has_image, segment_ids, N, x.device)
        aux_total = x.new_zeros((), dtype=torch.float32)
        balance = z = kept = torch.zeros((), dtype=torch.float64, device=x.device)
        routed = {}
        for i, block in zip(self.block_indices, self.blocks):
            x, aux = block(x, mask, real_BS, rotary)
            if block.is_moe and block.ffn.expert_bias_update_rate > 0:
                routed[i] = block.ffn.stats.routed_local
            if aux is not None:
                aux_total = aux_total + aux
                stats = block.ffn.stats
                balance = balance + stats.aux_loss.detach().double()
                z = z + stats.z_loss.detach().double()
                kept = kept + stats.kept.detach().double().sum()
        if torch.is_grad_enabled():
            self.terms.append(torch.stack([aux_total.detach().double(), balance, z, kept]))
            self.routed.append(routed)
            if aux_total.requires_grad:
                x = AttachAuxLoss.apply(x, aux_total, self.aux_scale)
        return model.final_norm(x[:, N:]) if self.is_last else x


def materialize_stages(model: M6Model, stages: list[int], firsts: list[int], device: torch.device,
                       seed: int) -> list[PipelineStageModule]:
    """Allocate and initialise on ``device`` the parts of a ``meta`` model that ``stages`` own,
    drop the rest (``drop_other_stages``), and return one module per stage, in ``stages`` order.
    ``model.other_stages_state`` then names the state-dict entries the other stages hold (a
    checkpoint of any layout holds them; this rank neither loads nor expects them)."""
    num_stages = len(firsts) - 1
    keep_first, keep_last = 0 in stages, num_stages - 1 in stages
    with torch.no_grad():
        for i in sorted(owned_blocks(stages, firsts)):
            model.blocks[i].to_empty(device=device)
        for name in (FIRST_STAGE_MODULES if keep_first else ()) + (LAST_STAGE_MODULES if keep_last else ()):
            if getattr(model, name) is not None:
                getattr(model, name).to_empty(device=device)
        if _holds_tied_copy(model, stages, num_stages):
            model.text_embed.tokens.to_empty(device=device)
    model.materialize(device, seed, partial=True)
    kept = set(model.state_dict())
    drop_other_stages(model, stages, firsts)
    model.other_stages_state = frozenset(kept - set(model.state_dict()))
    return [PipelineStageModule(model, s, num_stages, range(firsts[s], firsts[s + 1])) for s in stages]


def owned_blocks(stages: list[int], firsts: list[int]) -> set[int]:
    """The blocks of ``stages`` (``firsts``: stage_first_blocks)."""
    return {i for s in stages for i in range(firsts[s], firsts[s + 1])}


def _holds_tied_copy(model: M6Model, stages: list[int], num_stages: int) -> bool:
    """Whether a rank of ``stages`` keeps a copy of the token embedding for its tied LM head."""
    return num_stages - 1 in stages and 0 not in stages and model.lm_head is None


def drop_other_stages(model: M6Model, stages: list[int], firsts: list[int]) -> None:
    """Remove from ``model`` (on any device, ``meta`` included: the planner sizes a pipeline rank
    this way) every part ``stages`` do not own: other blocks become ``StageGap``, the other end's
    modules None. ``model.tied_embedding_copy``: this rank's last stage holds a copy of the first
    stage's token embedding (tied head, stages on other ranks)."""
    num_stages = len(firsts) - 1
    owned = owned_blocks(stages, firsts)
    keep_first, keep_last = 0 in stages, num_stages - 1 in stages
    tied_copy = _holds_tied_copy(model, stages, num_stages)
    for i in range(len(model.blocks)):
        if i not in owned:
            model.blocks[i] = StageGap()
    for name in (() if keep_first else FIRST_STAGE_MODULES) + (() if keep_last else LAST_STAGE_MODULES):
        if not (tied_copy and name == "text_embed"):
            setattr(model, name, None)
    if tied_copy:  # the token table alone: the positions are the first stage's
        model.text_embed.positions = None
        model.tied_embedding_copy = True
