"""memory.offload=zero in the one memory estimate (m6.memory.estimate.zero_memory):
what ``python -m m6.inspect`` prints and what ``memory.offload_blocks=auto`` sizes with are the
planner's bytes of ZeRO-Offload's layout (16-bit device weights), not the fp32 layouts' 4 B."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from m6 import inspect as m6inspect
from m6.config import load
from m6.memory.memory_report import estimate_memory
from m6.memory.offload_blocks import AUTO_MEMORY_FRACTION, resolve_offload_blocks
from m6.plan.memory import RankMemory

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
SMALL = ["data.kind=synthetic", "data.sources=[]", "model.moe.capacity_factor=null", "data.seq_len=40",
         "model.max_text_len=40", "model.image_size=16", "train.global_batch_size=16", "train.precision=bf16",
         "memory.host_optimizer=torch", "checkpoint.async_save=false"]


def _cfg(*extra: str):
    return load(CONFIG, [*SMALL, *extra])


def test_the_estimate_of_zero_is_the_planners_with_16_bit_device_weights():
    rm = RankMemory(_cfg(), 2, 2, "cuda")
    for extra in ([], ["memory.offload_blocks=[0,1]"], ["memory.host_grad_dtype=compute", "train.micro_batch_size=4"]):
        cfg = _cfg("memory.offload=zero", *extra)
        est = estimate_memory(cfg, rm.model, rm.no_decay, 2, 2, "cuda")
        planned = rm.report(cfg)
        assert (est.device, est.host, est.peak_device, est.peak_host) == \
            (planned.device, planned.host, planned.peak_device, planned.peak_host)
    numel = sum(p.numel() for p in rm.model.parameters())
    resident = estimate_memory(_cfg("memory.offload=zero", "memory.offload_blocks=[]"), rm.model, rm.no_decay, 2, 2)
    fp32 = estimate_memory(_cfg("memory.offload=optimizer"), rm.model, rm.no_decay, 2, 2)
    assert resident.device["params"] == 2 * numel and fp32.device["params"] == 4 * numel
    assert resident.host["params"] == 4 * numel


def test_inspect_prints_zero_s_16_bit_weights_and_its_host_staging():
    cfg = _cfg("memory.offload=zero", "memory.offload_blocks=[]")
    r = m6inspect.report(cfg, 1, "cuda")
    lines = m6inspect.report_lines(cfg, r, "tiny.yaml", "cuda")
    feat = r["memory_with_features"]
    params = next(ln for ln in lines if ln.strip().startswith("params"))
    assert m6inspect._bytes(feat.device["params"]) in params and feat.device["params"] == 2 * r["total_params"]
    assert any(ln.strip().startswith("16-bit weight staging") for ln in lines)


def test_offload_blocks_auto_with_zero_keeps_the_blocks_that_fit(monkeypatch):
    """Accepted by the config now; on a (pretended) CUDA device the zero estimate decides."""
    cfg = _cfg("memory.offload=zero", "memory.offload_blocks=auto")
    rm = RankMemory(cfg, 1, 1, "cuda")

    def peak(streamed):
        return estimate_memory(_cfg("memory.offload=zero", f"memory.offload_blocks={streamed}"),
                               rm.model, rm.no_decay, 1, 1, "cuda").peak_device

    cuda, lines = torch.device("cuda"), []
    num_blocks = len(rm.model.blocks)
    least = peak(list(range(num_blocks)))
    assert least < peak([])
    # The fewest blocks from 0 up whose streaming brings the peak down to the least (a window of two
    # blocks stays on the device, so streaming one block alone saves nothing).
    fewest = next(list(range(k)) for k in range(num_blocks + 1) if peak(list(range(k))) <= least)
    assert fewest
    for memory, expected in ((least / AUTO_MEMORY_FRACTION, fewest), (1e15, [])):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, m=memory: SimpleNamespace(total_memory=m))
        assert resolve_offload_blocks(cfg, rm.model, rm.no_decay, 1, 1, cuda, lines.append) == expected
    assert f"memory.offload_blocks=auto: {num_blocks - len(fewest)} of {num_blocks} blocks stay on the device" \
        in lines[0]


def test_copy_back_staging_is_what_the_runtime_pins(tmp_path, monkeypatch):
    """The estimate's 16-bit weight staging against HalfWeightPush's buffers after real steps: two
    buffers of the largest push (one forward-order segment's resident weights), each at most a chunk."""
    from m6.memory import estimate as estimate_module
    from m6.memory.estimate import STAGING_CHUNK, WEIGHT_STAGING, copy_back_staging
    from m6.model.param_groups import no_decay_ids
    from tests.unit.test_offload_zero import ZERO, trainer

    assert copy_back_staging(10) == 20 and copy_back_staging(3 * STAGING_CHUNK) == 2 * STAGING_CHUNK
    for chunk in (STAGING_CHUNK, 5000):  # 5000: pushes larger than a chunk (the model has ~40k elements)
        monkeypatch.setattr(estimate_module, "STAGING_CHUNK", chunk)
        for extra in ([], ["optim.apply_groups=2"], ["memory.offload_blocks=[1]"]):
            tr = trainer(tmp_path / f"{chunk}-{len(extra)}", *ZERO, *extra)
            tr.update.offload._half_push.chunk_numel = chunk  # before the first push allocates a buffer
            for _ in range(2):
                tr.train_step()
            off = tr.update.offload
            homes = sum(h.numel() * h.element_size() for h in off.streamer.homes().values()) if off.streamer else 0
            est = estimate_memory(tr.cfg, tr.model, no_decay_ids(tr.model), 1, 1, "cpu")
            # The estimate counts the routers' fp32 gates at 2 B: in the push, in each of the two
            # buffers (the runtime copies them apart), and in a streamed block's homes (the
            # runtime's are fp32).
            gates = sum(layer.router.weight.numel() for layer in tr.model.moe_layers().values())
            over = est.host[WEIGHT_STAGING] - off._half_push.staging_bytes() - homes
            assert abs(over) <= 4 * gates, (chunk, extra, over)


def test_one_memory_holds_the_update_temporaries_after_backward_not_beside_it():
    """On a CPU device (one memory) the synchronous update's temporaries come once backward's
    activations are gone; the delayed update's run beside the next backward, so they add up."""
    rm = RankMemory(_cfg(), 1, 1, "cpu")
    sync = rm.report(_cfg("memory.offload=zero", "memory.offload_blocks=[]"))
    temporaries = sync.host["optimizer step temporaries"]
    assert 0 < temporaries < sync.peak_device - sync.device["params"]
    assert sync.peak_shared == sync.peak_device + sync.peak_host - temporaries
    delayed = rm.report(_cfg("memory.offload=zero", "memory.offload_blocks=[]", "optim.delayed_update=true"))
    assert delayed.peak_shared == delayed.peak_device + delayed.peak_host


def _measured_device_peak(cfg, steps_before: int = 1) -> tuple[float, object]:
    """(device bytes of one real zero step on CPU: the storages alive at its start that this run
    made, less the offload's host storages, + the peak of what the step allocates (LiveBytes);
    the trainer). What earlier tests of this pytest process left alive is not the run's."""
    import gc

    from bench.plan_measure import DenseSamples, live_storage_bytes, offload_host_bytes
    from m6.memory.live_bytes import LiveBytes
    from m6.train.loop import Trainer

    gc.collect()
    before = live_storage_bytes()
    m = cfg.model
    data = DenseSamples(cfg.train.global_batch_size * (steps_before + 1), cfg.data.seq_len,
                        (m.image_channels, m.image_size, m.image_size), 0)
    tr = Trainer(cfg, dataset=data)
    for _ in range(steps_before):  # the first step allocates the copy back's staging
        tr.train_step()
    at_start, host = live_storage_bytes(), offload_host_bytes(tr)
    with LiveBytes() as live:
        tr.train_step()
    return at_start - before - host + live.peak, tr


def test_zero_device_peak_is_a_real_steps(tmp_path):
    """zero's device peak against one real step's on CPU (densest batch, balanced routing): the
    residual stream is 16-bit (the embeddings' weights are), the head's backward holds two fp32
    logit-sized gradients on top of every activation, a block's own gradient buffers come with
    the activations left at its backward, and a streamed block is on the device only around its
    own forward and backward. Before, the estimate counted an fp32 residual stream and the largest
    block transient on top of every activation (12% over here) and the streamed window all step."""
    from m6.model.param_groups import no_decay_ids

    base = [*SMALL, "memory.offload=zero", "memory.offload_blocks=[]", "model.moe.force_balance=true",
            "data.num_workers=0", "train.device=cpu", "logging.console=false", "checkpoint.every=0",
            "train.eval_every=0", "data.eval_samples=0"]
    for i, extra in enumerate(([], ["memory.offload_blocks=[1]", "train.micro_batch_size=8"])):
        cfg = _cfg(*base[len(SMALL):], *extra, f"run.dir={tmp_path}/{i}")
        measured, tr = _measured_device_peak(cfg)
        est = estimate_memory(cfg, tr.model, no_decay_ids(tr.model), 1, 1, "cpu")
        # The batch itself (images and token ids, ~1% here) is outside the estimate.
        assert 0.97 <= est.peak_device / measured <= 1.0, (extra, est.peak_device, measured)
        del tr  # its storages must not count in the next measurement
