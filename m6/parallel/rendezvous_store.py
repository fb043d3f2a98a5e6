"""A rendezvous store that outlives the torchrun agents of a multi-node job.

With ``--rdzv_backend c10d`` one torchrun agent hosts the job's TCP store. When that agent's
workers finish first, it can exit while another agent still talks to the store (its last state
sync), which then fails with ``RendezvousConnectionError ... Failed to recv`` and a non-zero exit
for a job that trained to the end. Hosting the store in its own process, started before the agents
and stopped after them, removes the race:

    python -m m6.parallel.rendezvous_store --port 29400 &      # on the node named in the endpoint
    torchrun --nnodes 2 ... --rdzv_backend c10d --rdzv_endpoint HOST:29400 \\
             --rdzv_conf is_host=false train.py ...             # on every node
    kill %1                                                     # after every agent has exited
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta

from torch.distributed import TCPStore


def serve(host: str, port: int, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Host a TCP store on ``host:port`` until ``stop`` is set (or SIGTERM / SIGINT in the main thread)."""
    store = TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                     timeout=timedelta(seconds=60))
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    print(f"m6 rendezvous store listening on {host}:{store.port}", flush=True)
    if ready is not None:
        ready.set()
    stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, required=True, help="the port of torchrun's --rdzv_endpoint")
    args = parser.parse_args(argv)
    try:
        serve(args.host, args.port)
    except RuntimeError as e:  # the port is taken, the address is not this machine's
        print(f"error: cannot host the rendezvous store on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
