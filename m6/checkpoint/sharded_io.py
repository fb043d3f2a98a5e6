"""Sharded checkpoint files on torch.distributed.checkpoint (DCP): every rank writes the tensors it
owns and reads only the rows it needs.

A state is a flat dict ``{key: tensor | python value}``. An *expert shard* is a tensor holding
rows [first, first + n) of a global tensor whose dim 0 is the global expert id; ``shards`` maps
its key to (global shape, first row). A tensor-parallel split holds one or more blocks of its
global tensor (the fused qkv: a block of each of q, k and v); ``shards`` then maps its key to
(global shape, [(global offsets, local offsets, sizes) per block]). Both are declared to DCP as
chunks of the global tensor, so a checkpoint written at one (world size, expert-parallel size,
tensor-parallel size) is read at any other: DCP intersects the chunks a rank asks for with those
on disk. Identical entries saved by several
ranks (replicated weights, the same experts on their expert-data-parallel replicas, rank-
independent python state) are written once, spread over the ranks (DCP's de-duplication).

Reading never unpickles code: python values are loaded with ``torch.load(weights_only=True)``
and the metadata file with an unpickler that accepts only DCP's metadata classes and torch's
dtype/layout/size types (DCP itself uses plain pickle for both).

The background writer thread runs on the saving thread's CUDA device (a new thread's current
device is 0: every rank of a node would otherwise create a CUDA context on GPU 0). Before the
coordinator completes a save it checks that every rank's data file is there as it sees the
directory: a run.dir local to each node would otherwise give a "complete" checkpoint whose other
ranks' shards sit on other nodes.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import socket
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
import torch.distributed as dist
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list

from m6.checkpoint.errors import CheckpointDamaged, RunDirNotShared, first_line
from m6.checkpoint.staging import StagingBuffer

METADATA_FILE = ".metadata"  # written by the coordinator once every rank has written: marks a complete save
Piece = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # global offsets, local offsets, sizes
# key -> (global shape, first row of this rank's shard | the pieces of the global tensor it holds)
Shards = dict[str, tuple[torch.Size, Union[int, list[Piece]]]]


def _chunk(t: torch.Tensor, first: int) -> ChunkStorageMetadata:
    offsets = torch.Size([first] + [0] * (t.dim() - 1))
    return ChunkStorageMetadata(offsets=offsets, sizes=t.size())


def _pieces(t: torch.Tensor, where: Union[int, list[Piece]]) -> list[tuple[ChunkStorageMetadata, torch.Tensor]]:
    """Each chunk of the global tensor that ``t`` holds, with the view of ``t`` that holds it."""
    if isinstance(where, int):
        return [(_chunk(t, where), t)]
    out = []
    for global_offsets, local_offsets, sizes in where:
        view = t
        for dim, (start, size) in enumerate(zip(local_offsets, sizes)):
            view = view.narrow(dim, start, size)
        out.append((ChunkStorageMetadata(offsets=torch.Size(global_offsets), sizes=torch.Size(sizes)), view))
    return out


def _piece_at(t: torch.Tensor, where: Union[int, list[Piece]], offsets) -> torch.Tensor:
    """The view of ``t`` holding the chunk that starts at the global ``offsets``."""
    return next(view for chunk, view in _pieces(t, where) if tuple(chunk.offsets) == tuple(offsets))


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, with expert shards written as chunks of their global tensors."""

    def __init__(self, shards: Shards) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [shard for item in plan.items
                 for shard in (self._shard_items(item) if item.index.fqn in self.shards else [item])]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _shard_items(self, item: WriteItem) -> list[WriteItem]:
        t = self.state_dict[item.index.fqn]
        global_shape, where = self.shards[item.index.fqn]
        return [WriteItem(index=MetadataIndex(item.index.fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(t),
                                                      size=torch.Size(global_shape)))
                for chunk, _ in _pieces(t, where)]

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.shards:
            t = self.state_dict[index.fqn]
            where = self.shards[index.fqn][1]
            return t if isinstance(where, int) else _piece_at(t, where, index.offset).contiguous()
        return super().lookup_object(index)


class _StreamingSavePlanner(_SavePlanner):
    """Writes a state whose tensors on ``meta`` are placeholders: each one's values come from
    ``produce(key)`` when the writer reaches it, so one tensor at a time is in memory."""

    def __init__(self, shards: Shards, produce) -> None:
        super().__init__(shards)
        self.produce = produce

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if torch.is_tensor(obj) and obj.is_meta:
            value = self.produce(index.fqn)
            assert value.shape == obj.shape and value.dtype == obj.dtype, (index.fqn, value.shape, obj.shape)
            return value
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner reading this rank's rows of expert shards, python values with weights_only."""

    def __init__(self, shards: Shards) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        for key, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[key]  # callers ask only for keys on disk
            if key in self.shards:
                requests += create_read_items_for_chunk_list(key, md, [c for c, _ in _pieces(obj, self.shards[key][1])])
            else:
                requests += _create_read_items(key, md, obj)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.shards:
            t, where = self.state_dict[index.fqn], self.shards[index.fqn][1]
            return t if isinstance(where, int) else _piece_at(t, where, index.offset)  # a view: loads in place
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=True)
        except Exception as e:
            error = CheckpointDamaged(f"the value {key} cannot be read as plain data ({_weights_only_reason(e)}); "
                                      f"refused, nothing in it was run")
            error.file = self.metadata.storage_data[read_item.storage_index].relative_path  # the reader names it
            raise error from e


