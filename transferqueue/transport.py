"""Client-side transport: persistent DEALER sockets, request ids, and the sync/async drivers of a *flow*.

A flow is a generator holding the logic of one client operation, free of I/O. It yields either a list
of ``Call(target, header, frames)`` (sent together, replies returned in the same order; a failure is
thrown into the flow at that ``yield`` so it can undo what it did) or a ``Sleep``;
the sync driver runs it on blocking sockets (so it works inside a running event loop too), the async
driver on ``zmq.asyncio`` sockets of the current loop. One code path for both APIs.

Each ``Channel`` holds one DEALER socket per server and is used by one flow at a time (a bounded pool
per client), so replies arrive in order; replies whose ``rid`` is stale (from a timed-out request) are
dropped. Error replies raise ``RemoteError`` (``Full`` when the server says so, ``LimitExceeded`` when it
names the bound a request would pass); a missing reply raises ``Timeout``; a request cut off by ``close``
raises ``Closed`` (never a ZMQ error or, in the async API, a ``CancelledError`` the caller did not ask for).

A server that died is not waited for until the request timeout: each socket's ZMQ monitor reports when
its connection opens and closes (a killed process's kernel closes its sockets at once), and a request
whose server connection has been down for ``LOST_AFTER_S`` raises ``ServerLost`` naming the server. A
socket counts as down from its creation until its first connection, so a fresh socket to a dead server is
caught too. A server that is slow, or a machine that vanished without closing its connections, still
ends in ``Timeout``.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import threading
import time
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from common.curve import connect_curve
from common.node import node_id
from transferqueue import wire
from transferqueue.records import (
    Closed,
    Full,
    LimitExceeded,
    RemoteError,
    ServerLost,
    Timeout,
    TQError,
    TQHandle,
)

INDEX = -1
CLEANUP_GRACE_S = 5.0  # extra time a failed flow gets for its clean-up requests
# A request whose server connection stays down this long fails with ServerLost (a reconnect to a live server
# takes milliseconds; a first connect across nodes, at most a few SYN retries).
LOST_AFTER_S = 5.0
WAIT_SLICE_S = 0.5  # a waiting request looks at its connection's state this often
# Only connection changes: a dead server's refused reconnects (CONNECT_RETRIED, every 100 ms) would fill the
# monitor's queue, and libzmq's I/O thread blocks on a full monitor socket.
_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
_rids = itertools.count(1)
_monitor_ids = itertools.count()


@dataclass
class Call:
    target: int  # INDEX or a storage-unit number
    header: dict
    frames: list = field(default_factory=list)
    tolerate: bool = False  # an error reply is returned as the exception object instead of raised
    after_send: Callable[[], None] | None = None  # e.g. p2p sends the server waits for before replying


@dataclass
class Sleep:
    seconds: float


Flow = Generator[list[Call] | Sleep, Any, Any]


def _setup(sock: zmq.Socket, handle: TQHandle, address: str) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.RCVHWM, 1000)
    if handle.curve is not None:
        connect_curve(sock, handle.curve)
    sock.connect(address)


def server_addresses(handle: TQHandle) -> dict[int, str]:
    """Where this process reaches each server (INDEX or unit number): its ``ipc://`` endpoint when the
    server runs on this node and has one, else its TCP endpoint."""
    here = node_id()
    local_units = handle.unit_local_addresses or [""] * len(handle.unit_addresses)
    out = {INDEX: handle.index_local_address if handle.index_local_address and handle.index_node == here
           else handle.index_address}
    for u, (addr, local, node) in enumerate(zip(handle.unit_addresses, local_units, handle.unit_nodes, strict=True)):
        out[u] = local if local and node == here else addr
    return out


def server_name(target: int) -> str:
    """``index`` or ``storage unit K``: how errors name a server."""
    return "index" if target == INDEX else f"storage unit {target}"


class Peer:
    """One DEALER socket to a server and the PAIR socket its monitor sends to (connection opened / closed
    events). ``down_since``: ``time.monotonic()`` since when the connection is known to be down (from
    creation until the first connection; from a closed connection until the next), None while it is up.

    libzmq's I/O thread sends monitor events with blocking sends, so the PAIR never makes it wait: its
    receive queue is unbounded (events are rare: one per connection change), and ``close`` stops the
    monitor before closing the PAIR (an event sent to a closed PAIR would block that thread for good)."""

    def __init__(self, ctx: zmq.Context, handle: TQHandle, target: int, address: str):
        self.target, self.address = target, address
        self.sock = ctx.socket(zmq.DEALER)
        endpoint = f"inproc://hflow-tq-monitor-{next(_monitor_ids)}"
        self.sock.monitor(endpoint, _MONITOR_EVENTS)  # before connect: the first connection is seen
        self.monitor = ctx.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)  # 0: no limit (an inproc queue's bound is the sum of both ends)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(endpoint)
        _setup(self.sock, handle, address)
        self.down_since: float | None = time.monotonic()

    def note(self, frames: list) -> None:
        """Take one monitor event message into the connection state."""
        event = struct.unpack("=hi", frames[0])[0]
        if event == zmq.EVENT_CONNECTED:
            self.down_since = None
        elif event == zmq.EVENT_DISCONNECTED and self.down_since is None:
            self.down_since = time.monotonic()

    def check(self, op: Any) -> None:
        """Raise ServerLost when the connection has been down ``LOST_AFTER_S`` (call after taking every
        queued event with ``note``)."""
        if self.down_since is not None and time.monotonic() - self.down_since >= LOST_AFTER_S:
            raise ServerLost(server_name(self.target), f"TransferQueue {server_name(self.target)} at {self.address} "
                             f"is gone: no connection to it for {LOST_AFTER_S:.0f} s (its process died, or nothing "
                             f"listens there); {op} not answered")

    def close(self) -> None:
        """Stop the monitor, then close both sockets (idempotent)."""
        if not self.sock.closed:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:  # the context is being terminated: nothing sends events any more
                pass
            self.sock.close(linger=0)
        self.monitor.close(linger=0)


class Channel:
    """One DEALER socket per server (a ``Peer``, created on first use), used by one flow at a time."""

    def __init__(self, ctx: zmq.Context, handle: TQHandle, addresses: dict[int, str]):
        self.ctx, self.handle, self.addresses = ctx, handle, addresses
        self.peers: dict[int, Peer] = {}

    def peer(self, target: int) -> Peer:
        p = self.peers.get(target)
        if p is None:
            p = self.peers[target] = Peer(self.ctx, self.handle, target, self.addresses[target])
        return p

    def sock(self, target: int) -> zmq.Socket:
        return self.peer(target).sock

    def close(self) -> None:
        for p in list(self.peers.values()):
            p.close()
        self.peers.clear()


def _check(reply: list, rid: int, tolerate: bool) -> tuple[dict, list] | TQError | None:
    header = wire.unpack_header(reply[0])
    if header.get("rid") != rid:
        return None  # a late reply to an abandoned request
    if not header.get("ok"):
        message, limit = header.get("error", "unknown error"), header.get("limit")
        if isinstance(limit, str):
            err = LimitExceeded(limit, message)
        else:
            err = (Full if header.get("full") else RemoteError)(message)
        if tolerate:
            return err
        raise err
    return header, reply[1:]


def _socket_error(exc: zmq.ZMQError, closed: bool) -> TQError:
    """The typed error for a socket failure: Closed after ``close``, else TQError naming it."""
    if closed:
        return Closed("client was closed during the request")
    return TQError(f"socket error: {type(exc).__name__}: {exc}")


def _look(peer: Peer, call: Call) -> None:
    """Take every queued monitor event of ``peer``; ServerLost when its connection stayed down too long."""
    while True:
        try:
            peer.note(peer.monitor.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    peer.check(call.header.get("op"))


def _stamp(call: Call) -> tuple[int, list]:
    rid = next(_rids)
    call.header["rid"] = rid
    return rid, [wire.pack(call.header), *call.frames]


class SyncDriver:
    """Runs flows on blocking sockets; a bounded pool of channels shared by threads."""

    def __init__(self, handle: TQHandle, max_channels: int = 16):
        self.handle = handle
        self.addresses = server_addresses(handle)
        self.ctx = zmq.Context()
        self.pool: list[Channel] = []
        self.all: list[Channel] = []  # closed before the context: each stops its monitors first (Peer.close)
        self.created = 0
        self.max_channels = max_channels
        self.cond = threading.Condition()
        self.closed = False

    def _acquire(self, deadline: float) -> Channel:
        with self.cond:
            while True:
                if self.closed:
                    raise Closed("client is closed")
                if self.pool:
                    return self.pool.pop()
                if self.created < self.max_channels:
                    self.created += 1
                    self.all.append(Channel(self.ctx, self.handle, self.addresses))
                    return self.all[-1]
                if not self.cond.wait(timeout=max(deadline - time.monotonic(), 0)):
                    raise Timeout(f"no free channel within the timeout ({self.max_channels} busy)")

    def _release(self, chan: Channel) -> None:
        with self.cond:
            if self.closed:
                chan.close()
            else:
                self.pool.append(chan)
                self.cond.notify()

    def run(self, flow: Flow, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        chan = self._acquire(deadline)
        try:
            step = next(flow)
            while True:
                try:
                    if isinstance(step, Sleep):
                        time.sleep(step.seconds)
                        result = None
                    else:
                        result = self._call_all(chan, step, deadline)
                except Exception as exc:  # the flow sees the error at its yield and may clean up
                    deadline = max(deadline, time.monotonic() + CLEANUP_GRACE_S)
                    step = flow.throw(exc)
                    continue
                step = flow.send(result)
        except StopIteration as stop:
            return stop.value
        finally:
            self._release(chan)

    def _call_all(self, chan: Channel, calls: list[Call], deadline: float) -> list:
        try:
            return self._exchange(chan, calls, deadline)
        except zmq.ZMQError as exc:  # e.g. close() destroyed the context under a waiting request
            raise _socket_error(exc, self.closed) from None

    def _exchange(self, chan: Channel, calls: list[Call], deadline: float) -> list:
        rids = []
        for call in calls:
            rid, msg = _stamp(call)
            chan.sock(call.target).send_multipart(msg, copy=False)
            rids.append(rid)
        for call in calls:
            if call.after_send is not None:
                call.after_send()
        replies = []
        for call, rid in zip(calls, rids, strict=True):
            peer = chan.peer(call.target)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"no reply to {call.header.get('op')} within the timeout")
                if not peer.sock.poll(int(min(left, WAIT_SLICE_S) * 1000) + 1):
                    _look(peer, call)
                    continue
                got = _check(peer.sock.recv_multipart(copy=False), rid, call.tolerate)
                if got is not None:
                    replies.append(got)
                    break
        return replies

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for chan in self.all:  # those in use too: their flows then fail with Closed
                chan.close()
            self.pool.clear()
            self.cond.notify_all()
        self.ctx.destroy(linger=0)


class AsyncDriver:
    """Runs flows on ``zmq.asyncio`` sockets; channels are per event loop (sockets bind to their loop)."""

    def __init__(self, handle: TQHandle, max_channels: int = 16):
        self.handle = handle
        self.addresses = server_addresses(handle)
        self.ctx = zmq.asyncio.Context()
        self.pools: dict[int, tuple[weakref.ref, list[Channel], asyncio.Semaphore]] = {}
        self.max_channels = max_channels
        self.closed = False
        self.all: list[Channel] = []

    async def run(self, flow: Flow, timeout_s: float) -> Any:
        if self.closed:
            raise Closed("client is closed")
        deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        self._prune()
        if id(loop) not in self.pools:
            self.pools[id(loop)] = (weakref.ref(loop), [], asyncio.Semaphore(self.max_channels))
        _, pool, sem = self.pools[id(loop)]
        try:
            await asyncio.wait_for(sem.acquire(), timeout=max(deadline - time.monotonic(), 0))
        except TimeoutError:
            raise Timeout("no free channel within the timeout") from None
        chan = pool.pop() if pool else None
        if chan is None:
            chan = Channel(self.ctx, self.handle, self.addresses)
            self.all.append(chan)
        try:
            step = next(flow)
            while True:
                try:
                    if isinstance(step, Sleep):
                        await asyncio.sleep(step.seconds)
                        result = None
                    else:
                        result = await self._call_all(chan, step, deadline)
                except Exception as exc:  # the flow sees the error at its yield and may clean up
                    deadline = max(deadline, time.monotonic() + CLEANUP_GRACE_S)
                    step = flow.throw(exc)
                    continue
                step = flow.send(result)
        except StopIteration as stop:
            return stop.value
        finally:
            pool.append(chan)
            sem.release()

    def _prune(self) -> None:
        """Close the channels of event loops that are gone (e.g. after each ``asyncio.run``)."""
        for key, (ref, pool, _) in list(self.pools.items()):
            loop = ref()
            if loop is None or loop.is_closed():
                for chan in pool:
                    chan.close()
                    self.all.remove(chan)
                del self.pools[key]

    async def _call_all(self, chan: Channel, calls: list[Call], deadline: float) -> list:
        try:
            return await self._exchange(chan, calls, deadline)
        except zmq.ZMQError as exc:
            raise _socket_error(exc, self.closed) from None
        except asyncio.CancelledError:
            if self.closed:  # close() destroyed the context, which cancels its sockets' pending futures
                raise Closed("client was closed during the request") from None
            raise

    async def _exchange(self, chan: Channel, calls: list[Call], deadline: float) -> list:
        rids = []
        for call in calls:
            rid, msg = _stamp(call)
            await chan.sock(call.target).send_multipart(msg, copy=False)
            rids.append(rid)
        for call in calls:
            if call.after_send is not None:
                call.after_send()  # blocking: p2p transfers are not awaitable
        replies = []
        for call, rid in zip(calls, rids, strict=True):
            peer = chan.peer(call.target)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"no reply to {call.header.get('op')} within the timeout")
                if not await peer.sock.poll(int(min(left, WAIT_SLICE_S) * 1000) + 1):
                    await self._look(peer, call)
                    continue
                got = _check(await peer.sock.recv_multipart(copy=False), rid, call.tolerate)
                if got is not None:
                    replies.append(got)
                    break
        return replies

    async def _look(self, peer: Peer, call: Call) -> None:
        """``_look`` on this loop's sockets (a non-blocking receive completes at once)."""
        while True:
            if self.closed or peer.monitor.closed:
                raise Closed("client was closed during the request")
            try:
                peer.note(await peer.monitor.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                break
        peer.check(call.header.get("op"))

    def close(self) -> None:
        self.closed = True
        for chan in self.all:
            chan.close()
        self.all.clear()
        self.ctx.destroy(linger=0)
