"""The leader's control plane: a ZMQ ROUTER that every roller's DEALER (identity = roller name) talks
to, the per-update round state, and the bounded waits of ``protocol``'s message flow.

A roller whose connection closed (its process exited) leaves the update in flight within seconds, not after
``timeout_s``: while waiting, the leader probes the targets it waits for (the ROUTER refuses a ``Probe`` to a
name it has no connection to) and fails one that was connected before (its receiver's ``Hello`` came, even
if read only now) and is refused for ``DISCONNECT_GRACE_S`` as disconnected.

The ROUTER binds ``checkpointengine.host`` (loopback unless configured); it is the weight plane's one
ZMQ socket that may leave the node (the ``zmq`` backend's buckets ride on it). With
``checkpointengine.curve`` it is a CURVE server admitting only the job's client key (``common.curve``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from checkpointengine.config import CheckpointEngineConfig
from checkpointengine.protocol import (
    NO_REQUEST,
    Abort,
    Ack,
    Begin,
    Consumed,
    Fail,
    Hello,
    Probe,
    ProtocolError,
    Want,
    WeightSyncTimeout,
    decode,
    encode,
)
from common.curve import CurveKeys, serve_curve, start_authenticator

logger = logging.getLogger(__name__)

PROBE_EVERY_S = 0.5  # how often a waiting leader probes the targets it waits for
DISCONNECT_GRACE_S = 2.0  # a target the ROUTER has no connection to for this long has left (a reconnect takes ms)


@dataclass
class Round:
    """State of the update in flight: ``active`` targets still in it, the last bucket each consumed,
    each one's outcome (None = acked, else its error) and the ``request`` of the Want each joined with."""

    weight_version: int
    targets: list[str]
    active: set[str]
    consumed: dict[str, int] = field(default_factory=dict)
    results: dict[str, str | None] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    started: bool = False  # every target's Want arrived; Consumed/Ack/Fail before that are stale


