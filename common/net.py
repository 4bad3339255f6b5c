"""Sockets that both sides use: a torch rendezvous store that listens only on the address it is given, and
the configured bind addresses (``transferqueue.host``, ``checkpointengine.host``, ``trainer.host``): checked
at config time (``check_bind_host``) and resolved by the process that opens the socket (``resolve_bind_host``).

A bind address is one IPv4 address (loopback ``127.0.0.1`` by default) or ``node``: the Ray node address
of the process that binds (``common.node.node_ip_address``), for clusters where no fixed address can name
the right machine (on KubeRay, whichever pod becomes trainer rank 0 or runs the driver). Peers never
resolve ``node`` themselves: they connect to the address the binding process reports (a handle's
``tcp://ADDRESS:PORT``, a rendezvous ``(address, port)``).

``torch.distributed.TCPStore(host, port, is_master=True)`` listens on every interface whatever ``host``
says (``host`` only tells clients where to connect). Here the master's listening socket is bound to
``host`` first and handed to the store (``master_listen_fd``), so a store on ``127.0.0.1`` is reachable
from this machine only, and one on a configured address from that address only.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import socket
from collections.abc import Iterator

import psutil
import torch.distributed as dist

from common.node import node_ip_address

NODE_HOST = "node"
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"

logger = logging.getLogger(__name__)


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
    """Raise ValueError naming ``key`` unless ``host`` is ``node`` or one IPv4 address (no host name, scheme,
    port or wildcard): what a config's bind address (``tcp://HOST:<port>``) may be. ``0.0.0.0`` is refused:
    peers connect to the address the binding process reports, and a wildcard names no reachable one."""
    if host == NODE_HOST:
        return
    what = (f"{key} must be one IPv4 address of the machine that binds it (127.0.0.1, the default, or e.g. "
            f"10.0.0.5) or {NODE_HOST!r} (the Ray node address of the process that opens the socket)")
    try:
        if not isinstance(host, str):
            raise TypeError(host)
        address = ipaddress.IPv4Address(host)
    except (ipaddress.AddressValueError, TypeError):
        raise ValueError(f"{what}, got {host!r}") from None
    if address.is_unspecified or address.is_multicast or address == ipaddress.IPv4Address("255.255.255.255"):
        raise ValueError(f"{what}, got {host!r}: a wildcard, multicast or broadcast address names no peer "
                         "can connect to") from None


def resolve_bind_host(key: str, host: str) -> str:
    """The address this process binds for ``key``'s ``host`` (already checked by ``check_bind_host``):
    ``host`` itself, or for ``node`` this process's Ray node address. Raises RuntimeError naming ``key``
    for ``node`` outside a Ray cluster, ValueError when the Ray node address is not IPv4 (the sockets take
    ``tcp://IPv4:port``; set ``key`` to an address then)."""
    if host != NODE_HOST:
        return host
    try:
        address = node_ip_address()
    except RuntimeError as exc:
        raise RuntimeError(f"{key}={NODE_HOST!r} binds the Ray node address of the process that opens the "
                           f"socket, but {exc}") from None
    try:
        ipaddress.IPv4Address(address)
    except ipaddress.AddressValueError:
        raise ValueError(f"{key}={NODE_HOST!r}: this process's Ray node address {address!r} is not an IPv4 "
                         f"address; set {key} to the IPv4 address to bind") from None
    return address


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (bound and released; the caller binds it next). Raises OSError
    when ``host`` is not an address of this machine."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def interface_of(address: str) -> str:
    """The name of this machine's network interface on whose IPv4 network ``address`` lies
    (``psutil.net_if_addrs``: each interface's addresses with their netmasks): one that holds ``address``
    itself first, else the most specific network holding it, as a route lookup would pick. Loopback
    addresses give the loopback interface (``lo`` holds ``127.0.0.1/8``, so ``127.0.0.2`` is on it too).
    What ``GLOO_SOCKET_IFNAME`` names for a gloo group that must use ``address`` (``trainers.fsdp``).
    Raises ValueError naming ``address`` when it is not an IPv4 address or no interface's network holds
    it (the error lists the interfaces' networks)."""
    try:
        target = ipaddress.IPv4Address(address)
    except ipaddress.AddressValueError:
        raise ValueError(f"an interface is looked up by IPv4 address, got {address!r}") from None
    best: tuple[bool, int, str] | None = None  # (holds the exact address, prefix length, interface name)
    seen = []
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family != socket.AF_INET or not addr.netmask:
                continue
            network = ipaddress.IPv4Interface(f"{addr.address}/{addr.netmask}").network
            seen.append(f"{name} {addr.address}/{network.prefixlen}")
            if target in network:
                key = (ipaddress.IPv4Address(addr.address) == target, network.prefixlen, name)
                best = key if best is None or key[:2] > best[:2] else best
    if best is None:
        raise ValueError(f"no network interface of this machine is on the network of {address}: the "
                         f"interfaces hold {', '.join(seen) or 'no IPv4 address'}")
    return best[2]


def gloo_interface_name(master_addr: str) -> str:
    """The network interface this process's gloo device binds for a group that meets at ``master_addr``:
    the interface on ``master_addr``'s network (:func:`interface_of`; loopback gives the loopback
    interface), else, for a member on another network than the master, the interface of this process's Ray
    node address. Raises ValueError naming the address(es) when no interface is on either network."""
    try:
        return interface_of(master_addr)
    except ValueError as exc:
        try:
            node_address = node_ip_address()
        except RuntimeError:
            raise ValueError(f"gloo rendezvous at {master_addr}: {exc}") from None
        try:
            return interface_of(node_address)
        except ValueError as node_exc:
            raise ValueError(f"gloo rendezvous at {master_addr}: no interface is on its network, nor on that of "
                             f"this process's Ray node address: {node_exc}") from None


@contextlib.contextmanager
def gloo_interface(master_addr: str, who: str) -> Iterator[None]:
    """Set ``GLOO_SOCKET_IFNAME`` to :func:`gloo_interface_name` while a gloo group is created (the trainers'
    group, ``trainers.fsdp``; the checkpoint engine's ``broadcast`` group), then restore it: without it gloo
    binds, and tells its peers, the address the host name resolves to (127.0.1.1 on Debian, a node address
    where the host name resolves to one: a one-node job would listen beyond loopback). Scoped to one group,
    so each group of a process gets its own. A value the user set is left alone (logged). ``who`` names
    the member in the log line. Raises ValueError as :func:`gloo_interface_name`."""
    if os.environ.get(GLOO_IFNAME_ENV):
        logger.info("%s: %s=%s is set, gloo uses it (not the interface looked up for %s)",
                    who, GLOO_IFNAME_ENV, os.environ[GLOO_IFNAME_ENV], master_addr)
        yield
        return
    name = gloo_interface_name(master_addr)
    logger.info("%s: gloo uses interface %s for the group at %s (set %s to override)",
                who, name, master_addr, GLOO_IFNAME_ENV)
    os.environ[GLOO_IFNAME_ENV] = name
    try:
        yield
    finally:
        os.environ.pop(GLOO_IFNAME_ENV, None)
