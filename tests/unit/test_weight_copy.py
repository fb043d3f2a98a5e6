"""train.weight_copy=per_step (m6.memory.master_weights): bf16 module weights made once per step
from fp32 masters on the device. It trains as cast-on-use does, bitwise (the same bf16 values, the
same kernels, gradients summed in fp32), with and without accumulation; its fp32 accumulation is
what keeps that (a bf16 sum would not); checkpoints hold the fp32 masters and resume exactly; and
what is not built with it is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from m6.config import ConfigError, load
from m6.memory.master_weights import MasterWeights, compute_weight_params
from m6.train.loop import Trainer

SMALL = [
    "model.d_model=32", "model.num_layers=3", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=2", "model.moe.num_experts=4", "data.kind=synthetic",
    "data.num_workers=0", "data.num_samples=256", "data.eval_samples=8", "data.seq_len=48",
    "train.global_batch_size=8", "train.eval_every=0", "train.max_steps=6", "train.precision=bf16",
    "logging.console=false", "checkpoint.every=0", "train.grad_clip=0.5",
]


def trainer(path, device: torch.device, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"train.device={device.type}", f"run.dir={path}", *extra]))


def curve(history: list[dict]) -> list[tuple[float, float]]:
    return [(row["loss"], row["grad_norm"]) for row in history]


def bitwise_on_cpu(device: torch.device) -> None:
    """The bitwise comparisons are the CPU's; on CUDA kernels that add atomically (index_add, scatter
    in the MoE backward) may make even two runs of one setting differ, and the default update is
    the Triton kernel, which rounds like torch's within an fp32 ulp (test_adamw_copy.py runs there)."""
    if device.type != "cpu":
        pytest.skip("bitwise run-to-run comparisons are CPU-only")


@pytest.mark.parametrize("micro_batch", [8, 2])
def test_per_step_trains_like_cast_on_use_bitwise(tmp_path, device, micro_batch):
    """Same bf16 weights, same kernels, fp32 gradient sums: the curves agree bit for bit, with one
    micro-batch and with four (untied head: every weight kind has a copy)."""
    bitwise_on_cpu(device)
    extra = [f"train.micro_batch_size={micro_batch}", "checkpoint.enabled=false", "model.tie_embeddings=false"]
    per_use = trainer(tmp_path / "use", device, *extra)
    per_step = trainer(tmp_path / "step", device, *extra, "train.weight_copy=per_step")
    masters = per_step.update.masters
    assert per_use.update.masters is None and masters is not None
    copied = {id(p) for p in masters.params}
    names = {n for n, p in per_step.model.named_parameters() if id(p) in copied}
    assert "lm_head.weight" in names and any("w_in" in n for n in names) and any("qkv" in n or "q_proj" in n
                                                                                 or "attn" in n for n in names)
    assert not any("norm" in n or "router" in n or "text_embed" in n for n in names), names
    assert {p.dtype for p in masters.params} == {torch.bfloat16}
    assert {m.dtype for m in masters.masters.values()} == {torch.float32}
    assert curve(per_use.fit()) == curve(per_step.fit())
    for p in masters.params:  # the copy is the master rounded, after the last update too
        assert torch.equal(p.detach(), masters.master(p).to(torch.bfloat16))
    use_params = dict(per_use.model.named_parameters())
    for name, p in per_step.model.named_parameters():
        assert torch.equal(masters.master(p), use_params[name].detach()), name


@pytest.mark.parametrize("extra", [["memory.activation_checkpointing=full"], ["optim.name=adafactor"]],
                         ids=["full-recompute", "adafactor"])
def test_per_step_with_recompute_or_adafactor_trains_like_cast_on_use(tmp_path, device, extra):
    """Recompute runs the forward again in backward on the same bf16 copies; Adafactor updates the
    masters and one multi-tensor copy follows: still bitwise."""
    bitwise_on_cpu(device)
    extra = ["train.micro_batch_size=4", "checkpoint.enabled=false", "train.max_steps=3", *extra]
    per_use = trainer(tmp_path / "use", device, *extra)
    per_step = trainer(tmp_path / "step", device, *extra, "train.weight_copy=per_step")
    assert curve(per_use.fit()) == curve(per_step.fit())


