"""A one-process "mirror world" for torch.distributed: rank 0 of a world of N, where every other rank
is taken to hold exactly rank 0's data (so every collective has a result one process can compute).

The process group is torch's fake backend; every collective m6 calls is intercepted, checked
against the rules of the backend the code asked for, and emulated:
- NCCL (the default group when CUDA is present, the device-mesh groups, new_group without a
  backend): tensors must be on the device (a host tensor is an NCCL_HOST problem), contiguous, of a
  dtype NCCL reduces; an NCCL collective issued from a thread other than the one that trains can
  interleave with the training's own collectives (NCCL_THREAD).
- gloo (new_group(backend="gloo")): host tensors only (a device tensor is GLOO_DEVICE: a hidden
  device-to-host round trip).
A collective this module does not emulate raises, so nothing passes by doing nothing.
"""

from __future__ import annotations

import collections
import os
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.checkpoint import default_planner

from sim_tensor import RECORD, on_device

NCCL_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
               torch.uint8, torch.int8, torch.bool}
_intended: dict[int, str] = {}  # id(group) -> the backend the code asked for
calls: collections.Counter = collections.Counter()  # (thread, backend, op) -> n


def _backend(group) -> str:
    g = group if group is not None else c10d._get_default_group()
    default = _intended.get(id(c10d._get_default_group()), "nccl")
    return _intended.get(id(g), default)  # mesh groups take the default group's backend


def _check(op: str, group, tensors) -> None:
    backend = _backend(group)
    thread = threading.current_thread()
    calls[(thread.name, backend, op)] += 1
    # Autograd's device threads (created in C++: "Dummy-N" to Python) issue backward's collectives
    # for the training thread, as DDP's do; a thread the code started itself is another matter.
    if backend == "nccl" and thread is not threading.main_thread() and not isinstance(thread, threading._DummyThread):
        RECORD.problem("NCCL_THREAD", f"{op} on an NCCL group from thread {thread.name!r}")
    for t in tensors:
        if backend == "nccl":
            if not on_device(t):
                RECORD.problem("NCCL_HOST", f"{op}: host tensor {tuple(t.shape)} {t.dtype} on an NCCL group")
            if not t.is_contiguous():
                RECORD.problem("NCCL_LAYOUT", f"{op}: non-contiguous tensor {tuple(t.shape)} on an NCCL group")
            if t.dtype not in NCCL_DTYPES:
                RECORD.problem("NCCL_DTYPE", f"{op}: dtype {t.dtype} is not reduced by NCCL")
        elif on_device(t):
            RECORD.problem("GLOO_DEVICE", f"{op}: device tensor {tuple(t.shape)} {t.dtype} on the gloo group")


