"""Which node a process is on, for every same-node fast path (TransferQueue shared memory and ``ipc://``
sockets, the checkpoint engine's ``shm`` backend): a Ray node inside a Ray cluster, else the machine."""

from __future__ import annotations

import socket
import sys

_ADOPTED_NODE: str | None = None


def node_id() -> str:
    """This process's node for the same-node decisions (shared memory, ``ipc://`` sockets, p2p links).

    In a Ray cluster (a Ray worker, or a driver connected to one) it is Ray's node id (``ray:<hex>``), so
    two Ray nodes on one machine are two nodes and take the cross-node paths between them; a server
    subprocess takes its launcher's (``adopt_node_id``); elsewhere it is the machine: hostname plus
    kernel boot id. Processes with different ids never share memory (frames over sockets instead).
    """
    if _ADOPTED_NODE is not None:
        return _ADOPTED_NODE
    ray = sys.modules.get("ray")  # never imports Ray into a process that does not use it
    if ray is not None and ray.is_initialized():
        return f"ray:{ray.get_runtime_context().get_node_id()}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def adopt_node_id(node: str) -> None:
    """Make ``node_id()`` return ``node`` in this process: a TransferQueue server subprocess runs on its
    launcher's node and takes its id (a Ray node id the subprocess could not learn itself)."""
    global _ADOPTED_NODE
    _ADOPTED_NODE = node


def node_ip_address() -> str:
    """This process's Ray node address (``ray.util.get_node_ip_address()``: the address the node's raylet
    registered, which the cluster's other nodes reach it at; on KubeRay the pod's IP). What a bind address
    of ``node`` (``common.net.resolve_bind_host``) binds. Raises RuntimeError outside a Ray cluster (neither
    a Ray worker nor a driver connected to one): then there is no Ray node to name."""
    ray = sys.modules.get("ray")  # never imports Ray into a process that does not use it
    if ray is None or not ray.is_initialized():
        raise RuntimeError("this process is not in a Ray cluster, so it has no Ray node address")
    import ray.util

    return ray.util.get_node_ip_address()
