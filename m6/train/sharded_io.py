"""Sharded checkpoint files on torch.distributed.checkpoint (DCP): every rank writes the tensors it
owns and reads only the rows it needs.

A state is a flat dict ``{key: tensor | python value}``. An *expert shard* is a tensor holding
rows [first, first + n) of a global tensor whose dim 0 is the global expert id; ``shards`` maps
its key to (global shape, first row). Expert shards are declared to DCP as chunks of the global
tensor, so a checkpoint written at one (world size, expert-parallel size) is read at any other:
DCP intersects the chunks a rank asks for with those on disk. Identical entries saved by several
ranks (replicated weights, the same experts on their expert-data-parallel replicas, rank-
independent python state) are written once, spread over the ranks (DCP's de-duplication).

Reading never unpickles code: python values are loaded with ``torch.load(weights_only=True)``
and the metadata file with an unpickler that accepts only DCP's metadata classes and torch's
dtype/layout/size types (DCP itself uses plain pickle for both).
"""

from __future__ import annotations

import dataclasses
import io
import copy
import pickle
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list

METADATA_FILE = ".metadata"  # written by the coordinator once every rank has written: marks a complete save
Shards = dict[str, tuple[torch.Size, int]]  # key -> (global shape, first row of this rank's shard)


def _chunk(t: torch.Tensor, first: int) -> ChunkStorageMetadata:
    offsets = torch.Size([first] + [0] * (t.dim() - 1))
    return ChunkStorageMetadata(offsets=offsets, sizes=t.size())


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, with expert shards written as chunks of their global tensors."""

    def __init__(self, shards: Shards) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [self._shard_item(item) if item.index.fqn in self.shards else item for item in plan.items]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _shard_item(self, item: WriteItem) -> WriteItem:
        t = self.state_dict[item.index.fqn]
        global_shape, first = self.shards[item.index.fqn]
        chunk = _chunk(t, first)
        return WriteItem(index=MetadataIndex(item.index.fqn, chunk.offsets), type=WriteItemType.SHARD,
                         tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(t),
                                                     size=torch.Size(global_shape)))

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.shards:
            return self.state_dict[index.fqn]
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
                requests += create_read_items_for_chunk_list(key, md, [_chunk(obj, self.shards[key][1])])
            else:
                requests += _create_read_items(key, md, obj)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.shards:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


_METADATA_TORCH_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes, builtin containers and torch's dtype/layout/Size types."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in (
                ("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                ("builtins", "slice"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _METADATA_TORCH_TYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


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


class BackgroundWrite:
    """A DCP save running on a thread of its own, over a staged (host) copy of the state.

    The thread is ours, so it is joined before the next save and before the process tears its
    process groups down (a save thread still alive at exit aborted the process in testing).
    """

    def __init__(self, target, *args) -> None:
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(target, *args), name="m6-checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def _run(self, target, *args) -> None:
        try:
            target(*args)
        except BaseException as e:  # re-raised by result() on the training thread
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> None:
        """Wait for the write; re-raise what it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A host-memory copy of ``state`` that training may not change under a background write:
    tensors copied (device -> pinned host memory, one synchronisation), python values deep-copied."""
    staged, cuda = {}, False
    for key, value in state.items():
        if torch.is_tensor(value):
            pin = value.is_cuda
            out = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
            out.copy_(value.detach(), non_blocking=pin)
            cuda |= pin
            staged[key] = out
        else:
            staged[key] = copy.deepcopy(value)
    if cuda:
        torch.cuda.synchronize()
    return staged


def _save(path: str, state: dict[str, Any], shards: Shards, group) -> None:
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True)
    with _quiet_single_process(group is None):
        dcp_save(state, storage_writer=writer, planner=_SavePlanner(shards), process_group=group,
                 no_dist=group is None)


def write(path: str | Path, state: dict[str, Any], shards: Shards, group=None,
          asynchronous: bool = False) -> Optional[BackgroundWrite]:
    """Write ``state`` (this rank's part) into the directory ``path``; a collective over ``group``
    (None with one process). Asynchronous: returns once the state is staged in host memory, with
    the write running on a thread (its collectives on ``group`` only: never the training group's);
    the handle completes when the files are written (on the coordinator: with the metadata)."""
    if asynchronous:
        return BackgroundWrite(_save, str(path), stage(state), shards, group)
    _save(str(path), state, shards, group)
    return None


def read(path: str | Path, targets: dict[str, Any], shards: Shards, group=None) -> dict[str, Any]:
    """Fill ``targets`` from the checkpoint in ``path``: tensors in place (this rank's rows of expert
    shards), python values replaced; returns ``targets``. Every key must be in the checkpoint."""
    with _quiet_single_process(group is None):
        dcp_load(targets, storage_reader=_SafeReader(str(path)), planner=_LoadPlanner(shards), process_group=group,
                 no_dist=group is None)
    return targets