class _Done:
    """The handle of a collective that has completed (all of them do, at once)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _result(async_op: bool):
    return _Done() if async_op else None


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    _check("all_reduce", group, [tensor])
    if op == dist.ReduceOp.SUM and tensor.dtype != torch.bool:
        with torch.no_grad():
            tensor.mul_(dist.get_world_size(group))  # N equal addends; MAX, MIN and AVG leave it as is
    elif op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.AVG):
        raise NotImplementedError(f"mirror world: all_reduce with {op}")
    return _result(async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    """Rank 0 receives from every rank what that rank sends to rank 0, which in a mirror world is rank
    0's own first chunk. Where the sizes rank 0 expects differ from it (the return trip of an uneven
    exchange: rank 1 "received" what rank 0 did, not what rank 0 sent it), the rows that exist are
    copied and the rest zeroed: shapes, dtypes and devices are exact, values are not."""
    _check("all_to_all_single", group, [output, input])
    world = dist.get_world_size(group)
    if output_split_sizes is None and input_split_sizes is None:
        output_split_sizes = input_split_sizes = [input.shape[0] // world] * world
    sent = input[:input_split_sizes[0]]
    with torch.no_grad():
        start = 0
        for rows in output_split_sizes:
            n = min(rows, sent.shape[0])
            output[start:start + n].copy_(sent[:n])
            output[start + n:start + rows].zero_()
            start += rows
    return _result(async_op)


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Rank 0 receives the sum over the ranks of their first slices: N equal addends of its own."""
    _check("reduce_scatter_tensor", group, [output, input])
    if op != dist.ReduceOp.SUM:
        raise NotImplementedError(f"mirror world: reduce_scatter_tensor with {op}")
    with torch.no_grad():
        output.copy_(input.view(-1)[:output.numel()].view_as(output)).mul_(dist.get_world_size(group))
    return _result(async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Every rank's slice is rank 0's (the input may be rank 0's slice of the output: in place)."""
    _check("all_gather_into_tensor", group, [output_tensor, input_tensor])
    world = dist.get_world_size(group)
    with torch.no_grad():
        mine = input_tensor.reshape(-1).clone()
        output_tensor.view(world, -1).copy_(mine.expand(world, -1))
    return _result(async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    _check("broadcast", group, [tensor])
    return _result(async_op)


def barrier(group=None, async_op=False, device_ids=None):
    _check("barrier", group, [])
    return _result(async_op)


def all_gather_object(object_list, obj, group=None):
    _check("all_gather_object", group, [])
    for i in range(len(object_list)):
        object_list[i] = obj


def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    _check("gather_object", group, [])
    if object_gather_list is not None:
        for i in range(len(object_gather_list)):
            object_gather_list[i] = obj


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None, group=None,
                        group_src=None):
    _check("scatter_object_list", group, [])
    scatter_object_output_list[0] = scatter_object_input_list[0]


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    _check("broadcast_object_list", group, [])


def _not_emulated(name):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"mirror world: torch.distributed.{name} is not emulated; add it to "
                                  "tests/simcuda/mirror_world.py")
    return refuse


_EMULATED = dict(all_reduce=all_reduce, all_to_all_single=all_to_all_single, broadcast=broadcast, barrier=barrier,
                 reduce_scatter_tensor=reduce_scatter_tensor, all_gather_into_tensor=all_gather_into_tensor,
                 all_gather_object=all_gather_object, gather_object=gather_object,
                 scatter_object_list=scatter_object_list, broadcast_object_list=broadcast_object_list)
_REFUSED = ("all_gather", "reduce_scatter", "reduce", "gather",
            "scatter", "all_to_all", "send", "recv", "isend", "irecv", "monitored_barrier", "batch_isend_irecv")


_patched: list[bool] = []


def _patch() -> None:
    real_init, real_new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           group_name="", pg_options=None, device_id=None):
        world = int(os.environ["WORLD_SIZE"])
        real_init("fake", store=dist.HashStore(), rank=0, world_size=world, timeout=timeout)
        _intended[id(c10d._get_default_group())] = backend or "nccl"
        # m6's peer watch beats through the store and watches the next rank's beat. The other ranks
        # of a mirror world do not exist and never beat: they are marked as finished, the watch's
        # own word for a rank whose silence is no failure, so its thread and store calls run as in
        # a real job without ending this process after its silence limit.
        from m6.parallel import peer_check
        for r in range(1, world):
            peer_check._store().set(peer_check._DONE_KEY.format(r), "1")

    def new_group(*args, backend=None, **kwargs):
        group = real_new_group(*args, backend="fake", **kwargs)
        _intended[id(group)] = backend or _backend(None)
        return group

    dist.init_process_group, dist.new_group, c10d.new_group = init_process_group, new_group, new_group
    for name, fn in _EMULATED.items():
        setattr(dist, name, fn)
        setattr(c10d, name, fn)
    for name in _REFUSED:
        setattr(dist, name, _not_emulated(name))
        setattr(c10d, name, _not_emulated(name))
    # DCP checks that the ranks' save plans cover every global tensor; in a mirror world every
    # rank's plan is rank 0's (its expert rows only), so that check cannot pass and is skipped.
    # The checkpoint written is then not a complete one: it is never read back here.
    default_planner._validate_global_plan = lambda global_plan, metadata: []
    _patched.append(True)


def install(world_size: int) -> None:
    """Make this process rank 0 of ``world_size`` for code that joins the job through the launcher's
    environment (RANK, WORLD_SIZE, ...) and torch.distributed."""
    if not _patched:
        _patch()
    os.environ.update(RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


def leave() -> None:
    """End the world (the next ``install`` may start one of another size)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _intended.clear()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
