"""Control messages of a weight update, the handle that tells each side where to meet, and errors.

One update of ``weight_version`` v between the sender (trainer rank 0) and each target roller::

    roller                         sender
      | -- Hello --------------->   |   once, on connecting
      | -- Want(v, have, q) ----->  |   roller paused and ready (shm attached / group joined)
      | <---------- Begin(v, q) --  |   after every target wants v (timeout names the missing ones)
      | <-- BucketReady(v, k) ----  |   payload: shm slot | zmq frame | broadcast | safetensors file
      | -- Consumed(v, k) ------->  |   the slot of bucket k may be reused (double buffering)
      | <--------------- End(v) --  |   or Abort(v, reason, q): the roller keeps its old weight_version
      | -- Ack(v) | Fail(v, e) -->  |   after load → commit → flush → resume
                                        (Broadcast only: GroupInit before Begin when the group changes.)
                                        (Probe, any time: receivers pass over it; see ``control``.)

``q`` (``request``) names one ``receive``: a fresh random number per Want, echoed by the Begin or Abort that
answers it. The controller may retry a weight_version whose first attempt failed (``RollerPool.push_weights``),
so a roller can find the Abort of an attempt it already gave up on queued ahead of its retry's Begin; it takes
only the Begin and Abort of its own request (and, the sender's attempts being sequential on one socket, every
message after its Begin is of its attempt).

Headers are msgpack maps ``{"type": ..., fields}``; payloads are raw frames or shared memory. No pickle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from checkpointengine.backend import NoFields, WeightSyncBackend, get_backend
from checkpointengine.bucket import TensorEntry
from common.curve import CurveKeys


class WeightSyncError(RuntimeError):
    """An update failed on some rollers; ``failures`` maps roller → reason, ``weight_version`` is the update."""

    def __init__(self, weight_version: int, failures: dict[str, str]):
        self.weight_version = weight_version
        self.failures = dict(failures)
        detail = "; ".join(f"{r}: {e}" for r, e in sorted(failures.items()))
        super().__init__(f"weight update to weight_version {weight_version} failed on {sorted(failures)}: "
                         f"{detail}")

    def __reduce__(self):  # rebuilt from its own arguments: a Ray actor's exception reaches the caller intact
        return type(self), (self.weight_version, self.failures)


class WeightSyncTimeout(TimeoutError):
    """A wait of an update ran past its timeout (the message names the peer and the weight_version)."""


class WeightSyncAborted(RuntimeError):
    """The sender aborted an update; the roller keeps its old weight_version."""


NO_REQUEST = -1


class ProtocolError(RuntimeError):
    """A malformed or unexpected control message."""


@dataclass(frozen=True)
class Want:
    weight_version: int
    have: int
    request: int


@dataclass(frozen=True)
class Begin:
    weight_version: int
    request: int


@dataclass(frozen=True)
class BucketReady:
    """Bucket ``index`` is ready; where its bytes are is the backend's business: shm ``slot`` (shm), the
    next frame (zmq), broadcast tensor by tensor (broadcast), file ``path`` (disk)."""

    weight_version: int
    index: int
    entries: list[TensorEntry]
    used_bytes: int
    slot: int = -1
    path: str = ""


@dataclass(frozen=True)
class End:
    weight_version: int
    num_buckets: int
    total_bytes: int


@dataclass(frozen=True)
class Abort:
    """``request``: the Want it answers; ``NO_REQUEST`` when the sender had none from this roller in the
    attempt (the roller's own timeout then ends its wait)."""

    weight_version: int
    reason: str
    request: int


@dataclass(frozen=True)
class Hello:
    """A receiver's first message, on connecting: the sender knows the roller was connected (``Probe``)."""


@dataclass(frozen=True)
class Probe:
    """Sent by the sender only to learn whether a roller still has a connection (a roller's process that
    exits closes it: ``control.ControlServer``); receivers pass over it."""


@dataclass(frozen=True)
class Consumed:
    weight_version: int
    index: int


@dataclass(frozen=True)
class Ack:
    weight_version: int


@dataclass(frozen=True)
class Fail:
    weight_version: int
    error: str


@dataclass(frozen=True)
class GroupInit:
    """Join a broadcast group (SGLang's ``init_weights_update_group`` arguments)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


MESSAGES = {cls.__name__: cls
            for cls in (Hello, Want, Begin, BucketReady, End, Abort, Probe, Consumed, Ack, Fail, GroupInit)}


def encode(msg) -> bytes:
    """msgpack header of a control message."""
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    if isinstance(msg, BucketReady):
        body["entries"] = [e.to_wire() for e in msg.entries]
    body["type"] = type(msg).__name__
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes):
    """Inverse of ``encode``; raises ProtocolError for anything that is not a known message."""
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"undecodable control message ({len(data)} bytes): {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError(f"control message is a {type(body).__name__}, not a map")
    cls = MESSAGES.get(body.pop("type", None))
    if cls is None:
        raise ProtocolError(f"unknown control message type in {sorted(body)}")
    try:
        if cls is BucketReady:
            body["entries"] = [TensorEntry.from_wire(e) for e in body["entries"]]
        return cls(**body)
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"malformed {cls.__name__} message: {exc}") from exc


@dataclass
class WeightSyncHandle:
    """Where the two sides meet; small and serialisable (``to_dict``/``from_dict``), made by the sender.

    ``backend``: the backend's registered name (or ``module:name``); ``control_address``: the sender's
    ZMQ ROUTER; ``reuse_receive_buffers``: rollers copy packed buckets into the previous update's
    tensors; ``fields``: the backend's own typed fields (e.g. ``ShmFields(shm_paths)``), see
    ``checkpointengine.backend``; ``curve``: with ``checkpointengine.curve``, the control socket's CURVE
    keys as a client needs them (the server's public key and the job's client key pair, no server
    secret; ``common.curve``), else None. The handle reaches rollers through Ray, never over the socket.
    """

    backend: str
    control_address: str
    bucket_bytes: int
    engine_dtype: str
    timeout_s: float
    reuse_receive_buffers: bool = True
    fields: Any = field(default_factory=NoFields)
    curve: CurveKeys | None = None

    @property
    def plugin(self) -> WeightSyncBackend:
        """The registered backend this handle names (raises ValueError for an unknown one)."""
        return get_backend(self.backend, "handle.backend")

    def to_dict(self) -> dict:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("fields", "curve")}
        body["fields"] = dataclasses.asdict(self.fields)
        body["curve"] = dataclasses.asdict(self.curve) if self.curve is not None else None
        return body

    @classmethod
    def from_dict(cls, data: dict) -> WeightSyncHandle:
        """Inverse of ``to_dict``; raises ValueError for an unknown backend, fields that are not its, or
        malformed ``curve`` keys."""
        data = dict(data)
        fields = data.pop("fields", {})
        curve = data.pop("curve", None)
        if curve is not None:
            try:
                curve = CurveKeys(**curve)
            except TypeError as exc:
                raise ValueError(f"handle curve keys {sorted(curve)}: {exc}") from exc
        handle = cls(**data, curve=curve)
        handle.fields = handle.plugin.fields_from_dict(fields)
        return handle
