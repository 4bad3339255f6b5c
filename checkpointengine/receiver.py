"""Receive side of the weight plane: ``WeightReceiver`` in each roller process.

The receiver speaks the control protocol of ``checkpointengine.protocol`` over a ZMQ DEALER whose
identity is the roller's name (a CURVE client when the handle carries keys: ``checkpointengine.curve``), and fetches payloads through the backend plug-in the handle names
(``checkpointengine.backend``: shm slots, zmq frames, a broadcast group joined when the sender asks,
safetensors files). Driving an engine through an update (pause → receive → load → commit → flush →
resume) is the rollers' part: ``rollers.weight_update.apply_update``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator

import torch
import zmq

from checkpointengine.bucket import BucketUnpacker
from checkpointengine.protocol import (
    Abort,
    Ack,
    Begin,
    BucketReady,
    Consumed,
    End,
    Fail,
    Hello,
    Probe,
    ProtocolError,
    Want,
    WeightSyncAborted,
    WeightSyncHandle,
    WeightSyncTimeout,
    decode,
    encode,
)
from common.curve import connect_curve

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5  # how often a waiting receive looks whether it was cancelled (``WeightReceiver.cancel``)


class WeightReceiver:
    """One roller's end of the weight plane. ``weight_version``: the last committed ``weight_version``
    (``initial_weight_version`` until the first update, e.g. 0 for weights loaded from the same checkpoint).

    ``receive(weight_version)`` yields the update's tensors; the caller loads them, then calls ``ack`` or
    ``fail`` (``rollers.weight_update.apply_update`` does all of it). Not thread-safe: one update at a time;
    only ``cancel`` may be called from another thread.
    """

    def __init__(self, handle: WeightSyncHandle, roller: str, device: str | torch.device = "cpu",
                 initial_weight_version: int = 0):
        if not roller:
            raise ValueError("roller name must be non-empty")
        self.handle = handle
        self.roller = roller
        self.device = torch.device(device)
        self.weight_version = initial_weight_version
        self._cancelled = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, roller.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if handle.curve is not None:
                connect_curve(self._sock, handle.curve)
            self._sock.connect(handle.control_address)
            self._sock.send(encode(Hello()))  # queued until connected; the sender learns the roller was there
            self._side = handle.plugin.receiver(handle, self.device)
        except BaseException:
            self._sock.close(0)
            self._ctx.term()
            raise
        self._pool: dict[str, torch.Tensor] | None = {} if handle.reuse_receive_buffers else None
        self._request = -2  # the current receive's (``protocol``); matches no Abort or Begin before the first
        self._stats = {"num_updates": 0, "num_failures": 0, "last_update_s": 0.0, "last_bytes": 0,
                       "total_bytes": 0, "last_error": ""}

    # ---------------------------------------------------------------------------------- receiving

    def receive(self, weight_version: int, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Ask the sender for ``weight_version`` and yield its ``(engine_name, tensor)`` pairs.

        ``copy=False`` yields views into the shared slot for unchunked shm tensors, valid only until the
        next item is requested. With ``handle.reuse_receive_buffers`` (default) shm/zmq tensors reuse
        the previous update's memory: valid until the next update (engines copy them).

        Raises ValueError when ``weight_version`` does not exceed the committed one, WeightSyncTimeout (naming
        the weight_version and the sender) when a message does not come within ``timeout_s``,
        WeightSyncAborted when the sender aborts or the receiver is cancelled, ProtocolError on a malformed
        stream.
        """
        if weight_version <= self.weight_version:
            raise ValueError(f"roller {self.roller!r}: weight_version {weight_version} does not exceed the "
                             f"committed {self.weight_version}")
        self._request = secrets.randbits(48)  # names this attempt: see ``protocol``
        self._send(Want(weight_version, self.weight_version, self._request))
        self._await_begin(weight_version)
        unpacker = BucketUnpacker(self.device, self._pool)
        expected = 0
        num_bytes = 0
        while True:
            msg, frames = self._recv(weight_version, f"bucket {expected}")
            if isinstance(msg, End):
                unpacker.finish()
                if msg.num_buckets != expected:
                    raise ProtocolError(f"weight_version {weight_version}: got {expected} buckets, sender sent "
                                        f"{msg.num_buckets}")
                self._stats["last_bytes"] = num_bytes
                return
            if not isinstance(msg, BucketReady) or msg.index != expected:
                raise ProtocolError(f"weight_version {weight_version}: expected bucket {expected}, got {msg}")
            expected += 1
            num_bytes += sum(e.nbytes for e in msg.entries)
            yield from self._bucket_tensors(msg, frames, unpacker, copy)

    def _bucket_tensors(self, msg: BucketReady, frames: list, unpacker: BucketUnpacker, copy: bool
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        return self._side.bucket_tensors(msg, frames, unpacker, copy,
                                         lambda: self._send(Consumed(msg.weight_version, msg.index)))

    def _await_begin(self, weight_version: int) -> None:
        while True:
            msg, _ = self._recv(weight_version, "begin")
            if isinstance(msg, Begin) and msg.request == self._request:
                return
            if isinstance(msg, Begin | BucketReady | End):  # of an earlier attempt at this weight_version
                logger.info("roller %s: dropping %s of an earlier attempt at weight_version %s", self.roller,
                            type(msg).__name__, weight_version)
                continue
            if not self._side.on_control(msg):
                raise ProtocolError(f"weight_version {weight_version}: expected Begin, got {msg}")

    def _recv(self, weight_version: int, what: str):
        """Next control message of this update; raises WeightSyncTimeout / WeightSyncAborted."""
        deadline = time.monotonic() + self.handle.timeout_s
        while True:
            if self._cancelled.is_set():
                raise WeightSyncAborted(f"roller {self.roller!r}: update to weight_version {weight_version} cancelled "
                                        "(the receiver was cancelled: its sender is gone)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncTimeout(f"roller {self.roller!r}: no {what} of weight_version {weight_version} from "
                                        f"{self.handle.control_address} within {self.handle.timeout_s:.1f} s")
            if not self._sock.poll(min(left, CANCEL_POLL_S) * 1000):
                continue
            header, *frames = self._sock.recv_multipart(copy=False)
            msg = decode(header.bytes)
            if isinstance(msg, Probe):
                continue
            if isinstance(msg, Abort):
                if msg.weight_version == weight_version and msg.request == self._request:
                    raise WeightSyncAborted(f"roller {self.roller!r}: update to weight_version {weight_version} "
                                            f"aborted by the sender: {msg.reason}")
                continue  # abort of an attempt this roller no longer waits for
            if getattr(msg, "weight_version", weight_version) != weight_version:
                logger.warning("roller %s: dropping %s of weight_version %s while waiting for %s",
                               self.roller, type(msg).__name__, msg.weight_version, weight_version)
                continue
            return msg, frames

    def _send(self, msg) -> None:
        self._sock.send(encode(msg))

    # --------------------------------------------------------------------------------- outcome

    def ack(self, weight_version: int, duration_s: float = 0.0) -> None:
        """Commit ``weight_version`` (the engine loaded it) and tell the sender."""
        self.weight_version = weight_version
        self._stats["num_updates"] += 1
        self._stats["last_update_s"] = duration_s
        self._stats["total_bytes"] += self._stats["last_bytes"]
        self._send(Ack(weight_version))

    def fail(self, weight_version: int, error: str) -> None:
        """Report a failed update of ``weight_version``; the committed weight_version stays."""
        self._stats["num_failures"] += 1
        self._stats["last_error"] = error
        self._send(Fail(weight_version, error))

    def cancel(self) -> None:
        """Make a ``receive`` waiting in another thread raise WeightSyncAborted within ``CANCEL_POLL_S``, and every
        later one at once (its sender is gone: a trainer restart gives the roller a new receiver). Thread-safe."""
        self._cancelled.set()

    def stats(self) -> dict:
        return {**self._stats, "roller": self.roller, "weight_version": self.weight_version}

    def close(self) -> None:
        """Release the socket and the backend's resources (shm mapping, broadcast group). Idempotent."""
        self._side.close()
        if self._sock is not None:
            self._sock.close(0)
            self._ctx.term()
            self._sock = None
