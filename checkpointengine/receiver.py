"""Receive side of the weight plane: ``WeightReceiver`` in each roller process and the ``apply_update``
driver (pause → receive and load every bucket → commit the version → flush the prefix cache → resume).

The receiver speaks the control protocol of ``checkpointengine.protocol`` over a ZMQ DEALER whose
identity is the roller's name, and fetches payloads from the backend the handle names: shm slots,
zmq frames, a broadcast group (joined when the sender asks), or safetensors files.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import zmq

from checkpointengine import broadcast as bc
from checkpointengine.bucket import BucketUnpacker
from checkpointengine.protocol import (
    Abort,
    Ack,
    Begin,
    BucketReady,
    Consumed,
    End,
    Fail,
    GroupInit,
    ProtocolError,
    Want,
    WeightSyncAborted,
    WeightSyncHandle,
    WeightSyncTimeout,
    decode,
    encode,
)
from checkpointengine.storage import ShmSlots, read_bucket_file

logger = logging.getLogger(__name__)


class WeightReceiver:
    """One roller's end of the weight plane. ``version``: the last committed ``weight_version``
    (``initial_version`` until the first update, e.g. 0 for weights loaded from the same checkpoint).

    ``receive(version)`` yields the update's tensors; the caller loads them, then calls ``ack`` or
    ``fail`` (``apply_update`` does all of it). Not thread-safe: one update at a time.
    """

    def __init__(self, handle: WeightSyncHandle, roller: str, device: str | torch.device = "cpu",
                 initial_version: int = 0):
        if not roller:
            raise ValueError("roller name must be non-empty")
        self.handle = handle
        self.roller = roller
        self.device = torch.device(device)
        self.version = initial_version
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, roller.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(handle.control_address)
        self._slots = None
        if handle.backend == "shm":
            self._slots = ShmSlots.attach(handle.shm_paths, handle.bucket_bytes)
        self._group: bc.WeightUpdateGroup | None = None
        self._pool: dict[str, torch.Tensor] | None = {} if handle.reuse_receive_buffers else None
        self._stats = {"num_updates": 0, "num_failures": 0, "last_update_s": 0.0, "last_bytes": 0,
                       "total_bytes": 0, "last_error": ""}

    # ---------------------------------------------------------------------------------- receiving

    def receive(self, version: int, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Ask the sender for ``version`` and yield its ``(engine_name, tensor)`` pairs.

        ``copy=False`` yields views into the shared slot for unchunked shm tensors, valid only until the
        next item is requested. With ``handle.reuse_receive_buffers`` (default) shm/zmq tensors reuse
        the previous update's memory: valid until the next update (engines copy them).

        Raises ValueError when ``version`` does not exceed the committed one, WeightSyncTimeout (naming
        the version and the sender) when a message does not come within ``timeout_s``,
        WeightSyncAborted when the sender aborts, ProtocolError on a malformed stream.
        """
        if version <= self.version:
            raise ValueError(f"roller {self.roller!r}: weight_version {version} does not exceed the "
                             f"committed {self.version}")
        self._send(Want(version, self.version))
        self._await_begin(version)
        unpacker = BucketUnpacker(self.device, self._pool)
        expected = 0
        num_bytes = 0
        while True:
            msg, frames = self._recv(version, f"bucket {expected}")
            if isinstance(msg, End):
                unpacker.finish()
                if msg.num_buckets != expected:
                    raise ProtocolError(f"weight_version {version}: got {expected} buckets, sender sent "
                                        f"{msg.num_buckets}")
                self._stats["last_bytes"] = num_bytes
                return
            if not isinstance(msg, BucketReady) or msg.index != expected:
                raise ProtocolError(f"weight_version {version}: expected bucket {expected}, got {msg}")
            expected += 1
            num_bytes += sum(e.nbytes for e in msg.entries)
            yield from self._bucket_tensors(msg, frames, unpacker, copy)

    def _bucket_tensors(self, msg: BucketReady, frames: list, unpacker: BucketUnpacker, copy: bool
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        backend = self.handle.backend
        if backend == "broadcast":
            entries = msg.entries
            out = bc.receive_tensors(self._group, [e.name for e in entries], [e.dtype for e in entries],
                                     [e.shape for e in entries])
        elif backend == "disk":
            out = list(read_bucket_file(msg.path, msg.entries, self.device))
        else:
            if backend == "zmq":
                if len(frames) != 1 or len(frames[0]) != msg.used_bytes:
                    raise ProtocolError(f"bucket {msg.index}: payload frame missing or of the wrong size")
                buffer = torch.frombuffer(frames[0].buffer, dtype=torch.uint8) if msg.used_bytes else \
                    torch.empty(0, dtype=torch.uint8)
                copy = True  # the frame is released with this bucket
            else:
                if not 0 <= msg.slot < len(self.handle.shm_paths):
                    raise ProtocolError(f"bucket {msg.index}: slot {msg.slot} out of range")
                buffer = self._slots.buffer(msg.slot)[: msg.used_bytes]
            if not copy:
                yield from unpacker.add(msg.entries, buffer, copy=False)
                self._send(Consumed(msg.version, msg.index))
                return
            out = list(unpacker.add(msg.entries, buffer, copy=True))
        self._send(Consumed(msg.version, msg.index))
        yield from out

    def _await_begin(self, version: int) -> None:
        while True:
            msg, _ = self._recv(version, "begin")
            if isinstance(msg, GroupInit):
                bc.destroy_group(self._group)
                self._group = bc.init_weights_update_group(
                    msg.master_address, msg.master_port, msg.rank_offset, msg.world_size, msg.group_name,
                    msg.backend, self.handle.timeout_s)
            elif isinstance(msg, Begin) and msg.version == version:
                return
            else:
                raise ProtocolError(f"weight_version {version}: expected Begin, got {msg}")

    def _recv(self, version: int, what: str):
        """Next control message of this update; raises WeightSyncTimeout / WeightSyncAborted."""
        deadline = time.monotonic() + self.handle.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(left * 1000):
                raise WeightSyncTimeout(f"roller {self.roller!r}: no {what} of weight_version {version} from "
                                        f"{self.handle.control_address} within {self.handle.timeout_s:.1f} s")
            header, *frames = self._sock.recv_multipart(copy=False)
            msg = decode(header.bytes)
            if isinstance(msg, Abort):
                if msg.version == version:
                    raise WeightSyncAborted(f"roller {self.roller!r}: update to weight_version {version} "
                                            f"aborted by the sender: {msg.reason}")
                continue  # abort of an update this roller no longer waits for
            if getattr(msg, "version", version) != version:
                logger.warning("roller %s: dropping %s of weight_version %s while waiting for %s",
                               self.roller, type(msg).__name__, msg.version, version)
                continue
            return msg, frames

    def _send(self, msg) -> None:
        self._sock.send(encode(msg))

    # --------------------------------------------------------------------------------- outcome

    def ack(self, version: int, duration_s: float = 0.0) -> None:
        """Commit ``version`` (the engine loaded it) and tell the sender."""
        self.version = version
        self._stats["num_updates"] += 1
        self._stats["last_update_s"] = duration_s
        self._stats["total_bytes"] += self._stats["last_bytes"]
        self._send(Ack(version))

    def fail(self, version: int, error: str) -> None:
        """Report a failed update of ``version``; the committed version stays."""
        self._stats["num_failures"] += 1
        self._stats["last_error"] = error
        self._send(Fail(version, error))

    def stats(self) -> dict:
        return {**self._stats, "roller": self.roller, "weight_version": self.version}

    def close(self) -> None:
        """Release the socket, the shm mapping and the broadcast group. Idempotent."""
        bc.destroy_group(self._group)
        self._group = None
        if self._slots is not None:
            self._slots.close()
            self._slots = None
        if self._sock is not None:
            self._sock.close(0)
            self._ctx.term()
            self._sock = None


class WeightUpdateError(RuntimeError):
    """A roller's update failed; it keeps ``kept_version``. The cause is chained."""

    def __init__(self, roller: str, version: int, kept_version: int, cause: BaseException):
        self.roller, self.version, self.kept_version = roller, version, kept_version
        super().__init__(f"roller {roller!r}: update to weight_version {version} failed, keeping "
                         f"{kept_version}: {type(cause).__name__}: {cause}")


@dataclass
class UpdateResult:
    roller: str
    version: int
    duration_s: float
    num_bytes: int


async def _flush(engine, pause_mode: str) -> None:
    """Flush the prefix cache. Requests kept by a ``retract``/``in_place`` pause make engines refuse a
    flush (SGLang does too); their KV is recomputed (retract) or deliberately kept (in_place), so the
    flush is skipped with a warning then. After an ``abort`` pause a refusal is an error."""
    try:
        await engine.flush_cache()
    except RuntimeError as exc:  # rollers.engine.EngineError (checkpointengine may not import rollers)
        if pause_mode == "abort":
            raise
        logger.warning("prefix cache not flushed after a %s pause: %s", pause_mode, exc)


async def apply_update(engine, receiver: WeightReceiver, version: int, pause_mode: str = "retract"
                       ) -> UpdateResult:
    """Update ``engine`` (a ``rollers.engine.Engine``) to ``version``: pause(``pause_mode``) → receive
    and load every bucket → commit the version → flush the prefix cache → resume → ack.

    The receive runs in a worker thread (it blocks on the socket) so the engine's event loop keeps
    serving. On any failure the engine keeps its old weights and version (``load_weights`` is atomic),
    is resumed, the error is reported to the sender, and WeightUpdateError is raised.
    """
    start = time.perf_counter()
    try:
        await engine.pause(pause_mode)
        tensors = await asyncio.to_thread(lambda: list(receiver.receive(version)))
        await engine.load_weights(tensors, version)
        await _flush(engine, pause_mode)
    except BaseException as exc:
        receiver.fail(version, f"{type(exc).__name__}: {exc}")
        try:
            await engine.resume()
        except Exception as resume_exc:  # the engine itself is broken; the update error is the news
            logger.error("roller %s: resume after a failed update failed: %s", receiver.roller, resume_exc)
        raise WeightUpdateError(receiver.roller, version, receiver.version, exc) from exc
    await engine.resume()
    duration = time.perf_counter() - start
    receiver.ack(version, duration)
    return UpdateResult(receiver.roller, version, duration, receiver.stats()["last_bytes"])