def _weights_only_reason(e: Exception) -> str:
    """The line of torch.load(weights_only=True)'s long refusal that says what it refused."""
    for line in str(e).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip().split(". ")[0]
        if "GLOBAL" in line:
            return line.strip().rstrip(".")
    return first_line(e)


_METADATA_TORCH_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class ForbiddenPickle(pickle.UnpicklingError):
    """Metadata whose pickle asks for something other than DCP's metadata types (refused unrun)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes, builtin containers and torch's dtype/layout/Size types."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in (
                ("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                ("builtins", "slice"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _METADATA_TORCH_TYPES):
            return super().find_class(module, name)
        raise ForbiddenPickle(f"{module}.{name}")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / METADATA_FILE, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        return metadata


def read_metadata(path: str | Path) -> Metadata:
    """The checkpoint's index: every key, its global shape/dtype (tensors) or that it is a value."""
    return _SafeReader(str(path)).read_metadata()


def tensor_keys(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def value_keys(metadata: Metadata) -> set[str]:
    return {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}


@contextmanager
def _quiet_single_process(no_dist: bool):
    """DCP warns that it assumes one process when torch.distributed is not initialised: that is
    exactly what ``no_dist`` asks for."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _group_rank(group) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def _gather(obj: Any, group) -> Optional[list]:
    """``obj`` of every rank on the group's first rank (None elsewhere); identity with no group."""
    rank, size = _group_rank(group)
    if size == 1:
        return [obj]
    out = [None] * size if rank == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
    return out


def _scatter(objs: Optional[list], group) -> Any:
    """Rank i of the group receives ``objs[i]`` from the group's first rank."""
    rank, size = _group_rank(group)
    if size == 1:
        return objs[0]
    out = [None]
    dist.scatter_object_list(out, objs if rank == 0 else None, src=dist.get_global_rank(group, 0), group=group)
    return out[0]


class ShardedWrite:
    """One save: planned together (collectives), written by each rank on its own (plain file I/O,
    on a background thread if asked), committed together (collectives: the coordinator checks that
    every rank's files are there, then writes the metadata).

    Every collective runs on the thread that calls ``__init__`` / ``all_written`` / ``commit``:
    a background thread does file I/O only. (Collectives issued from a second thread made the
    processes abort at exit in testing.) This is DCP's own save pipeline (planner, storage
    writer, plan exchange, finish), with the exchange done here.
    """

    def __init__(self, path: str | Path, state: dict[str, Any], shards: Shards, group, background: bool,
                 planner: Optional[_SavePlanner] = None) -> None:
        self.group = group
        rank, _ = _group_rank(group)
        self.is_coordinator = rank == 0
        # The saving thread's device, for the writer thread (DCP's writer calls CUDA stream APIs
        # whenever CUDA is available); None when this process does not use CUDA.
        self.device: Optional[int] = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        on_device = any(torch.is_tensor(v) and v.device.type != "cpu" for v in state.values())
        # Host tensors (a staged state): nothing to copy ahead from a device, so DCP's serial
        # loader, which touches no CUDA stream.
        self.writer = FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True,
                                       per_thread_copy_ahead=10_000_000 if on_device else 0)
        self.planner = planner if planner is not None else _SavePlanner(shards)
        self.planner.set_up_planner(state_dict=state, storage_meta=self.writer.storage_meta(),
                                    is_coordinator=self.is_coordinator)
        self.writer.set_up_storage_writer(self.is_coordinator, rank=rank, use_collectives=True)
        local = self.writer.prepare_local_plan(self.planner.create_local_plan())
        plans = _gather(local, group)
        self.metadata: Optional[Metadata] = None
        if self.is_coordinator:
            plans, self.metadata = self.planner.create_global_plan(plans)
            plans = self.writer.prepare_global_plan(plans)
        self.plan = self.planner.finish_plan(_scatter(plans, group))
        self.results: Optional[list] = None
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        if background:
            self.thread = threading.Thread(target=self._write, name="m6-checkpoint-writer", daemon=True)
            self.thread.start()
        else:
            self._write()

    def _write(self) -> None:
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)  # this thread's CUDA calls: the rank's own device
            future = self.writer.write_data(self.plan, self.planner)
            future.wait()
            self.results = future.value()
        except BaseException as e:  # reported by commit() on the training thread
            self.error = e

    def written(self) -> bool:
        """This rank's files are written (or failed)."""
        return self.thread is None or not self.thread.is_alive()

    def all_written(self, device: torch.device | None = None) -> bool:
        """Every rank's files are written: a collective (one small all-reduce over the group)."""
        mine = 1.0 if self.written() else 0.0
        if self.group is None:
            return bool(mine)
        flag = torch.tensor([mine])  # the checkpoint group is gloo: host tensors
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def commit(self) -> None:
        """Wait for this rank's files, then (a collective) the coordinator checks that it sees every
        rank's files and writes the metadata that makes the checkpoint complete. Raises on every
        rank if any rank's write failed (RunDirNotShared if a rank's file is not there)."""
        if self.thread is not None:
            self.thread.join()
        failures = _gather(None if self.error is None else f"{type(self.error).__name__}: {self.error}", self.group)
        results = _gather((socket.gethostname(), self.results), self.group)
        failed = None
        if self.is_coordinator:
            bad = [f"rank {r}: {msg}" for r, msg in enumerate(failures) if msg is not None]
            failed = ("write", "; ".join(bad)) if bad else None
            if failed is None:
                unseen = _unseen_files(Path(str(self.writer.path)), results)
                if unseen:
                    failed = ("unshared", unseen)
                else:
                    self.writer.finish(metadata=self.metadata, results=[r for _, r in results])
        rank, size = _group_rank(self.group)
        if size > 1:
            box = [failed]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            failed = box[0]
        if failed is not None:
            kind, message = failed
            raise (RunDirNotShared if kind == "unshared" else RuntimeError)(
                message if kind == "unshared" else f"writing the checkpoint failed: {message}")


