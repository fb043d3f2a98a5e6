"""The banner's words."""

from __future__ import annotations

import torch

from m6.config import load
from m6.train.banner import delayed_update_words, device_label, zero_layout_words


def test_device_label_counts_cpu_threads_in_words():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert device_label(torch.device("cpu")) == "cpu (1 thread)"
        torch.set_num_threads(2)
        assert device_label(torch.device("cpu")) == "cpu (2 threads)"
    finally:
        torch.set_num_threads(threads)


def test_the_memory_line_says_when_the_update_is_delayed():
    assert delayed_update_words(load(None, ["memory.offload=optimizer"])) == ""
    words = delayed_update_words(load(None, ["memory.offload=optimizer", "optim.delayed_update=true",
                                             "optim.delayed_update_after=10"]))
    assert words.startswith(", delayed update from step 11 (") and "one step stale" in words


def test_the_memory_line_says_which_zero_layout_runs():
    base = ["model.num_layers=4", "train.precision=bf16", "memory.offload=zero"]
    assert zero_layout_words(load(None, ["memory.offload=optimizer+params"])) == ""
    resident = zero_layout_words(load(None, [*base, "memory.offload_blocks=[]"]))
    assert resident.startswith(" (ZeRO-Offload's layout: bf16 weights on the device (routers' gates fp32), all 4 "
                               "blocks resident;")
    assert "bf16 gradients to fp32 host buffers" in resident
    streamed = zero_layout_words(load(None, [*base, "memory.offload_blocks=[0,1]", "memory.host_grad_dtype=compute"]))
    assert "2 of 4 blocks resident, 2 streamed in bf16 from the host" in streamed
    assert "bf16 gradients to bf16 host buffers (the streamed blocks' into their homes)" in streamed
    separate = zero_layout_words(load(None, [*base, "memory.offload_blocks=[0,1]", "memory.host_grad_dtype=compute",
                                             "memory.zero_grad_landing=separate"]))
    assert "bf16 gradients to bf16 host buffers, bf16 weights back" in separate
    assert "4 streamed in fp16" in zero_layout_words(load(None, [*base, "train.precision=fp16"]))
    # auto is resolved after the banner: no count (it once printed len("auto") = "4 streamed")
    auto = zero_layout_words(load(None, [*base, "model.num_layers=6", "memory.offload_blocks=auto"]))
    assert "the blocks that fit resident, the rest streamed in bf16 from the host (offload_blocks=auto)" in auto
    assert "of 6 blocks" not in auto