class ControlServer:
    """Bound to ``tcp://{cfg.host}:<random port>`` (``address``); a CURVE server with ``curve`` (the
    job's keys, server secret included), else plain TCP. ``weight_version``: the last one the leader
    completed; ``roller_weight_versions``: each roller's committed ``weight_version`` as it last reported
    or acked. Every wait ends after ``cfg.timeout_s`` (read at each wait) with WeightSyncTimeout naming
    the rollers and the ``weight_version``. Raises zmq.ZMQError when ``cfg.host`` cannot be bound (an
    address not on this machine), ValueError for ``curve`` keys without the server secret."""

    def __init__(self, cfg: CheckpointEngineConfig, curve: CurveKeys | None = None):
        self.cfg = cfg
        self.weight_version = -1
        self.roller_weight_versions: dict[str, int] = {}
        self._wants: dict[str, Want] = {}  # each roller's latest Want not yet answered
        self._refused_since: dict[str, float] = {}  # roller → when a Probe to it was first refused (monotonic)
        self._last_probe = -float("inf")
        self._seen: set[str] = set()  # rollers ever connected: a message came, or a Probe was accepted
        self._ctx = zmq.Context()
        self._auth = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to an unknown roller raises, not drops
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted roller (same name) takes over
            self._sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                serve_curve(self._sock, curve)
                self._auth = start_authenticator(self._ctx, curve)
            self.address = f"tcp://{cfg.host}:{self._sock.bind_to_random_port(f'tcp://{cfg.host}')}"
        except BaseException:
            self.close()
            raise

    def send_to(self, roller: str, msg, frames=()) -> None:
        self._sock.send_multipart([roller.encode(), encode(msg), *frames], copy=False)

    def broadcast(self, rnd: Round, msg, frames=()) -> None:
        """Send ``msg`` (+ raw ``frames``, zero-copy) to every target still in the round; an unreachable
        one leaves the round with that error."""
        header = encode(msg)
        for roller in sorted(rnd.active - set(rnd.results)):
            self._send_in_round(rnd, roller, [header, *frames])

    def _send_in_round(self, rnd: Round, roller: str, parts: list) -> None:
        """Send ``parts`` (header, then raw frames) to ``roller``; unreachable, it leaves ``rnd`` with that error."""
        try:
            self._sock.send_multipart([roller.encode(), *parts], copy=False)
        except zmq.ZMQError as exc:
            rnd.results[roller] = f"unreachable: {exc}"
            rnd.active.discard(roller)

    def await_wants(self, rnd: Round) -> None:
        """Until every target wants ``rnd.weight_version``; one wanting a later one leaves the round at once."""
        def pending() -> list[str]:
            for roller in list(rnd.active):
                want = self._wants.get(roller)
                if want is not None and want.weight_version > rnd.weight_version:
                    rnd.results[roller] = (f"wants weight_version {want.weight_version} but the sender is sending "
                                           f"{rnd.weight_version}")
                    rnd.active.discard(roller)
            return [r for r in rnd.active if getattr(self._wants.get(r), "weight_version", None) != rnd.weight_version]

        self._await(rnd, pending, "want")
        for roller in rnd.active:
            rnd.requests[roller] = self._wants.pop(roller).request
        rnd.started = True

    def begin(self, rnd: Round) -> None:
        """Send each target still in the round the Begin of its own Want (``await_wants`` first)."""
        for roller in sorted(rnd.active - set(rnd.results)):
            self._send_in_round(rnd, roller, [encode(Begin(rnd.weight_version, rnd.requests[roller]))])

    def abort(self, rnd: Round, reason: str) -> None:
        """Abort the round: each target still in it gets an Abort naming its Want (``NO_REQUEST`` when none
        came), and pending Wants of the targets are dropped (a roller retried asks again, and its late
        ``Fail`` of the aborted update, sent before that new ``Want``, is then ignored)."""
        for roller in sorted(rnd.active - set(rnd.results)):
            want = self._wants.get(roller)
            request = rnd.requests.get(roller, want.request if want is not None else NO_REQUEST)
            try:
                self.send_to(roller, Abort(rnd.weight_version, reason, request))
            except zmq.ZMQError:
                pass  # gone: nothing waits there
        for roller in rnd.targets:
            self._wants.pop(roller, None)

    def await_consumed(self, rnd: Round, index: int) -> None:
        def pending() -> list[str]:
            return [r for r in rnd.active if rnd.consumed.get(r, -1) < index and r not in rnd.results]

        self._await(rnd, pending, f"consume bucket {index}")

    def await_results(self, rnd: Round) -> None:
        self._await(rnd, lambda: [r for r in rnd.active if r not in rnd.results], "ack")

    def _await(self, rnd: Round, pending: Callable[[], list[str]], what: str) -> None:
        """Handle incoming messages until ``pending()`` (rollers still owing ``what``) is empty."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while missing := sorted(pending()):
            self._drop_disconnected(rnd)
            if not (missing := sorted(pending())):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncTimeout(f"weight_version {rnd.weight_version}: rollers {missing} did not {what} "
                                        f"within {self.cfg.timeout_s:.1f} s")
            if self._sock.poll(min(left, PROBE_EVERY_S) * 1000):
                self._handle_incoming(rnd)

    def _handle_incoming(self, rnd: Round) -> None:
        frames = self._sock.recv_multipart()
        roller = frames[0].decode(errors="replace")
        try:
            if len(frames) != 2:
                raise ProtocolError(f"expected one header frame, got {len(frames) - 1}")
            msg = decode(frames[1])
        except ProtocolError as exc:
            logger.warning("weight sender: bad message from %s: %s", roller, exc)
            return
        self._seen.add(roller)
        self._refused_since.pop(roller, None)  # connected now
        if isinstance(msg, Want):
            self.roller_weight_versions[roller] = msg.have
            if msg.weight_version < self.weight_version or msg.weight_version <= msg.have:
                reason = f"the sender is at weight_version {self.weight_version}; roller has {msg.have}"
                self._sock.send_multipart([frames[0], encode(Abort(msg.weight_version, reason, msg.request))])
            else:
                self._wants[roller] = msg
        elif isinstance(msg, Hello):
            return  # seen: what it is for
        elif isinstance(msg, Consumed | Ack | Fail):
            if not rnd.started or msg.weight_version != rnd.weight_version or roller not in rnd.active:
                return  # late message of an earlier update (a roller sends it before its next Want)
            if isinstance(msg, Consumed):
                rnd.consumed[roller] = max(rnd.consumed.get(roller, -1), msg.index)
            elif isinstance(msg, Ack):
                rnd.results[roller] = None
            else:
                rnd.results[roller] = msg.error
        else:
            logger.warning("weight sender: unexpected %s from %s", type(msg).__name__, roller)

    def _drop_disconnected(self, rnd: Round) -> None:
        """Probe each target still owed something in ``rnd`` (at most every ``PROBE_EVERY_S``). One that was
        connected before (a message came from it, or a Probe was accepted) and to which the ROUTER has had no
        connection for ``DISCONNECT_GRACE_S`` (a reconnecting receiver takes milliseconds) leaves the round as
        disconnected. One never connected is left to ``timeout_s`` (a starting receiver may be slow to come)."""
        now = time.monotonic()
        if now - self._last_probe < PROBE_EVERY_S:
            return
        self._last_probe = now
        for roller in sorted(rnd.active - set(rnd.results)):
            try:
                self.send_to(roller, Probe())
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    continue  # e.g. its queue is full: connected
                since = self._refused_since.setdefault(roller, now)
                if roller in self._seen and now - since >= DISCONNECT_GRACE_S:
                    logger.warning("weight sender: roller %s has had no connection for %.1f s (weight_version %d)",
                                   roller, now - since, rnd.weight_version)
                    rnd.results[roller] = (f"disconnected: no connection for {now - since:.1f} s (its receiver "
                                           "closed or its process exited)")
                    rnd.active.discard(roller)
                    self._wants.pop(roller, None)
            else:
                self._refused_since.pop(roller, None)
                self._seen.add(roller)

    def close(self) -> None:
        """Close the socket, its CURVE authenticator and its context. Idempotent."""
        if self._sock is not None:
            self._sock.close(0)
            if self._auth is not None:
                self._auth.stop()
                self._auth = None
            self._ctx.term()
            self._sock = None