def test_per_step_fp16_with_loss_scale_trains_like_cast_on_use(tmp_path, device):
    """fp16: the copies in fp16, the scaled gradients folded into the masters; an initial scale
    that overflows makes both skip the same steps and back off the same way."""
    bitwise_on_cpu(device)
    extra = ["train.precision=fp16", "train.loss_scale_init=1e12", "train.micro_batch_size=4",
             "checkpoint.enabled=false", "train.max_steps=5"]
    base = [o for o in SMALL if not o.startswith("train.precision")]
    runs = {}
    for mode in ("per_use", "per_step"):
        tr = Trainer(load(None, [*base, *extra, f"train.device={device.type}", f"run.dir={tmp_path / mode}",
                                 f"train.weight_copy={mode}"]))
        history = tr.fit()
        runs[mode] = [(r["loss"], repr(r["grad_norm"]), r["loss_scale"]) for r in history]  # nan: an overflow
        if mode == "per_step":
            assert {p.dtype for p in tr.update.masters.params} == {torch.float16}
            assert "weight copy per step" in tr._facts().precision
    assert runs["per_use"] == runs["per_step"]
    assert runs["per_step"][-1][2] < 1e12 and runs["per_step"][0][1] in ("nan", "inf"), runs  # skipped, backed off


def test_fp32_accumulation_is_what_keeps_the_gradients_exact(tmp_path, device):
    """Four micro-batches: the masters' gradients equal cast-on-use's fp32 gradients bitwise; the
    same micro-batch gradients summed in bf16 (what accumulating on the bf16 weights would give)
    do not, so the equality is the fp32 accumulation's doing."""
    bitwise_on_cpu(device)
    extra = ["train.micro_batch_size=2", "checkpoint.enabled=false", "train.max_steps=1"]
    per_use = trainer(tmp_path / "use", device, *extra)
    per_step = trainer(tmp_path / "step", device, *extra, "train.weight_copy=per_step")
    masters = per_step.update.masters
    parts: dict[int, list[torch.Tensor]] = {}
    fold = masters._fold_grad

    def recording_fold(p):
        parts.setdefault(id(p), []).append(p.grad.detach().clone())
        fold(p)
    for p in masters.params:
        p._post_accumulate_grad_hooks.clear()
        p.register_post_accumulate_grad_hook(recording_fold)
    for tr in (per_use, per_step):  # stop before the update: the step's gradients
        tr.update.step = lambda apply=True: None
        tr.update.clip = lambda max_norm: 1.0
        tr.train_step()
    use_grads = {n: p.grad for n, p in per_use.model.named_parameters()}
    bf16_off = 0
    for name, p in per_step.model.named_parameters():
        if id(p) not in masters.masters:
            continue
        assert len(parts[id(p)]) == 4, name
        assert torch.equal(masters.master(p).grad, use_grads[name]), name
        bf16_sum = parts[id(p)][0]
        for g in parts[id(p)][1:]:
            bf16_sum = bf16_sum + g
        bf16_off += int(not torch.equal(bf16_sum.float(), use_grads[name]))
    assert bf16_off > 0, "bf16 accumulation matched fp32 too: the test could not tell them apart"


def test_checkpoint_holds_fp32_masters_and_resumes_exactly(tmp_path, device):
    bitwise_on_cpu(device)
    straight = trainer(tmp_path / "straight", device, "train.weight_copy=per_step", "checkpoint.enabled=false")
    want = curve(straight.fit())
    first = trainer(tmp_path / "run", device, "train.weight_copy=per_step")
    first.fit(stop_at=3)
    tensors = first.state.model.tensors()
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    second = trainer(tmp_path / "run", device, "train.weight_copy=per_step", "checkpoint.resume=auto")
    assert second.step == 3
    masters = second.update.masters
    for p in masters.params:  # the load wrote the masters; the bf16 copies followed
        assert torch.equal(p.detach(), masters.master(p).to(torch.bfloat16))
    assert want[:3] == curve(first.history) and want[3:] == curve(second.fit())


def test_per_use_checkpoint_resumes_into_per_step(tmp_path, device):
    """The checkpoint layout is the same (fp32 weights by name): a cast-on-use run continues with
    the per-step copy, bitwise."""
    bitwise_on_cpu(device)
    straight = trainer(tmp_path / "straight", device, "checkpoint.enabled=false")
    want = curve(straight.fit())
    trainer(tmp_path / "run", device).fit(stop_at=3)
    switched = trainer(tmp_path / "run", device, "train.weight_copy=per_step", "checkpoint.resume=auto")
    assert want[3:] == curve(switched.fit())


