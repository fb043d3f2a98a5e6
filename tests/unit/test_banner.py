"""The banner's words."""

from __future__ import annotations

import torch

from m6.train.banner import device_label


def test_device_label_counts_cpu_threads_in_words():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert device_label(torch.device("cpu")) == "cpu (1 thread)"
        torch.set_num_threads(2)
        assert device_label(torch.device("cpu")) == "cpu (2 threads)"
    finally:
        torch.set_num_threads(threads)
