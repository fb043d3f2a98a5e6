"""torch.optim.Adafactor's update on FSDP2's dim-0 shards, exact: the same result as the unsharded
optimizer on the whole tensors (to fp32 summation order), with the statistics that span a shard
boundary summed over the shard's group.

Adafactor (torch's, Shazeer & Stern 2018 with torch's defaults) reads more than one element at a
time in four places; for a parameter sharded on dim 0 over a group (m6.parallel.fsdp: dense
tensors over all ranks, expert tensors over their expert-data-parallel group):
    row factor      mean of g^2 over the last dim: the rows a rank holds are whole, local
    column factor   mean of g^2 over dim -2: for a matrix that is dim 0, the sharded one, so the
                    partial sums are all-reduced (a 3-D expert tensor [E, R, C] is sharded on E:
                    its factors are local)
    row-factor mean the normaliser of row_var @ col_var: over dim -2, all-reduced for a matrix
    norms           the parameter's RMS (the step size's scale) and the update's RMS (its clip)
                    are over the whole tensor: all-reduced squared sums
Two all-reduces per shard group and step, each of one flat buffer (the first: parameter squares,
column partial sums and row-factor sums; the second: update squares). Each update is made twice
(for its norm, then for the step) so that at most one shard-sized update lives at a time:
temporaries of ~3x the largest local shard (its squared gradient or estimate, the update, its
fp32 square), where torch's foreach form holds a variance estimate of every tensor in the call.

State: torch's names and meanings ("step", "row_var", "col_var", "variance"), each a DTensor of
the whole tensor's shape: the row factor and the vector variance sharded on dim 0 as the
parameter, a matrix's column factor replicated (every rank holds the same sums), a 3-D tensor's
both factors sharded on dim 0; so a checkpoint reshards to any layout, unsharded torch Adafactor
included.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from m6.parallel.fsdp import local_part


def _state_like(p: DTensor, local: torch.Tensor, shape: list[int], sharded: bool) -> DTensor:
    """A state DTensor of the whole ``shape`` on ``p``'s mesh: sharded on dim 0 as ``p`` (``local``
    this rank's rows) or replicated (``local`` the whole tensor)."""
    placement = Shard(0) if sharded else Replicate()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, p.device_mesh, [placement], run_check=False, shape=torch.Size(shape),
                              stride=stride)


class ShardedAdafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor over parameters that are FSDP2 DTensor shards (Shard(0) on a 1-D mesh);
    same hyper-parameters, state names and checkpoint layout, exact over any number of shards."""

    def __init__(self, params, lr: float = 1e-2, **kwargs) -> None:
        kwargs.pop("foreach", None)  # one code path: per tensor, with the batched all-reduces above
        super().__init__(params, lr=lr, foreach=False, **kwargs)

    def fresh_state(self, p: DTensor) -> dict:
        """Zeroed state of ``p`` (the whole tensor's shape, laid out as the class docstring says), as
        its first step makes it; a checkpoint load fills it in place."""
        local = local_part(p)
        state = {"step": torch.tensor(0.0, dtype=torch.float32)}
        if p.dim() > 1:
            row_shape, col_shape = list(p.shape), list(p.shape)
            row_shape[-1], col_shape[-2] = 1, 1
            local_row, local_col = list(local.shape), list(local.shape)
            local_row[-1], local_col[-2] = 1, 1
            col_sharded = p.dim() > 2  # a matrix's column factor spans every shard: replicated
            state["row_var"] = _state_like(p, local.new_zeros(local_row), row_shape, True)
            state["col_var"] = _state_like(p, local.new_zeros(local_col if col_sharded else col_shape), col_shape,
                                           col_sharded)
        else:
            state["variance"] = _state_like(p, torch.zeros_like(local), list(p.shape), True)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient (``closure`` as torch's optimizers)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (group, p, state) in parameter order: the same on every rank of a group
        for group in self.param_groups:
            if group["maximize"]:
                raise ValueError("ShardedAdafactor: maximize=True is not supported")
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or p.placements != (Shard(0),):
                    raise ValueError(f"ShardedAdafactor updates FSDP2 dim-0 shards on a 1-D mesh, got "
                                     f"{type(p).__name__} {getattr(p, 'placements', None)}")
                state = self.state[p]
                if not state:
                    state.update(self.fresh_state(p))
                work.append((group, p, state))
        meshes: dict[int, list] = {}
        for item in work:
            meshes.setdefault(id(item[1].device_mesh), []).append(item)
        for items in meshes.values():
            self._step_on_mesh(items)
        return loss

    def _step_on_mesh(self, items: list) -> None:
        """The update of the parameters that share one mesh (one group to sum over)."""
        mesh = items[0][1].device_mesh
        pg = mesh.get_group() if mesh.size() > 1 else None
        # Phase 1, local: step counts, row factors, and the partial sums that need the group.
        partial = []
        for group, p, state in items:
            g, w = local_part(p.grad), local_part(p)
            state["step"] += 1
            step = float(state["step"])
            one_minus_beta2 = step ** group["beta2_decay"]
            partial.append(w.float().square().sum().reshape(1))
            if p.dim() > 1:
                row_var, col_var = local_part(state["row_var"]), local_part(state["col_var"])
                g_sq = g.square()
                row_var.lerp_(g_sq.sum(dim=-1, keepdim=True).div_(p.shape[-1]), one_minus_beta2)
                col_sum = g_sq.sum(dim=-2, keepdim=True)
                if p.dim() == 2:  # dim -2 is the sharded dim: the column sums and the row-factor sum travel
                    partial += [col_sum.reshape(-1), row_var.sum().reshape(1)]
                else:
                    col_var.lerp_(col_sum.div_(p.shape[-2]), one_minus_beta2)
            else:
                local_part(state["variance"]).lerp_(g.square(), one_minus_beta2)
        sums = torch.cat(partial)
        if pg is not None:
            sums = _all_reduce(sums, mesh.device_type, pg)
        # Phase 2, local: the factors completed from the summed statistics, and each update's
        # squared sum (the update itself is dropped and made again in phase 3: one shard-sized
        # temporary at a time, not a copy of every shard until the second all-reduce).
        update_sq, alphas, row_means, at = [], [], [], 0
        # The parameters' squared sums to the host in one copy (one device sync, not one per tensor).
        starts = [0]
        for _, p, _ in items[:-1]:
            starts.append(starts[-1] + 1 + (p.shape[-1] + 1 if p.dim() == 2 else 0))
        param_sq = sums[starts].tolist()
        for group, p, state in items:
            step = float(state["step"])
            one_minus_beta2 = step ** group["beta2_decay"]
            rho = min(group["lr"], 1 / math.sqrt(step))
            param_rms = math.sqrt(param_sq[len(alphas)]) / math.sqrt(p.numel())
            at += 1
            alphas.append(max(group["eps"][1], param_rms) * rho)
            row_mean = None
            if p.dim() == 2:
                col_var, cols = local_part(state["col_var"]), p.shape[-1]
                col_var.lerp_(sums[at:at + cols].reshape(col_var.shape) / p.shape[-2], one_minus_beta2)
                row_mean = sums[at + cols] / p.shape[-2]
                at += cols + 1
            row_means.append(row_mean)
            update_sq.append(_update(p, state, group, row_mean).float().square().sum().reshape(1))
        update_sq = torch.cat(update_sq)
        if pg is not None:
            update_sq = _all_reduce(update_sq, mesh.device_type, pg)
        # Phase 3, local: weight decay and the step, the update's RMS clipped to ``d``.
        for (group, p, state), alpha, row_mean, sq in zip(items, alphas, row_means, update_sq.tolist()):
            w = local_part(p)
            update = _update(p, state, group, row_mean)
            if group["weight_decay"] != 0:
                w.mul_(1 - group["lr"] * group["weight_decay"])
            denom = max(1.0, math.sqrt(sq) / (math.sqrt(p.numel()) * group["d"]))
            w.add_(update, alpha=-alpha / denom)


def _all_reduce(t: torch.Tensor, device_type: str, pg) -> torch.Tensor:
    """The sum of ``t`` over ``pg``, reduced on the mesh's device type (FSDP2's CPU offload keeps
    the shards, so these sums, on the host; NCCL reduces only CUDA tensors), returned where ``t`` was."""
    if t.device.type == device_type:
        dist.all_reduce(t, group=pg)
        return t
    moved = t.to(device_type)
    dist.all_reduce(moved, group=pg)
    return moved.to(t.device)


def _update(p: DTensor, state: dict, group: dict, row_mean: torch.Tensor | None) -> torch.Tensor:
    """This rank's rows of Adafactor's unscaled update g / sqrt(second-moment estimate), from the
    completed factors; ``row_mean``: a matrix's row-factor mean over all its rows (summed over
    the shards), None for a 3-D tensor (its own, local) or a vector."""
    eps1 = group["eps"][0] if group["eps"][0] is not None else torch.finfo(p.dtype).eps
    if p.dim() > 1:
        row_var, col_var = local_part(state["row_var"]), local_part(state["col_var"])
        if row_mean is None:
            row_mean = row_var.mean(dim=-2, keepdim=True)
        estimate = (row_var @ col_var).div_(row_mean.clamp(min=eps1))
    else:
        estimate = local_part(state["variance"]).clone()
    return estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(local_part(p.grad))