# A file another node has just closed can take a moment to appear on a network filesystem.
_VISIBLE_WITHIN_S = 3.0


def _unseen_files(directory: Path, results: list[tuple[str, list]]) -> Optional[str]:
    """None when every rank's data file is in ``directory`` (as this process sees it) with the bytes
    its write reported; else what is missing, naming the rank, its host and the file."""
    needed: dict[str, tuple[int, int, str]] = {}  # file -> (bytes needed, rank, host)
    for rank, (host, written) in enumerate(results):
        for result in written or []:
            info = result.storage_data
            end = info.offset + info.length
            if end > needed.get(info.relative_path, (0,))[0]:
                needed[info.relative_path] = (end, rank, host)
    deadline = time.monotonic() + _VISIBLE_WITHIN_S
    while True:
        short = []
        for name, (end, rank, host) in sorted(needed.items()):
            try:
                size = os.stat(directory / name).st_size
            except FileNotFoundError:
                size = None
            if size is None or size < end:
                short.append((name, rank, host, size, end))
        if not short or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if not short:
        return None
    name, rank, host, size, end = short[0]
    seen = "does not see it there" if size is None else f"sees only {size:,} of its {end:,} bytes there"
    more = f" ({len(short)} of the {len(needed)} data files likewise)" if len(short) > 1 else ""
    return (f"rank {rank} (host {host}) wrote {name} into {directory}, but rank 0 (host {socket.gethostname()}) "
            f"{seen}{more}")


def write(path: str | Path, state: dict[str, Any], shards: Shards, group=None,
          staging: Optional[StagingBuffer] = None) -> ShardedWrite:
    """Start writing ``state`` (this rank's part) into the directory ``path``; a collective over
    ``group`` (None with one process). ``staging`` None: the files are written on return,
    ``commit()`` still makes them a checkpoint. With a staging buffer (an asynchronous save):
    returns once the state is copied into it; the files are written behind training."""
    if staging is None:
        return ShardedWrite(path, state, shards, group, background=False)
    return ShardedWrite(path, staging.stage(state), shards, group, background=True)


def write_streamed(path: str | Path, state: dict[str, Any], produce) -> None:
    """Write ``state`` as a complete checkpoint from one process, its ``meta`` tensors produced one
    at a time by ``produce(key)`` (a CPU tensor of that shape and dtype) as the writer reaches them:
    a checkpoint larger than memory (an imported model) is written holding one tensor."""
    ShardedWrite(path, state, {}, None, background=False, planner=_StreamingSavePlanner({}, produce)).commit()


def read(path: str | Path, targets: dict[str, Any], shards: Shards, group=None) -> dict[str, Any]:
    """Fill ``targets`` from the checkpoint in ``path``: tensors in place (this rank's rows of expert
    shards), python values replaced; returns ``targets``. Every key must be in the checkpoint."""
    with _quiet_single_process(group is None):
        dcp_load(targets, storage_reader=_SafeReader(str(path)), planner=_LoadPlanner(shards), process_group=group,
                 no_dist=group is None)
    return targets
