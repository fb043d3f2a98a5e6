"""LiveBytes counts what a region allocates and still holds, storage resizes included (FSDP2
gathers parameters into resized storages, m6's parameter offload refills its device buffers so)."""

from __future__ import annotations

import gc

import torch

from m6.memory.live_bytes import LiveBytes


def test_op_allocations_count_until_freed() -> None:
    x = torch.ones(256)
    with LiveBytes() as live:
        y = x * 2  # 1 KiB made here
        z = y.view(16, 16)  # a view: no new storage
        assert live.live == 1024
        del y, z
        gc.collect()
        w = x.add_(1)  # in place: the input's storage
        assert w is x and live.live == 0
    assert live.peak == 1024


def test_storage_resizes_count_as_allocations_and_frees() -> None:
    buf = torch.empty(0)  # an emptied buffer from before the region, as FSDP2 leaves a resharded parameter
    with LiveBytes() as live:
        buf.untyped_storage().resize_(4096)
        assert live.live == 4096
        buf.untyped_storage().resize_(0)
        assert live.live == 0
        made = torch.zeros(512)  # 2 KiB by an op, then freed and refilled by resizes
        made.untyped_storage().resize_(0)
        assert live.live == 0
        made.untyped_storage().resize_(8192)
        assert live.live == 8192
        del made
        gc.collect()
        assert live.live == 0
    assert live.peak == 8192


def test_resizing_a_storage_that_held_bytes_before_the_region_is_not_counted() -> None:
    before = torch.zeros(1024)  # its bytes belong to what was live at the start
    original = torch.UntypedStorage.resize_
    with LiveBytes() as live:
        before.untyped_storage().resize_(8192)
        assert live.live == 0
    assert torch.UntypedStorage.resize_ is original  # the patch is gone after the region
    before.untyped_storage().resize_(0)
    assert live.live == 0


def test_nested_regions_each_count() -> None:
    buf = torch.empty(0)
    with LiveBytes() as outer:
        x = torch.ones(256)
        with LiveBytes() as inner:
            buf.untyped_storage().resize_(2048)
        assert (inner.peak, outer.peak) == (2048, 1024 + 2048)
    del x


def test_included_storages_freed_inside_the_region_stop_counting() -> None:
    """A tensor alive at the start and replaced inside the region (a step's last batch, a pipeline
    schedule's buffer) counts until it is freed: the peak is the true high-water mark, not the
    bytes at the start plus the region's allocations."""
    old = torch.zeros(1024)
    live = LiveBytes()
    live.include([old.untyped_storage()])
    assert (live.live, live.peak) == (4096, 4096)
    with live:
        del old
        new = torch.ones(1024)
    assert (live.live, live.peak) == (4096, 4096)
    del new
    assert live.live == 0
