"""Parallel layout arithmetic and validation (no processes needed)."""

import pytest

from m6.parallel import LayoutError, build_layout
from m6.parallel.layout import resolve_expert_parallel_size


def test_auto_is_largest_common_divisor():
    assert resolve_expert_parallel_size("auto", 8, 64) == 8
    assert resolve_expert_parallel_size("auto", 8, 12) == 4
    assert resolve_expert_parallel_size("auto", 6, 4) == 2
    assert resolve_expert_parallel_size("auto", 1, 7) == 1


def test_groups_and_coordinates():
    layout = build_layout(8, 5, 4, 16, local_world_size=4)
    assert layout.ep_group_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.edp_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (layout.ep_rank, layout.experts_per_rank, layout.first_local_expert) == (1, 4, 4)
    assert layout.expert_data_parallel_size == 2 and layout.node == 1


@pytest.mark.parametrize("world, ep, experts, key", [
    (4, 3, 12, "number of processes"), (4, 4, 6, "model.moe.num_experts"), (4, 0, 4, "expert_parallel_size"),
])
def test_invalid_layouts_name_the_keys(world, ep, experts, key):
    with pytest.raises(LayoutError, match="parallel.expert_parallel_size") as err:
        build_layout(world, 0, ep, experts, local_world_size=world)
    assert key in str(err.value)


def test_gloo_interface_only_for_multi_node_jobs_on_a_loopback_hostname():
    import ipaddress
    import socket

    from m6.parallel.launch import _interface_of, _source_address, gloo_interface

    assert gloo_interface("127.0.0.1", world_size=4, local_world_size=4) is None  # one node: loopback is right
    loopback_name = ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback
    try:
        routed = _source_address("192.0.2.1")  # an address outside loopback: the default route's source
    except OSError:
        pytest.skip("no route off this host")
    expected = _interface_of(routed) if loopback_name else None
    assert gloo_interface(routed, world_size=4, local_world_size=2) == expected
    # On node 0 MASTER_ADDR often resolves to loopback too (its own /etc/hosts): the default route's interface.
    assert gloo_interface("localhost", world_size=4, local_world_size=2) == expected
    if loopback_name:
        assert expected is not None and expected != "lo"