def test_tied_embedding_keeps_fp32():
    """A tied embedding is looked up in fp32 by the embedding layer: it gets no bf16 copy."""
    from m6.model import M6Model
    cfg = load(None, [*SMALL, "model.tie_embeddings=true"])
    model = M6Model(cfg.model)
    names = {n for n, p in model.named_parameters() if id(p) in {id(q) for q in compute_weight_params(model)}}
    assert "text_embed.tokens.weight" not in names and names
    MasterWeights(model, torch.bfloat16)
    assert model.text_embed.tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("extra, key", [
    (["train.precision=fp32"], "train.precision"),
    (["train.precision=auto"], "train.precision"),
    (["memory.offload=optimizer"], "memory.offload"),
    (["parallel.shard=full"], "parallel.shard"),
    (["parallel.tensor_parallel_size=2"], "parallel.tensor_parallel_size"),
    (["memory.activation_checkpointing=full", "memory.check_checkpointing=true"], "memory.check_checkpointing"),
])
def test_refuses_what_it_is_not_built_with(extra, key):
    base = [o for o in SMALL if not o.startswith("train.precision")]
    with pytest.raises(ConfigError, match=rf"train.weight_copy=per_step with {key}"):
        load(None, [*base, "train.precision=bf16", *extra, "train.weight_copy=per_step"] if "precision" not in key
             else [*base, *extra, "train.weight_copy=per_step"])


def test_memory_estimate_counts_the_copies(tmp_path, device):
    """The estimate's params: the fp32 masters (or parameters) plus the bf16 copies, as the run holds them."""
    from m6.memory import estimate_memory
    from m6.model.param_groups import no_decay_ids
    tr = trainer(tmp_path, device, "train.weight_copy=per_step", "checkpoint.enabled=false",
                 "model.tie_embeddings=false")
    held = sum(p.nbytes for p in tr.model.parameters()) + sum(m.nbytes for m in tr.update.masters.masters.values())
    report = estimate_memory(tr.cfg, tr.model, no_decay_ids(tr.model), device_type=device.type)
    plain = estimate_memory(load(None, [*SMALL, "model.tie_embeddings=false", f"train.device={device.type}"]),
                            tr.model, no_decay_ids(tr.model), device_type=device.type)
    assert report.device["params"] == held
    assert report.device["params"] - plain.device["params"] == 2 * tr.update.masters.num_params


class WeightCasts(TorchDispatchMode):
    """Counts dtype casts (aten._to_copy) that read a weight or a master, and multi-tensor copies."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages, self.casts, self.foreach_copies = storages, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.storages:
            self.casts += 1
        if func is torch.ops.aten._foreach_copy_.default:
            self.foreach_copies += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("micro_batch", [8, 2])
def test_per_step_casts_no_weight_per_use(tmp_path, device, micro_batch):
    """The traffic it removes, counted: cast-on-use casts each weight twice per micro-batch (forward
    and backward); the per-step copy casts none in forward and backward, and the update writes all
    copies in one multi-tensor copy per step (torch's AdamW path; on CUDA the Triton kernel)."""
    bitwise_on_cpu(device)  # the CPU update path (one foreach copy)
    counts = {}
    for mode in ("per_use", "per_step"):
        tr = trainer(tmp_path / mode, device, f"train.weight_copy={mode}", f"train.micro_batch_size={micro_batch}",
                     "checkpoint.enabled=false", "model.tie_embeddings=false")
        weights = compute_weight_params(tr.model)
        storages = {p.untyped_storage().data_ptr() for p in weights}
        if tr.update.masters:
            storages |= {m.untyped_storage().data_ptr() for m in tr.update.masters.masters.values()}
        tr.train_step()  # the first step builds the optimizer state
        with WeightCasts(storages) as seen:
            tr.train_step()
        counts[mode] = (len(weights), seen.casts, seen.foreach_copies)
    num_weights, casts, _ = counts["per_use"]
    assert casts == 2 * num_weights * (8 // micro_batch), counts
    assert counts["per_step"][1:] == (0, 1), counts
