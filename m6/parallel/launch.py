"""Process-group start-up from the launcher's environment (torchrun, deepspeed, Slurm via torchrun)."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from m6.parallel.peer_check import register_host


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str


    @staticmethod
    def single_process() -> "DistEnv":
        """One process without torch.distributed: the trivial job."""
        return DistEnv(0, 1, 0, 1, "none")


def launched_distributed() -> bool:
    """True under torchrun / the deepspeed launcher (they export RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 ``address``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def _source_address(destination: str) -> str:
    """The local address the kernel's routing picks to reach ``destination`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((destination, 9))
        return s.getsockname()[0]


def gloo_interface(master_addr: str, world_size: int, local_world_size: int) -> str | None:
    """The interface gloo must bind to when its own choice would fail, else None.

    gloo binds to the address this host's name resolves to. Where that is a loopback address
    (Ubuntu's /etc/hosts maps the hostname to 127.0.1.1; containers often to 127.0.0.1), ranks on
    other nodes cannot reach it and the job fails at start-up ("Gloo connectFullMesh failed ...
    Connect timeout"). m6 always makes a gloo group (checkpoint coordination, resume agreement, the
    stop flag), also when training over NCCL, so a multi-node job picks the interface that routes
    to MASTER_ADDR (where that resolves to loopback here, this is node 0 itself: the default route's).
    """
    if world_size <= local_world_size or not _is_loopback(socket.gethostname()):
        return None
    try:
        master = socket.gethostbyname(master_addr)
        # MASTER_ADDR resolving to loopback here means this is node 0: any off-host address (TEST-NET-1,
        # reserved for documentation) then routes through the default route's interface.
        destination = master if not ipaddress.ip_address(master).is_loopback else "192.0.2.1"
        source = _source_address(destination)
    except OSError as e:
        raise RuntimeError(f"the hostname {socket.gethostname()!r} resolves to a loopback address, which other nodes "
                           f"cannot reach, and no route to MASTER_ADDR={master_addr} was found ({e}): set "
                           f"GLOO_SOCKET_IFNAME to the network interface the nodes share") from e
    interface = _interface_of(source)
    if interface is None:
        raise RuntimeError(f"the hostname {socket.gethostname()!r} resolves to a loopback address, which other nodes "
                           f"cannot reach, and no interface holds {source} (the route to MASTER_ADDR={master_addr}): "
                           f"set GLOO_SOCKET_IFNAME to the network interface the nodes share")
    return interface


def init_distributed(timeout_s: int) -> DistEnv:
    """Join the job's process group: NCCL when CUDA is present, gloo otherwise.

    ``timeout_s`` bounds how long a collective waits for a peer, so a dead rank makes the others
    fail with an error instead of hanging forever.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"distributed launch needs {', '.join(missing)} in the environment (use torchrun)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = gloo_interface(os.environ["MASTER_ADDR"], world, local_world)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface  # read by every gloo group this process makes
            if local_rank == 0:
                print(f"rank {rank}: gloo binds to {interface} (GLOO_SOCKET_IFNAME): the hostname "
                      f"{socket.gethostname()!r} resolves to a loopback address that other nodes cannot reach",
                      flush=True)
    if not dist.is_initialized():
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)
    register_host(rank)  # so that a survivor of this rank's death can name its host
    return DistEnv(rank, world, local_rank, local_world, backend)


def join_job(timeout_s: int) -> DistEnv:
    """The job this process belongs to: the launcher's process group when launched distributed
    (torchrun, deepspeed, Slurm via torchrun), else a single process."""
    return init_distributed(timeout_s) if launched_distributed() else DistEnv.single_process()
