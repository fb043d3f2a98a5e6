"""What a run says about itself on the console: the start-up banner, checkpoint lines, the end line.

Plain functions of plain facts (no model, no process group), so each line is tested as text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from m6 import __version__
from m6.config import Config, expert_ffn_dim, num_patches, pipeline_stages_per_rank
from m6.data.make_sample import is_sample_corpus_path, is_sample_corpus_statistics
from m6.data.sources import relative_to_cwd_note
from m6.memory.home_grads import grads_land_in_homes
from m6.model.architecture import block_options
from m6.model.flops import ModelSize
from m6.moe.expert_gemm import planned_kernel
from m6.moe.router import router_gemm_precision
from m6.train.loggers import format_duration

SYNTHETIC_WARNING = ("SYNTHETIC (data.kind=synthetic: generated shapes and captions, not real data; "
                     "set data.kind=files and data.sources to train on yours)")


@dataclass(frozen=True)
class RunFacts:
    """What the trainer decided at start-up, as the banner shows it."""

    world_size: int
    expert_parallel_size: int
    micro_batch: int
    accumulation: int
    device: torch.device
    precision: str  # e.g. "bf16 (cast-on-use)" or "fp32"
    size: ModelSize  # the whole model (all experts), not this rank's share
    moe_blocks: list[int]  # indices of the blocks whose FFN is MoE (the model's moe_layers())
    source_records: list[int]  # records indexed per data source (synthetic: [num_samples])
    tokenizer: str  # e.g. "byte (vocab 261)"
    run_dir: Path
    start: str  # "fresh" or "resumed from PATH at step N (...)"
    wandb: str | None  # resolved W&B mode, None = off
    user_dataset: str | None = None  # type name of the dataset passed to Trainer (Python API)
    tensorboard: Path | None = None  # the event files' folder, None = off
    balance: str | None = None  # parallel.balance's line (m6.train.balance.balance_line); None = even
    held_out: list[int] | None = None  # records held out of each source for the caption eval
    eval_samples: int = 0  # caption-eval samples (held out, generated or passed to Trainer)


def human_count(n: float) -> str:
    """1234567 -> '1.23M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {suffix}"
    return f"{n:.0f} B"


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'' if threads == 1 else 's'})"


