"""Session-wide test setup.

``pytest --device cuda``: the device-aware tests run their model and math on that device. CPU
stays the default. The tests that honour the option take the ``device`` fixture: the MoE math
against its float64 reference (tests/unit/test_moe_layer.py), the model's mask rules
(test_model.py), cast-on-use (test_cast_on_use.py), offload (test_offload.py), the checkpoint
round trip (test_checkpoint.py), activation checkpointing (test_activation_checkpoint.py), fp16
(test_fp16.py), Adafactor (test_adafactor.py) and, CUDA only, sharded CPU offload (test_shard_offload.py).
bench/gpu_suite.py runs them this way on a GPU.

The host ops (DeepSpeed's cpu_adam, m6's C++ Adafactor; memory.host_optimizer) compile on first use
(~1-2 min on 2 cores) into the product's own build cache, outside the repository
(m6.memory.host_optimizer.default_extensions_dir: one folder per python, torch and deepspeed
version, unless TORCH_EXTENSIONS_DIR is set), as tests/simcuda's preload library does: a machine
pays each build once, not every fresh CI checkout (a cache inside the checkout cost a full run
~50 s of builds each time).

One thread per process: the tests run tiny models, whose GEMMs gain nothing from a second thread,
and on a 2-core machine that other work shares, two OpenMP threads of one process wait for each
other at every op (20 steps of tests/smoke/test_train.py's model: 41-47 s with 2 threads, 1.3-1.4 s
with 1, under a load average of 12). Unless OMP_NUM_THREADS is set already, the test process and
every process it starts (they inherit the environment) take one thread; a test about threads sets
its own count.

Triton on the CPU: Triton kernels run on CPU tensors only under its interpreter, which triton
chooses per @triton.jit function when the function is defined, triton.language's own helpers
(tl.cdiv, tl.sum, ...) included. So on ``--device cpu`` TRITON_INTERPRET=1 is set before any test
imports triton (unless set already); set later, an interpreted kernel would call a compiled
helper ("Cannot call @triton.jit'd outside of the scope of a kernel") whichever test imported
triton first.

py-cpuinfo asked once per process (m6/memory/cpu_info_once.py): DeepSpeed asks it at every op load and
every DeepSpeedCPUAdam, and each ask sleeps a second to time the clock.
"""

from __future__ import annotations

import os

import pytest
import torch

from m6.memory import cpu_info_once as cpuinfo_once


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda"],
                     help="device for the device-aware tests (default cpu)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--device") == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: this machine has no usable CUDA device")
    if config.getoption("--device") == "cpu" and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    cpuinfo_once.install()


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """The device chosen with --device."""
    return torch.device(pytestconfig.getoption("--device"))
