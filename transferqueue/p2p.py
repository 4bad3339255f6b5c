"""Device path: tensor bytes between a client and a storage unit over torch.distributed point-to-point
in a pairwise side group — NCCL for CUDA tensors, gloo on CPU (tests) — while headers stay on ZMQ.

::

    client --p2p_connect{link, backend, node}--> unit ; both build a 2-rank group (unit rank 0)
    put:  client --put{p2p: link, columns}--> unit posts recv per column ; client sends ; unit replies
    get:  client --get{p2p: link}--> unit replies runs ["p2p", 0, n] then isends them in reply order ;
          client posts one recv per run into its output tensors (on its device)

Rendezvous uses a ``FileStore`` (no listening socket) when both ends are on one node, else a ``TCPStore``
listening on the unit's configured host only (``common.net.tcp_store``; NCCL's own bootstrap sockets
follow ``NCCL_SOCKET_IFNAME``). Gloo binds to the unit's host.
Each link is used by one request at a time (the client holds the link's lock from header to last byte),
so sends and recvs match in order.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import threading
import uuid

import torch
import torch.distributed as dist

from common import net
from transferqueue.buffers import host_tensor
from transferqueue.records import LimitExceeded

BACKENDS = ("gloo", "nccl")


def make_group(backend: str, store, rank: int, host: str, timeout_s: float):
    """A 2-rank process group over ``store`` (rank 0 = storage unit, 1 = client); blocks until both
    ranks join or ``timeout_s`` passes (RuntimeError)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"p2p backend must be one of {BACKENDS}, got {backend!r}")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (same device, no copy)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class Link:
    """One side of a pairwise group; ``id`` names it in request headers."""

    def __init__(self, pg, peer: int, device: torch.device, link_id: str = ""):
        self.pg, self.peer, self.device, self.id = pg, peer, device, link_id
        self.lock = threading.Lock()

    def abort(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # gloo may not support abort on every version; the group is dropped anyway
            pass

    def send(self, tensors: list[torch.Tensor]) -> list:
        return [self.pg.send([t], self.peer, 0) for t in tensors if t.numel()]

    def recv(self, tensors: list[torch.Tensor]) -> list:
        return [self.pg.recv([t], self.peer, 0) for t in tensors if t.numel()]


class UnitP2P:
    """The storage unit's side: links by id, receives puts, sends gets (``isend``; completion polled)."""

    def __init__(self, backend: str, device: str, host: str, timeout_s: float, max_links: int = 1024,
                 max_name_chars: int = 1024):
        if backend not in BACKENDS:
            raise ValueError(f"transferqueue.p2p_backend must be one of {BACKENDS}, got {backend!r}")
        self.backend, self.host, self.timeout_s = backend, host, timeout_s
        self.device = torch.device(device)
        if self.device.type == "cuda" and torch.cuda.device_count():  # unit i asks for cuda:i; wrap around
            self.device = torch.device("cuda", (self.device.index or 0) % torch.cuda.device_count())
        self.links: dict[str, Link] = {}
        self.max_links, self.max_name_chars = max_links, max_name_chars  # ``transferqueue.max_*``
        self.inflight: list = []
        self.run_dir = tempfile.mkdtemp(prefix="hflow-tq-p2p-")
        self.tcp_store = None

    def connect(self, header: dict, here: str) -> tuple[dict, object]:
        """Reply to ``p2p_connect`` plus the action that joins the group once the reply is out."""
        link_id = header.get("link")
        if not isinstance(link_id, str) or not link_id or link_id in self.links:
            raise ValueError(f"p2p_connect: link must be a new non-empty string, got {link_id!r:.100}")
        if len(link_id) > self.max_name_chars:
            raise LimitExceeded("max_name_chars", f"p2p_connect: a link id of {len(link_id)} characters, past "
                                f"transferqueue.max_name_chars={self.max_name_chars}")
        if len(self.links) >= self.max_links:
            raise LimitExceeded("max_p2p_links", f"p2p_connect: this unit holds {len(self.links)} links, the most "
                                f"transferqueue.max_p2p_links={self.max_links} allows")
        if header.get("backend") != self.backend:
            raise ValueError(f"p2p_connect: this unit speaks {self.backend}, not {header.get('backend')!r}")
        if header.get("node") == here:
            reply = {"store": "file", "path": os.path.join(self.run_dir, f"{uuid.uuid4().hex}.store")}
            store = dist.FileStore(reply["path"], 2)
        else:
            if self.tcp_store is None:  # listens on the unit's host only
                self.tcp_store = net.tcp_store(self.host, 0, None, True, self.timeout_s, wait_for_workers=False)
            reply = {"store": "tcp", "host": self.host, "port": self.tcp_store.port}
            store = dist.PrefixStore(link_id, self.tcp_store)
        reply.update(host=self.host)

        def join():
            self.links[link_id] = Link(make_group(self.backend, store, 0, self.host, self.timeout_s), 1, self.device)

        return reply, join

    def link(self, link_id) -> Link:
        try:
            return self.links[link_id]
        except (KeyError, TypeError):
            raise ValueError(f"unknown p2p link {link_id!r}: call p2p_connect first") from None

    def receive(self, link_id, sizes: list[int]) -> list[torch.Tensor]:
        """Receive one flat uint8 buffer per column (in order) onto this unit's device; blocks until done."""
        link = self.link(link_id)
        bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        for work in link.recv(bufs):
            work.wait()
        return bufs

    def drain(self, link_id, sizes: list[int]) -> None:
        """Receive and drop a put's bytes that will be rejected, so the client's sends complete."""
        if link_id in self.links:
            self.receive(link_id, sizes)

    def send_later(self, link_id, sources: list) -> object:
        """The action that ``isend``s ``sources`` (tensors or host arrays) after the reply went out."""
        link = self.link(link_id)

        def go():
            tensors = [s if isinstance(s, torch.Tensor) else host_tensor(s) for s in sources]
            if self.device.type == "cuda":
                tensors = [t.to(self.device, non_blocking=False) for t in tensors]
            self.inflight.extend((w, tensors) for w in link.send(tensors))

        return go

    def poll(self) -> None:
        self.inflight = [(w, t) for w, t in self.inflight if not w.is_completed()]

    def close(self) -> None:
        for link in self.links.values():
            try:
                link.pg.shutdown()
            except Exception:  # already aborted by a peer's exit
                pass
        self.links.clear()
        import shutil

        shutil.rmtree(self.run_dir, ignore_errors=True)


def client_join(backend: str, reply: dict, link_id: str, timeout_s: float, device: torch.device) -> Link:
    """The client's side of ``p2p_connect``: build the store from the unit's reply and join as rank 1."""
    if reply["store"] == "file":
        store = dist.FileStore(reply["path"], 2)
    else:
        store = dist.PrefixStore(link_id, net.tcp_store(reply["host"], reply["port"], None, False, timeout_s))
    host = "127.0.0.1" if reply["store"] == "file" else _local_host_for(reply["host"])
    return Link(make_group(backend, store, 1, host, timeout_s), 0, device, link_id)


def encode_device_column(name: str, value, count: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    """Like ``wire.encode_column`` for the p2p path: ``(descriptor, one flat uint8 tensor on device)``;
    variable-length samples are packed (one device copy). Raises ValueError for object values."""
    from transferqueue.wire import dtype_name

    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != count:
            raise ValueError(f"field {name!r}: expected {count} rows, got {tuple(value.shape)}")
        flat = as_bytes(value.to(device))
        return {"name": name, "dtype": dtype_name(value.dtype), "shape": list(value.shape[1:]),
                "nbytes": flat.numel()}, flat
    if not isinstance(value, list | tuple) or len(value) != count or not all(isinstance(v, torch.Tensor) for v in value):
        raise ValueError(f"field {name!r}: the p2p path takes tensors or lists of {count} tensors; "
                         "put object fields in a separate put without a device")
    if len({v.dtype for v in value}) > 1:
        raise TypeError(f"field {name!r}: samples have different dtypes")
    parts = [as_bytes(v.to(device)) for v in value]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    dtype = dtype_name(value[0].dtype) if value else "uint8"
    return {"name": name, "dtype": dtype, "shapes": [list(v.shape) for v in value], "nbytes": flat.numel()}, flat


def _local_host_for(peer_host: str) -> str:
    """The address of this machine's interface that routes to ``peer_host`` (a UDP connect sends nothing)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))
        return s.getsockname()[0]