def _compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype the expert GEMMs see under train.precision (m6.train.loop.resolve_precision's rule)."""
    if precision in ("bf16", "bf16-autocast") or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float16 if precision == "fp16" else torch.float32


def _model_line(cfg: Config, size: ModelSize, blocks: list[int], device: torch.device) -> str:
    m, moe = cfg.model, cfg.model.moe
    shape = f"{m.num_layers} blocks x d_model {m.d_model}, {m.num_heads} heads"
    options = block_options(m)
    if options:
        shape += f" ({options})"
    if not blocks:
        ffn = f"dense FFN {m.ffn_dim}"
    else:
        where = "every block" if len(blocks) == m.num_layers else f"blocks {','.join(map(str, blocks))}"
        capacity = "dropless" if moe.capacity_factor is None else f"capacity {moe.capacity_factor:g} per {moe.capacity_group}"
        groups = f" in {moe.num_prototypes} prototypes" if moe.num_prototypes > 1 else ""
        router = router_gemm_precision(moe.router_dtype, device.type)
        kernel = planned_kernel(moe.expert_kernel, device, _compute_dtype(cfg.train.precision, device), moe.num_experts,
                                m.d_model, expert_ffn_dim(m))
        ffn = (f"MoE in {where}: {moe.num_experts} experts{groups}, top-{moe.top_k}, {capacity}, router GEMM {router}, "
               f"expert kernel {kernel}")
        if moe.force_balance:
            ffn += " | !! routing FORCED balanced (model.moe.force_balance: benchmarking only)"
    return f"{shape}; {ffn} | {human_count(size.total)} params, {human_count(size.active)} active per token"


def _data_lines(cfg: Config, facts: RunFacts) -> list[str]:
    d = cfg.data
    if facts.user_dataset is not None:
        return [f"data     the {facts.user_dataset} passed to Trainer ({facts.source_records[0]:,} samples; "
                f"data.kind and data.sources unused); tokenizer {facts.tokenizer}"]
    if d.kind == "synthetic":
        return [f"!! data: {SYNTHETIC_WARNING}, {facts.source_records[0]:,} samples per epoch"]
    specs = [", ".join([src.path] if isinstance(src.path, str) else src.path) for src in d.sources]
    paths = [p for src in d.sources for p in ([src.path] if isinstance(src.path, str) else src.path)]
    count = f"{len(d.sources)} source{'s' if len(d.sources) > 1 else ''}"
    lines = [f"data     {count}, tokenizer {facts.tokenizer}{relative_to_cwd_note(paths)}"]
    width = max(len(spec) for spec in specs)
    held_out = facts.held_out or [0] * len(d.sources)
    for src, spec, records, held in zip(d.sources, specs, facts.source_records, held_out):
        lines.append(f"           {src.format:<5} {spec:<{width}}  weight {src.weight:g}, {records:,} records"
                     f"{_held_out_words(held, records, d.eval_samples, facts.eval_samples)}")
    if d.eval_samples and not any(held_out):
        lines.append(f"           no caption eval: data.eval_samples={d.eval_samples} but no image source (tar or "
                     f"jsonl) to hold records out of")
    image_paths = [p for src in d.sources if src.format != "text"
                   for p in ([src.path] if isinstance(src.path, str) else src.path)]
    if is_sample_corpus_statistics(d.image_mean, d.image_std) and not all(map(is_sample_corpus_path, image_paths)):
        lines.append(f"!! data: images normalised with the sample corpus's pixel statistics (data.image_mean "
                     f"{list(d.image_mean)}, data.image_std {list(d.image_std)}), not your images': set both to "
                     f"theirs (python -m m6.data.prepare prints them)")
    return lines


def _held_out_words(held: int, records: int, asked: int, usable: int) -> str:
    """What the caption eval takes from a source: records held out (never trained on), and why
    fewer than data.eval_samples when the source is small (at most half of it is held out)."""
    if not held:
        return ""
    capped = f", data.eval_samples={asked} capped at half the source" if held < asked else ""
    unusable = f", {held - usable:,} of them unreadable" if usable < held else ""
    return f" to train, {held:,} held out for eval{capped}{unusable}"


_SHARD_WORDS = {"optimizer": "gradients + optimizer state (ZeRO-2, parallel.shard=optimizer)",
                "full": "parameters + gradients + optimizer state (FSDP2, parallel.shard=full)"}


def _compile_line(cfg: Config, moe_blocks: list[int]) -> str:
    """train.compile=blocks: what is compiled, and when its time is reported (compilation is lazy)."""
    n = cfg.model.num_layers
    mlp = " and dense MLP" if len(moe_blocks) < n else ""
    moe = "; MoE layers eager" if moe_blocks else ""
    return (f"compile  blocks ({n} blocks: attention sub-block, FFN norm{mlp}; torch.compile, inductor{moe}); "
            f"compiled lazily in the first step, its compile time printed after it")


def compile_time_line(step: int, seconds: float, step_seconds: float, first: bool) -> str:
    """After a step in which torch.compile compiled: how long, by torch.compile's own timers."""
    if first:
        return (f"compile: blocks compiled in {seconds:.1f} s during step {step} (torch.compile's own timers; the step "
                f"took {step_seconds:.1f} s; a cached rerun compiles faster)")
    return (f"compile: {seconds:.1f} s more compiling by step {step} (a new input shape or mode: another "
            f"micro-batch size, eval)")


def startup_banner(cfg: Config, facts: RunFacts) -> str:
    """The block a run prints before its first step: what trains, where, on what, from where."""
    t, mem = cfg.train, cfg.memory
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    dp = facts.world_size // tp // pp // facts.expert_parallel_size
    data_ranks = facts.world_size // tp // pp
    ranks = f"{facts.world_size} process{'es' if facts.world_size > 1 else ''}"
    # At tensor parallel a batch shard feeds a tp group: data_ranks shards, not one per process.
    split = (f"micro-batch {facts.micro_batch} x accumulation {facts.accumulation} x {data_ranks} "
             f"{'rank' if tp == 1 and pp == 1 else 'tp group' if pp == 1 else 'pipeline'}{'s' if data_ranks > 1 else ''}") if facts.balance is None else (
             f"shares by parallel.balance in {facts.accumulation} micro-batch(es) per rank of at most {facts.micro_batch}")
    lines = [
        f"m6 {__version__} | torch {torch.__version__} | {ranks} on {device_label(facts.device)} | {facts.precision}"
        f"{' | deterministic' if t.deterministic else ''}",
        f"model    {_model_line(cfg, facts.size, facts.moe_blocks, facts.device)}",
        f"parallel world {facts.world_size} = {pipeline_words(cfg)}{f'tensor-parallel {tp} x ' if tp > 1 else ''}"
        f"expert-parallel "
        f"{facts.expert_parallel_size} x expert-data-parallel "
        f"{dp}{'' if cfg.parallel.shard == 'none' else f', sharded {_SHARD_WORDS[cfg.parallel.shard]}'}; batch {t.global_batch_size} = {split}; per sample {cfg.data.seq_len} text tokens + "
        f"{num_patches(cfg.model)} image patches",
        *([facts.balance] if facts.balance else []),
        f"memory   offload {mem.offload}{zero_layout_words(cfg)}"
        f"{', host gradients in the compute dtype' if mem.offload not in ('none', 'zero') and mem.host_grad_dtype == 'compute' else ''}"
        f"{delayed_update_words(cfg)}, recompute {mem.activation_checkpointing}",
        *([_compile_line(cfg, facts.moe_blocks)] if t.compile else []),
        *_data_lines(cfg, facts),
        f"run      {facts.run_dir} | {facts.start} | {t.max_steps} steps | metrics.jsonl"
        f"{', W&B ' + facts.wandb if facts.wandb else ''}"
        f"{f', TensorBoard {facts.tensorboard}' if facts.tensorboard else ''} | "
        + (f"checkpoint every {cfg.checkpoint.every or 'end only'}{', async' if cfg.checkpoint.async_save else ''}"
           if cfg.checkpoint.enabled else "checkpoints OFF (checkpoint.enabled=false)"),
    ]
    return "\n".join(lines)


def zero_layout_words(cfg: Config) -> str:
    """The memory line's words for memory.offload=zero: which layout runs ('' for other modes)."""
    mem = cfg.memory
    if mem.offload != "zero":
        return ""
    num_blocks = cfg.model.num_layers
    dtype = "fp16" if cfg.train.precision == "fp16" else "bf16"
    if mem.offload_blocks == "auto":
        # resolved once the model is built (its log line says how many stay); the banner comes first
        streamed = None
        where = f"the blocks that fit resident, the rest streamed in {dtype} from the host (offload_blocks=auto)"
    else:
        streamed = num_blocks if mem.offload_blocks == "all" else len(mem.offload_blocks)
        where = (f"all {num_blocks} blocks resident" if streamed == 0 else
                 f"{num_blocks - streamed} of {num_blocks} blocks resident, {streamed} streamed in {dtype} from the host")
    grads = dtype if mem.host_grad_dtype == "compute" else "fp32"
    homes = " (the streamed blocks' into their homes)" if streamed != 0 and grads_land_in_homes(cfg) else ""
    if cfg.parallel.shard == "optimizer":  # m6.memory.zero_partition
        return (f" (ZeRO-Offload's layout, partitioned: {dtype} weights whole on every device (routers' gates fp32), "
                f"{where}; {dtype} gradients reduce-scattered, each rank's dim-0 chunks to {grads} host buffers; "
                f"fp32 masters and optimizer state of its chunks only on its host (dense parameters split over the "
                f"data-parallel ranks, experts over expert_data); its {dtype} chunks back, then all-gathered)")
    return (f" (ZeRO-Offload's layout: {dtype} weights on the device (routers' gates fp32), {where}; fp32 masters "
            f"and optimizer state on the host, {dtype} gradients to {grads} host buffers{homes}, {dtype} weights back)")


def pipeline_words(cfg: Config) -> str:
    """The parallel line's words for the pipeline dim ('' at parallel.pipeline_parallel_size 1)."""
    p = cfg.parallel
    if p.pipeline_parallel_size == 1:
        return ""
    per_rank = pipeline_stages_per_rank(p)
    stages = f", {per_rank} stages per rank" if per_rank > 1 else ""
    return f"pipeline-parallel {p.pipeline_parallel_size} ({p.pipeline_schedule}{stages}) x "


def delayed_update_words(cfg: Config) -> str:
    """The memory line's words for optim.delayed_update ('' when off)."""
    if not cfg.optim.delayed_update:
        return ""
    after = cfg.optim.delayed_update_after
    return (f", delayed update from step {after + 1} (the host update of step t runs during step t+1, whose "
            f"forward uses the weights from before it: one step stale)")


def checkpoint_line(step: int, path: Path, nbytes: int, seconds: float, background: bool) -> str:
    """One line per checkpoint in place: where, how big, how long the write took."""
    how = " in the background" if background else ""
    return f"checkpoint: step {step} saved to {path} ({human_bytes(nbytes)}, written{how} in {seconds:.1f} s)"


def end_line(steps_run: int, step: int, max_steps: int, final: dict, tokens: float, seconds: float,
             run_dir: Path, latest: Path | None) -> str:
    """The run's last line: what it did and where its outputs are."""
    loss = (f"final loss {final['loss']:.4f} (lm {final['lm_loss']:.4f})" if "loss" in final
            else "no step run")
    saved = f", checkpoint {latest}" if latest is not None else ""
    return (f"done: step {step}/{max_steps}, {steps_run} steps run in {format_duration(seconds)}, {loss}, "
            f"{human_count(tokens)} tokens | outputs in {run_dir}: metrics.jsonl, summary.json{saved}")
