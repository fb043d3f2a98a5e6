"""The banner's words."""

from __future__ import annotations

import torch

from m6.config import load
from m6.train.banner import delayed_update_words, device_label


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
