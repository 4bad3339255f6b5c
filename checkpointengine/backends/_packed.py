"""Shared by ``shm`` and ``zmq``: byte buckets packed by ``BucketPlanner`` into a ring of slot buffers.

The sender side places ``(engine_name, item)`` pairs (full tensors or ``RowShard`` rows) and writes each
entry into slot ``bucket % num_slots``; before reusing a slot the leader waits until every roller
consumed its previous bucket (double buffering). The receiver side unpacks one bucket's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from checkpointengine.backend_sides import BackendReceiver, BackendSender, Body
from checkpointengine.bucket import Bucket, BucketPlanner, BucketUnpacker, TensorEntry, write_full, write_rows
from checkpointengine.control import Round
from checkpointengine.naming import engine_dtype_of
from checkpointengine.protocol import BucketReady


class PackedSender(BackendSender):
    """A sender whose buckets live in ``num_slots`` byte buffers; subclasses give ``buffer(slot)`` and
    ``publish`` (how a closed bucket is announced: a slot index, or the bytes as a frame)."""

    num_slots: int

    def buffer(self, slot: int) -> torch.Tensor:
        raise NotImplementedError

    def publish(self, sender, rnd: Round, bucket: Bucket, slot: int) -> None:
        raise NotImplementedError

    def full_body(self, sender, stream) -> Body:
        return lambda rnd: _SlotPacker(self, sender, rnd, write_full, lambda t: (t.dtype, t.shape), None).run(stream)

    def shard_body(self, sender, stream, agree) -> Body:
        spec = lambda s: (s.tensor.dtype, s.full_shape)  # noqa: E731
        return lambda rnd: _SlotPacker(self, sender, rnd, write_rows, spec, agree).run(stream)


class _SlotPacker:
    """One update on one rank (``write(buffer, entry, item)``; ``spec(item)`` gives the item's dtype and
    full shape). With several ranks, all agree at every slot reuse and bucket close, so an error on any
    rank (kept until the next agreement) raises on all of them at the same point."""

    def __init__(self, side: PackedSender, sender, rnd: Round, write: Callable, spec: Callable,
                 agree: Callable[[bool], bool] | None):
        self.side, self.sender, self.rnd, self.write, self.spec, self.agree = side, sender, rnd, write, spec, agree
        self.bucket = -1
        self.item = None
        self.error: BaseException | None = None

    def buffer(self, index: int) -> torch.Tensor:
        return self.side.buffer(index % self.side.num_slots)

    def sync(self, point: str) -> None:
        ok = self.error is None
        if self.agree is not None and not self.agree(ok):
            raise self.error or RuntimeError(f"another trainer rank failed ({point})")
        if not ok:
            raise self.error

    def on_write(self, index: int, entry: TensorEntry) -> None:
        if index != self.bucket:
            self.bucket = index
            if index >= self.side.num_slots:
                try:
                    if self.sender.is_leader:
                        self.sender.control.await_consumed(self.rnd, index - self.side.num_slots)
                except Exception as exc:  # reported to every rank at the agreement below
                    self.error = exc
                self.sync(f"reusing the slot of bucket {index - self.side.num_slots}")
        if self.error is None:
            try:
                self.write(self.buffer(index), entry, self.item)
            except Exception as exc:
                self.error = exc

    def on_close(self, bucket: Bucket) -> None:
        self.sync(f"closing bucket {bucket.index}")
        if self.sender.is_leader:
            self.side.publish(self.sender, self.rnd, bucket, bucket.index % self.side.num_slots)

    def run(self, stream) -> tuple[int, int]:
        """Pack everything; returns (buckets, payload bytes)."""
        planner = BucketPlanner(self.sender.handle.bucket_bytes, self.on_close)
        sent = []
        for name, item in stream:
            dtype, shape = self.spec(item)
            self.item = item
            wire_dtype = engine_dtype_of(torch.empty(0, dtype=dtype), self.sender.engine_dtype)
            planner.place(name, wire_dtype, tuple(shape), self.on_write)
            sent.append(name)
        try:
            self.sender.mapper.check_coverage(sent)
        except Exception as exc:
            self.error = self.error or exc
        planner.finish()
        self.sync("end of update")
        return planner.num_buckets, planner.total_bytes


class PackedReceiver(BackendReceiver):
    """A receiver that unpacks byte buckets; subclasses give ``payload(msg, frames)`` (the bucket's
    bytes, and whether they stay valid after ``consumed``)."""

    def payload(self, msg: BucketReady, frames: list) -> tuple[torch.Tensor, bool]:
        raise NotImplementedError

    def bucket_tensors(self, msg: BucketReady, frames: list, unpacker: BucketUnpacker, copy: bool,
                       consumed: Callable[[], None]) -> Iterator[tuple[str, torch.Tensor]]:
        buffer, stable = self.payload(msg, frames)
        if not copy and stable:
            yield from unpacker.add(msg.entries, buffer, copy=False)
            consumed()
            return
        out = list(unpacker.add(msg.entries, buffer, copy=True))
        consumed()
        yield from out
