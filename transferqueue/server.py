"""The request loop shared by the index and the storage units: one ROUTER socket, one thread, no pickle.

::

    client DEALER --[header, *frames]--> ROUTER --handle()--> reply now, or park (long-poll) and
                  <--[header, *frames]--                       reply later from ``tick()``

Every failure inside ``handle`` (malformed message, bad ids, unknown op) becomes an error reply
``{"ok": False, "error": ...}`` (with ``"limit": key`` for a request past a bound: ``LimitExceeded``) and
the loop keeps serving. Replies go through ``reply``: a reply to a peer
that is gone (ROUTER_MANDATORY: its process died and its connection closed) or whose queue is full is
dropped (``send``), and ``undelivered`` lets the server undo what the request did (the index gives the
samples of an undelivered ``get_meta`` back). The loop wakes at least every ``tick_s`` for timers.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import zmq

from common.curve import CurveKeys, serve_curve, start_authenticator
from transferqueue import wire
from transferqueue.records import Full, LimitExceeded

logger = logging.getLogger(__name__)


Reply = tuple[dict, list]


class RouterServer:
    """Base of the index and storage-unit servers. Subclasses implement ``handle`` and maybe ``tick``.

    ``address``: ``tcp://host:port`` (port 0 picks a free one) or ``ipc://path``; the bound endpoint is
    ``self.endpoint``. ``local_address``: an ``ipc://`` path the same socket also binds, for clients on this
    node (a round trip over a Unix socket costs less than over loopback TCP); ``self.local_endpoint``.
    ``curve``: when given, the socket requires CURVE and accepts only the job's client key (ZAP handler
    in a thread of this process), on both endpoints.
    """

    tick_s = 0.05
    gc_every_s = 5.0
    timer_s = 0.0  # > 0: ``timer`` runs about this often (a subclass sets it)

    def __init__(self, address: str, curve: CurveKeys | None = None, hwm: int = 1000, local_address: str = ""):
        self.ctx = zmq.Context()  # own context: one ZAP handler per server
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a peer that is gone raises: see ``send``
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.auth = None
        if curve is not None:
            self.auth = start_authenticator(self.ctx, curve)
            serve_curve(self.sock, curve)
        if address.startswith("tcp://") and address.endswith(":0"):
            port = self.sock.bind_to_random_port(address[: address.rindex(":")])
            self.endpoint = f"{address[: address.rindex(':')]}:{port}"
        else:
            self.sock.bind(address)
            self.endpoint = address
        if local_address:
            if not local_address.startswith("ipc://"):
                raise ValueError(f"local_address must be an ipc:// endpoint, got {local_address!r}")
            self.sock.bind(local_address)
        self.local_endpoint = local_address
        self._stopped = False  # a plain flag: stop() runs in signal handlers, which must take no lock
        self.after_reply = None
        self.requests: dict[str, list[float]] = {}

    # -- subclass API
    def handle(self, identity: bytes, header: dict, frames: list) -> Reply | None:
        raise NotImplementedError

    def tick(self) -> None:
        """Called after every request and at least every ``tick_s`` (timers, parked requests)."""

    def timer(self, now: float) -> None:
        """Called about every ``timer_s`` (when > 0) with ``time.monotonic()``, for slow housekeeping."""

    def undelivered(self, request: dict, reply: dict) -> None:
        """Called when ``reply`` to ``request`` (both headers) could not be delivered (see ``send``): a subclass
        undoes what the request did, when it matters."""

    def send(self, identity: bytes, header: dict, frames: list | tuple = ()) -> bool:
        """Queue a reply to ``identity``; returns False (logged) when the peer is gone (its process died:
        EHOSTUNREACH under ROUTER_MANDATORY) or its queue is full, and the reply is dropped."""
        try:
            self.sock.send_multipart([identity, wire.pack(header), *frames], copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("dropping a reply: peer's queue is full")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            logger.info("dropping a reply (rid %s): its peer is gone", header.get("rid"))
        return False

    def reply(self, identity: bytes, request: dict, header: dict, frames: list | tuple = ()) -> None:
        """``send`` the reply ``header`` to ``request``; when it cannot be delivered, ``undelivered`` undoes
        the request. A failure there is logged, never raised: replies to parked requests are sent from
        ``tick``, outside the request loop's guard, and the loop must keep serving."""
        if self.send(identity, header, frames):
            return
        try:
            self.undelivered(request, header)
        except Exception:  # noqa: BLE001 - logged; the peer is gone, so there is no one to tell
            logger.exception("undoing the undelivered reply to %s failed", request.get("op"))

    # -- loop
    def serve_forever(self) -> None:
        """Serve until ``stop()``. Python's automatic cyclic GC is off in the loop: a full collection over a
        million-sample index stalls every request for ~100 ms; young generations are collected every
        ``gc_every_s`` instead (the servers create almost no reference cycles)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        gc.disable()
        next_gc = time.monotonic() + self.gc_every_s
        next_timer = time.monotonic() + self.timer_s if self.timer_s > 0 else float("inf")
        try:
            while not self._stopped:
                if poller.poll(int(self.tick_s * 1000)):
                    self._one()
                self.tick()
                now = time.monotonic()
                if now > next_gc:
                    gc.collect(1)
                    next_gc = time.monotonic() + self.gc_every_s
                if now > next_timer:
                    self.timer(now)
                    next_timer = now + self.timer_s
        finally:
            self.close()

    def _one(self) -> None:
        msg = self.sock.recv_multipart(copy=False)
        identity, rest = msg[0].bytes, msg[1:]
        rid: Any = None
        t0 = time.perf_counter()
        op = "?"
        try:
            if not rest:
                raise wire.WireError("empty message: expected [header, *frames]")
            header = wire.unpack_header(rest[0])
            rid, op = header.get("rid"), header.get("op")
            if not isinstance(op, str):
                op = "?"
                raise wire.WireError("header has no string 'op'")
            self.after_reply = None
            reply = self.handle(identity, header, rest[1:])
            if reply is not None:
                head, frames = reply
                head.update(ok=True, rid=rid)
                self.reply(identity, header, head, frames)
            if self.after_reply is not None:  # e.g. join a p2p group or start sends the reply announced
                self.after_reply()
        except Exception as exc:  # every failure becomes an error reply; the loop keeps serving
            if not isinstance(exc, ValueError | wire.WireError | TypeError | KeyError | Full):
                logger.exception("%s failed", op)
            reply = {"ok": False, "rid": rid, "error": f"{type(exc).__name__}: {exc}", "full": isinstance(exc, Full)}
            if isinstance(exc, LimitExceeded):
                reply["limit"] = exc.key
            self.send(identity, reply)
        stat = self.requests.setdefault(op if len(self.requests) < 64 or op in self.requests else "?", [0, 0.0, 0.0])
        dt = time.perf_counter() - t0
        stat[0] += 1
        stat[1] += dt
        stat[2] = max(stat[2], dt)

    def stop(self) -> None:
        """Make ``serve_forever`` return within ``tick_s``. It only sets a flag (no lock), so a signal
        handler may call it, even one that interrupts another signal handler."""
        self._stopped = True

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.local_endpoint:  # libzmq leaves the socket file behind
            try:
                os.unlink(self.local_endpoint[len("ipc://"):])
            except FileNotFoundError:
                pass
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)


def write_endpoint_file(path: str, info: dict) -> None:
    """Atomically publish a started server's endpoint (JSON) for the launcher to read."""
    import json

    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
