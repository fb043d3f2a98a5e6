"""A multi-node test bed on one machine: N "nodes" as Linux network namespaces on one switch (a
bridge in a namespace of its own), each with its own network interface and address, the link out
of each node optionally rate-limited with a tc token bucket (tbf; netem is not available on these
kernels). The ranks of a node run inside its namespace, so traffic between nodes crosses the
veth links and traffic inside a node stays on its loopback, as on a cluster.

    with NetBed(nodes=2, rate_gbit=2.0) as bed:
        bed.popen(0, [sys.executable, "worker.py"], env={...})   # runs inside node 0
        bed.address(0)                                          # node 0's address (MASTER_ADDR)

Names carry this process's pid (``m6nb-<pid>-...``). Everything made is removed on exit, on an
exception, on SIGTERM/SIGINT, and, for a process killed outright, by the next bed's start-up
sweep (``python -m bench.netbed --sweep`` does it by hand). Needs root and the ``ip`` and ``tc``
commands; ``NetBed.unavailable()`` says why not where they are missing.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import signal
import subprocess
from typing import Optional

PREFIX = "m6nb"
INTERFACE = "nb0"  # each node's interface (names are per namespace, so every node has the same)
_NAME = re.compile(rf"^{PREFIX}-(\d+)-")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep(all_pids: bool = False) -> list[str]:
    """Remove the namespaces of beds whose process is gone (``all_pids``: every bed's); returns them."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if not match:
            continue
        pid = int(match.group(1))
        if all_pids or not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class NetBed:
    """``nodes`` namespaces on one bridge, addresses 10.213.<k>.<node + 1>/24."""

    def __init__(self, nodes: int, rate_gbit: Optional[float] = None) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.nodes, self.rate_gbit = nodes, rate_gbit
        self.tag = f"{PREFIX}-{os.getpid()}-{id(self) % 10_000}"
        self.subnet = f"10.213.{os.getpid() % 250 + 1}"
        self.made: list[str] = []
        self._previous_handlers: dict[int, object] = {}

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why no bed can be made here (a test's skip reason), or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"the {tool!r} command is missing (iproute2)"
        probe = f"{PREFIX}-{os.getpid()}-probe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def namespace(self, node: int) -> str:
        return f"{self.tag}-n{node}"

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def __enter__(self) -> NetBed:
        sweep()
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame) -> None:
        previous = self._previous_handlers.get(signum)
        self.close()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    def _build(self) -> None:
        switch = f"{self.tag}-sw"
        _ip("netns", "add", switch)
        self.made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for node in range(self.nodes):
            ns = self.namespace(node)
            _ip("netns", "add", ns)
            self.made.append(ns)
            port = f"p{node}"
            _ip("link", "add", port, "netns", switch, "type", "veth", "peer", "name", INTERFACE, "netns", ns)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", INTERFACE)
            _ip("-n", ns, "link", "set", INTERFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate_gbit:
                # The node's outgoing link: a token bucket at the rate (burst ~ 1 ms of it).
                burst = max(64 * 1024, int(self.rate_gbit * 1e9 / 8 / 1000))
                subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", INTERFACE, "root", "tbf", "rate",
                                f"{self.rate_gbit}gbit", "burst", str(burst), "latency", "50ms"],
                               check=True, capture_output=True, text=True)

    def popen(self, node: int, argv: list[str], env: Optional[dict] = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *argv], env=env, **kwargs)

    def close(self) -> None:
        """Remove every namespace this bed made (their veths go with them); idempotent."""
        while self.made:
            _ip("netns", "del", self.made.pop(), check=False)
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()
        atexit.unregister(self.close)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="remove every test bed's namespaces left behind")
    args = parser.parse_args(argv)
    if args.sweep:
        removed = sweep(all_pids=True)
        print(f"removed {len(removed)} namespace(s)" + (": " + ", ".join(removed) if removed else ""))


if __name__ == "__main__":
    main()
