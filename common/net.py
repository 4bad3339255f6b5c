"""Sockets that both sides use: a torch rendezvous store that listens only on the address it is given, and
the check of a configured bind address (``transferqueue.host``, ``checkpointengine.host``).

``torch.distributed.TCPStore(host, port, is_master=True)`` listens on every interface whatever ``host``
says (``host`` only tells clients where to connect). Here the master's listening socket is bound to
``host`` first and handed to the store (``master_listen_fd``), so a store on ``127.0.0.1`` is reachable
from this machine only, and one on a configured address from that address only.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def tcp_store(host: str, port: int, world_size: int | None, is_master: bool, timeout_s: float,
              wait_for_workers: bool = True) -> dist.TCPStore:
    """A ``TCPStore`` on ``host:port``; the master (``port`` 0 = a free port, read back from ``.port``)
    listens on ``host`` only. ``timeout_s`` bounds every wait on the store. Raises OSError when ``host``
    cannot be bound (an address not on this machine) or ``port`` is taken, and the store's own errors
    (``DistNetworkError``, a RuntimeError) when a client cannot reach the master in ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
        bound_port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # The store owns the descriptor from here on (it closes it when the store is destroyed).
    return dist.TCPStore(host, bound_port, world_size, True, timeout=timeout,
                         wait_for_workers=wait_for_workers, master_listen_fd=sock.detach())


def check_bind_host(key: str, host: str) -> None:
    """Raise ValueError naming ``key`` unless ``host`` is a non-empty host name or IPv4 address (no scheme,
    port, path or spaces): what a config's bind address (``tcp://HOST:<port>``) may be."""
    if not isinstance(host, str) or not host or any(c in host for c in "/ :"):
        raise ValueError(f"{key} must be a host name or IPv4 address (e.g. 127.0.0.1 or 10.0.0.5), got {host!r}")
