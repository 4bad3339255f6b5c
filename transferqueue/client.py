"""The TransferQueue client: ``put``, ``get_meta``, ``get_data``, ``get``, ``clear``, ``reset_consumption``,
``status`` — each as a sync method and an ``a``-prefixed coroutine, sharing one flow (see ``transport``).

::

    put:      [index.prepare_put (given ids)] -> per unit, in parallel: [alloc] -> memcpy into the shm
              block -> put (its reply leases the block for the next put) -> index.notify (fields ready)
    get_meta: index.get_meta (long-poll; ids + tags only)
    get_data: per unit, in parallel: get -> runs in shm blocks / raw frames -> one copy into new tensors

Samples live on unit ``(id // route_block) % num_units``. Same-node units get data through shared memory
(one memcpy each way, ZMQ carries only control, over the servers' ``ipc://`` endpoints); others through
raw ZMQ frames over TCP (zero-copy send). A steady stream of shared-memory puts of fresh samples costs
two round trips each (unit, index); ``reserve`` of fresh ids happens once per ``RESERVE_IDS`` samples.
"""

from __future__ import annotations

import struct
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from common.node import node_id
from transferqueue import wire
from transferqueue.buffers import BufferPool, ShmCache, assemble_field
from transferqueue.config import MIN_REQUEST_IDS
from transferqueue.records import Batch, BatchMeta, Consume, Full, IndexStats, RemoteError, TQError, TQHandle
from transferqueue.shm_layout import HEADER, aligned
from transferqueue.spares import Asked, SpareBlocks
from transferqueue.transport import INDEX, AsyncDriver, Call, Flow, Sleep, SyncDriver

FULL_RETRY_S = 0.01
RESERVE_IDS = MIN_REQUEST_IDS  # sample ids a client reserves from the index at a time (4096)


class TQClient:
    """Client of one TransferQueue (built from the controller's ``TQHandle``); thread-safe, reusable."""

    def __init__(self, handle: TQHandle, device: str | torch.device | None = None):
        """``device``: move tensor fields over the units' p2p path (``handle.p2p_backend``: NCCL for a CUDA
        device, gloo for ``cpu``) and return them on this device; None uses shared memory / ZMQ frames.
        Raises ValueError when a device is given but the TransferQueue has no p2p path."""
        self.handle = handle
        self.device = None if device is None else torch.device(device)
        if self.device is not None and not handle.p2p_backend:
            raise ValueError("a client device needs transferqueue.p2p_backend set (gloo or nccl)")
        if self.device is not None and handle.p2p_backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"p2p_backend nccl needs a CUDA client device, got {self.device}")
        self.links: dict = {}
        self._ids_lock = threading.Lock()
        self._id_next = self._id_end = 0
        self._ids_lapse = 0.0  # monotonic time the index drops this client's reserved range
        self._ids_lease_s = float("inf")  # the index's reservation lease, once a reply told it
        self.spares = SpareBlocks()
        self.num_units = len(handle.unit_addresses)
        here = node_id()
        self.local = [handle.shared_memory and n == here for n in handle.unit_nodes]
        self.shm = ShmCache()
        self.buffers = BufferPool()
        self._sync = SyncDriver(handle)
        self._async = AsyncDriver(handle)

    # ---------------------------------------------------------------------------------- routing
    def units_of(self, sample_ids: Sequence[int]) -> list[tuple[int, np.ndarray]]:
        """``(unit, positions)`` for each unit holding some of ``sample_ids`` (positions in order)."""
        if self.num_units == 1:
            return [(0, np.arange(len(sample_ids)))] if len(sample_ids) else []
        ids = np.asarray(sample_ids, dtype=np.int64)
        units = (ids // self.handle.route_block) % self.num_units
        return [(u, np.flatnonzero(units == u)) for u in range(self.num_units) if (units == u).any()]

    # -------------------------------------------------------------------------------------- put
    def _put_flow(self, data: Mapping[str, Any], partition: str, sample_ids: Sequence[int] | None,
                  tags: Sequence[Mapping] | None, timeout_s: float, consume: Consume | None = None) -> Flow:
        count = wire.batch_size(data)
        if tags is not None and len(tags) != count:
            raise ValueError(f"{len(tags)} tag dicts for {count} samples")
        if sample_ids is not None and len(sample_ids) != count:
            raise ValueError(f"{len(sample_ids)} sample_ids for {count} samples")
        names = list(data)
        if sample_ids is None:
            ids = yield from self._new_ids(count, timeout_s + self.handle.request_timeout_s)
        else:
            ids = [int(i) for i in sample_ids]
            yield [Call(INDEX, {"op": "prepare_put", "partition": partition, "ids": ids, "count": count,
                                "fields": names})]
        stored: list[int] = []
        try:
            columns = yield from self._store(data, names, ids, timeout_s, stored)
            notify = {"op": "notify", "partition": partition, "ids": ids, "columns": columns, "new": sample_ids is None,
                      "tags": None if tags is None else [dict(t) for t in tags], "consume": consume and consume.to_wire()}
            yield [Call(INDEX, notify)]
        except Exception:
            yield from self._undo(partition, ids, names, stored, new=sample_ids is None)
            raise
        return BatchMeta(partition, ids, names, [dict(t) for t in tags] if tags is not None else [{}] * count)

    def _new_ids(self, count: int, budget_s: float) -> Flow:
        """Fresh sample ids from this client's reserved range, reserving ``max(count, RESERVE_IDS)`` more
        from the index when it runs out (one round trip per many puts), or when the put, which may take
        ``budget_s``, could outlast the range's lease (``transferqueue.reservation_lease_s``: the index
        then drops the range, and a notify naming its ids would be refused)."""
        now = time.monotonic()
        with self._ids_lock:
            if self._id_end - self._id_next >= count and now + budget_s < self._ids_lapse:
                self._id_next += count
                return list(range(self._id_next - count, self._id_next))
        # puts this long could never use a range's rest: reserve just this put's ids, leaving none to lapse
        n = count if budget_s >= self._ids_lease_s else max(count, RESERVE_IDS)
        [(head, _)] = yield [Call(INDEX, {"op": "reserve", "count": n})]
        start, lapse = head["start"], now + head["lease_s"]  # ``now``: before the index started the lease
        with self._ids_lock:
            self._id_next, self._id_end, self._ids_lapse = start + count, start + n, lapse
            self._ids_lease_s = head["lease_s"]
        return list(range(start, start + count))

    def _store(self, data, names, ids, timeout_s, stored: list[int]) -> Flow:
        """Send each unit its rows; retry units that answer ``full`` until the deadline. Returns the
        columns (descriptors over all samples, in ``ids`` order) for the index."""
        if self.device is not None:
            yield from self._store_p2p(data, names, ids, stored)
            return wire.index_columns(data, names, len(ids))
        deadline = time.monotonic() + timeout_s
        pending = {}
        for unit, pos in self.units_of(ids):
            encoded = [wire.encode_column(n, wire.rows(data[n], pos), len(pos)) for n in names]
            pending[unit] = ([ids[i] for i in pos.tolist()], encoded)
        asked = Asked()  # the units whose next spare block this flow asked for; its marker in self.spares
        try:
            while pending:
                yield from self._store_round(pending, stored, asked)
                if pending:
                    if time.monotonic() > deadline:
                        raise Full(f"storage units {sorted(pending)} stayed full for {timeout_s} s")
                    yield Sleep(FULL_RETRY_S)
        finally:
            self.spares.release(asked)
        return wire.index_columns(data, names, len(ids))

    def _store_round(self, pending: dict, stored: list[int], asked: Asked) -> Flow:
        """One attempt for every pending unit: frames (remote unit or small put), a put into a spare block
        (one round trip), or alloc then put (two). Units that answered ``full`` stay pending. ``stored``
        gets every unit a put went to unless it answered with an error (no answer: it may still store, so
        the flow's undo must clear it too)."""
        calls, failed = [], []
        for unit, (sub_ids, encoded) in pending.items():
            nbytes = sum(d["nbytes"] for d, _ in encoded)
            if not self.local[unit] or nbytes < self.handle.shm_min_bytes:
                calls.append(Call(unit, {"op": "put", "ids": sub_ids, "columns": [d for d, _ in encoded]},
                                  [b for _, bufs in encoded for b in bufs]))
                continue
            need = HEADER + sum(aligned(d["nbytes"]) for d, _ in encoded)
            block = self.spares.take(unit, need)
            if block is not None:
                try:
                    calls.append(self._write_block(unit, block, sub_ids, encoded, asked, failed))
                    continue
                except FileNotFoundError:  # the unit took the spare back to make room (and unlinked it)
                    pass
            calls.append(Call(unit, {"op": "alloc", "nbytes": need}))
        commits = []
        for call, reply in zip(calls, (yield from self._sent(calls, stored, failed)), strict=True):
            if isinstance(reply, Exception):
                continue
            if call.header["op"] != "alloc":
                self._stored(call.target, reply[0], pending)
            elif failed:  # no put follows: keep the block as this client's spare if it has none
                self.spares.keep(call.target, reply[0])
            else:
                sub_ids, encoded = pending[call.target]
                commits.append(self._write_block(call.target, reply[0]["block"], sub_ids, encoded, asked, failed))
        if commits:
            for call, reply in zip(commits, (yield from self._sent(commits, stored, failed)), strict=True):
                if not isinstance(reply, Exception):
                    self._stored(call.target, reply[0], pending)
        if failed:  # raised once every reply of the round is in, so the flow's undo reaches every unit
            raise failed[0]

    def _sent(self, calls: list[Call], stored: list[int], failed: list) -> Flow:
        """Send ``calls`` together; returns every reply, error replies as exception objects. A put's unit
        is in ``stored`` from the send until it answers with an error. ``Full`` is retried later (a
        shared-memory block it names is gone: unmapped here); any other error is appended to ``failed``."""
        for call in calls:
            call.tolerate = True
            if call.header["op"] == "put":
                stored.append(call.target)
        replies = yield calls
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, Exception) and call.header["op"] == "put":
                stored.remove(call.target)
                if isinstance(reply, Full) and "shm" in call.header:
                    self.shm.forget(call.header["shm"]["block"])
        failed.extend(r for r in replies if isinstance(r, Exception) and not isinstance(r, Full))
        return replies

    def _stored(self, unit: int, head: dict, pending: dict) -> None:
        del pending[unit]
        lease = head.get("lease")
        if lease is not None:
            self.spares.replace(unit, lease)

    def _write_block(self, unit: int, block: str, sub_ids: list[int], encoded: list, asked: Asked,
                     failed: list) -> Call:
        """The put that hands ``block`` to ``unit``, which copies the columns into the block right after it is
        sent, while the unit registers it (the unit never reads the bytes, and nobody can ask for them before
        the index is notified, after the reply). A copy error lands in ``failed``. The put asks for the next
        spare block when this client holds none for ``unit`` (and the put is not too big to keep one).
        Raises FileNotFoundError when the block is gone (a spare the unit took back)."""
        view = self.shm.view(block)
        offsets, off = [], HEADER
        for desc, _ in encoded:
            offsets.append(off)
            desc["split"] = False
            off += aligned(desc["nbytes"])

        def copy() -> None:
            try:
                for (_, bufs), start in zip(encoded, offsets, strict=True):
                    for b in bufs:
                        np.copyto(view[start:start + len(b)], b if isinstance(b, np.ndarray) else np.frombuffer(b, np.uint8))
                        start += len(b)
            except BaseException as exc:  # raised after the reply, so the flow knows to undo this unit's put
                failed.append(exc)

        header = {"op": "put", "ids": sub_ids, "columns": [d for d, _ in encoded],
                  "shm": {"block": block, "offsets": offsets}}
        if self.spares.ask(unit, off, asked):
            header["lease"] = off
        return Call(unit, header, after_send=copy)

    def _link(self, unit: int) -> Flow:
        """This client's p2p link to ``unit`` (joined on first use), locked for the caller's request."""
        from transferqueue.p2p import client_join

        link = self.links.get(unit)
        if link is None:
            link_id = uuid.uuid4().hex
            [(head, _)] = yield [Call(unit, {"op": "p2p_connect", "link": link_id, "node": node_id(),
                                             "backend": self.handle.p2p_backend})]
            link = self.links[unit] = client_join(self.handle.p2p_backend, head, link_id,
                                                  self.handle.request_timeout_s, self.device)
        while not link.lock.acquire(blocking=False):
            yield Sleep(0.001)
        return link

    def _drop_link(self, unit: int) -> None:
        link = self.links.pop(unit, None)
        if link is not None:
            link.abort()

    def _store_p2p(self, data, names, ids, stored: list[int]) -> Flow:
        from transferqueue.p2p import encode_device_column

        for unit, pos in self.units_of(ids):
            encoded = [encode_device_column(n, wire.rows(data[n], pos), len(pos), self.device) for n in names]
            link = yield from self._link(unit)
            tensors = [t for _, t in encoded]
            stored.append(unit)  # until it answers with an error: no answer means it may still store
            try:
                yield [Call(unit, {"op": "put", "ids": [ids[i] for i in pos.tolist()], "p2p": link.id,
                                   "columns": [d for d, _ in encoded]},
                            after_send=lambda link=link, tensors=tensors: [w.wait() for w in link.send(tensors)])]
            except (TQError, RuntimeError) as exc:
                if isinstance(exc, RemoteError):
                    stored.remove(unit)
                else:
                    self._drop_link(unit)  # a transfer failed half-way: the link's order is lost
                raise
            finally:
                link.lock.release()

    def _undo(self, partition, ids, names, stored, new: bool) -> Flow:
        calls = [Call(u, {"op": "clear", "ids": [ids[i] for i in pos.tolist()], "fields": names})
                 for u, pos in self.units_of(ids) if u in stored]
        if new:  # usually a no-op (notify failed before creating them); ids are never reused either way
            calls.append(Call(INDEX, {"op": "clear", "partition": partition, "ids": ids}))
        try:
            if calls:
                yield calls
        except Exception:  # best effort: the original error is what the caller needs
            pass

    # --------------------------------------------------------------------------------- get_meta
    def _get_meta_flow(self, fields, batch_size, task, partition, sampler, options, timeout_s) -> Flow:
        [(head, _)] = yield [Call(INDEX, {"op": "get_meta", "partition": partition, "fields": list(fields),
                                          "batch_size": batch_size, "task": task, "sampler": sampler,
                                          "options": dict(options or {}), "timeout_s": float(timeout_s)})]
        return BatchMeta.from_wire(head["meta"])

    # --------------------------------------------------------------------------------- get_data
    def _get_data_flow(self, meta: BatchMeta, fields: Sequence[str] | None) -> Flow:
        names = list(fields if fields is not None else meta.fields)
        if not names:
            raise ValueError("get_data needs at least one field")
        if not len(meta):
            return Batch(meta, {n: [] for n in names})
        routes = self.units_of(meta.sample_ids)
        calls = [Call(u, {"op": "get", "ids": [meta.sample_ids[i] for i in pos.tolist()], "fields": names,
                          "shm": self.local[u] and self.device is None}) for u, pos in routes]
        if self.device is None:
            replies = yield calls
            received = [[] for _ in routes]
        else:
            replies, received = yield from self._get_p2p(routes, calls)
        try:
            filled = [self._assemble(j, n, len(meta), routes, replies, received) for j, n in enumerate(names)]
            self.shm.check_leases(replies)  # before decoding: a raced block may hold another put's bytes
            values = [wire.decode_column(desc, out) for desc, out in filled]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, struct.error) as exc:
            # a reply that does not add up: only the project's typed errors leave the client
            raise RemoteError(f"get_data: malformed reply from a storage unit: {type(exc).__name__}: {exc}") from exc
        return Batch(meta, dict(zip(names, values, strict=True)))

    def _get_p2p(self, routes, calls: list[Call]) -> Flow:
        """Send the gets with this client's links, then receive every ``p2p`` run of the replies in order."""
        links = []
        try:
            for u, _ in routes:
                links.append((yield from self._link(u)))
            for call, link in zip(calls, links, strict=True):
                call.header["p2p"] = link.id
            try:
                replies = yield calls
                received = []
                for (head, _), link in zip(replies, links, strict=True):
                    bufs = [torch.empty(run[2], dtype=torch.uint8, device=self.device)
                            for col in head["columns"] for run in col["runs"] if run[0] == "p2p"]
                    for work in link.recv(bufs):
                        work.wait()
                    received.append(bufs)
            except (TQError, RuntimeError):
                for u, _ in routes:
                    self._drop_link(u)  # a unit may have started sends nobody will receive
                raise
            return replies, received
        finally:
            for link in links:
                link.lock.release()

    def _assemble(self, j: int, name: str, count: int, routes, replies, received) -> tuple[dict, Any]:
        """Copy field ``name`` of the replies into one new buffer: ``(descriptor, buffer)``, not decoded yet."""
        def alloc(nbytes: int, dtype: str):
            if self.device is not None and dtype != wire.OBJECT_DTYPE:
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return self.buffers.take(nbytes)

        return assemble_field(j, name, count, routes, replies, received, alloc, self.shm)

    # ----------------------------------------------------------------------------- maintenance
    def _clear_flow(self, partition: str, sample_ids: Sequence[int] | None) -> Flow:
        ids = None if sample_ids is None else [int(i) for i in sample_ids]
        [(head, _)] = yield [Call(INDEX, {"op": "clear", "partition": partition, "ids": ids})]
        removed = head["ids"]
        calls = [Call(u, {"op": "clear", "ids": [removed[i] for i in pos.tolist()]})
                 for u, pos in self.units_of(removed)] if removed else []
        if calls:
            yield calls
        return len(removed)

    def _simple_flow(self, target: int, header: dict, key: str | None) -> Flow:
        [(head, _)] = yield [Call(target, header)]
        return head.get(key) if key else None

    # ------------------------------------------------------------------------------ public API
    def put(self, data: Mapping[str, Any], partition: str, sample_ids: Sequence[int] | None = None,
            tags: Sequence[Mapping] | None = None, timeout_s: float | None = None,
            consume: Consume | None = None) -> BatchMeta:
        """Store a batch and mark its fields ready; returns its BatchMeta (with the sample ids).

        ``data``: field name -> tensor ``(batch, *shape)`` | list of ``batch`` tensors (variable shapes) |
        list of ``batch`` msgpack-able objects (strings, numbers, small dicts). ``sample_ids``: None to
        create new samples in ``partition``, else existing ids to add fields to (fields are write-once).
        ``tags``: one dict per sample (``uid``, weight versions, lengths), merged into the sample's tags.
        ``consume``: samples of another partition this put answers (``records.Consume``), marked consumed by
        its task in the same index step that makes the put ready (ids already cleared are skipped).
        Raises ValueError/TypeError for bad input, RemoteError when the index rejects it (unknown/cleared
        ids, field already written, dtype change), Full when a unit stays full for ``timeout_s``
        (default: the handle's request timeout; nothing of a failed put is kept), Timeout, Closed.
        """
        t = self._timeout(timeout_s)
        return self._sync.run(self._put_flow(data, partition, sample_ids, tags, t, consume),
                              t + self.handle.request_timeout_s)

    async def aput(self, data: Mapping[str, Any], partition: str, sample_ids: Sequence[int] | None = None,
                   tags: Sequence[Mapping] | None = None, timeout_s: float | None = None,
                   consume: Consume | None = None) -> BatchMeta:
        """Async ``put``."""
        t = self._timeout(timeout_s)
        return await self._async.run(self._put_flow(data, partition, sample_ids, tags, t, consume),
                                     t + self.handle.request_timeout_s)

    def get_meta(self, fields: Sequence[str], batch_size: int, task: str, partition: str,
                 sampler: str = "sequential", options: Mapping | None = None, timeout_s: float = 0.0) -> BatchMeta:
        """Take ``batch_size`` samples whose ``fields`` are all ready and that ``task`` has not consumed,
        chosen by ``sampler`` (``sequential`` | ``group_complete`` | ``seqlen_balanced`` | registered), and
        mark them consumed by ``task``. ``timeout_s`` 0: answer at once; > 0: long-poll up to that long.
        An unfilled request returns an empty BatchMeta whose ``reason`` says why (e.g. "insufficient
        complete groups"). Raises RemoteError for a bad batch size, sampler or options."""
        flow = self._get_meta_flow(fields, batch_size, task, partition, sampler, options, timeout_s)
        return self._sync.run(flow, timeout_s + self.handle.request_timeout_s)

    async def aget_meta(self, fields: Sequence[str], batch_size: int, task: str, partition: str,
                        sampler: str = "sequential", options: Mapping | None = None,
                        timeout_s: float = 0.0) -> BatchMeta:
        """Async ``get_meta``."""
        flow = self._get_meta_flow(fields, batch_size, task, partition, sampler, options, timeout_s)
        return await self._async.run(flow, timeout_s + self.handle.request_timeout_s)

    def get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Batch:
        """Fetch ``fields`` (default ``meta.fields``) of ``meta``'s samples, in ``meta`` order, as a Batch of
        writable tensors the caller owns (see ``Batch`` for fixed vs variable-length fields). Raises
        RemoteError when a field is missing or was cleared, Timeout."""
        return self._sync.run(self._get_data_flow(meta, fields), self.handle.request_timeout_s)

    async def aget_data(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Batch:
        """Async ``get_data``."""
        return await self._async.run(self._get_data_flow(meta, fields), self.handle.request_timeout_s)

    def get(self, fields: Sequence[str], batch_size: int, task: str, partition: str, sampler: str = "sequential",
            options: Mapping | None = None, timeout_s: float = 0.0) -> Batch:
        """``get_meta`` then ``get_data`` (an empty Batch, with ``meta.reason``, when nothing was ready)."""
        meta = self.get_meta(fields, batch_size, task, partition, sampler, options, timeout_s)
        return self.get_data(meta)

    async def aget(self, fields: Sequence[str], batch_size: int, task: str, partition: str,
                   sampler: str = "sequential", options: Mapping | None = None, timeout_s: float = 0.0) -> Batch:
        """Async ``get``."""
        meta = await self.aget_meta(fields, batch_size, task, partition, sampler, options, timeout_s)
        return await self.aget_data(meta)

    def clear(self, partition: str, sample_ids: Sequence[int] | None = None) -> int:
        """Remove samples (the whole partition when ``sample_ids`` is None) from the index and the units;
        idempotent; returns how many were removed now. Cleared ids are never served again."""
        return self._sync.run(self._clear_flow(partition, sample_ids), self.handle.request_timeout_s)

    async def aclear(self, partition: str, sample_ids: Sequence[int] | None = None) -> int:
        """Async ``clear``."""
        return await self._async.run(self._clear_flow(partition, sample_ids), self.handle.request_timeout_s)

    def reset_consumption(self, partition: str, task: str) -> None:
        """Make every sample of ``partition`` unconsumed for ``task`` again (idempotent)."""
        flow = self._simple_flow(INDEX, {"op": "reset_consumption", "partition": partition, "task": task}, None)
        self._sync.run(flow, self.handle.request_timeout_s)

    async def areset_consumption(self, partition: str, task: str) -> None:
        """Async ``reset_consumption``."""
        flow = self._simple_flow(INDEX, {"op": "reset_consumption", "partition": partition, "task": task}, None)
        await self._async.run(flow, self.handle.request_timeout_s)

    def status(self) -> IndexStats:
        """Production/consumption counts of the index (metadata only)."""
        stats = self._sync.run(self._simple_flow(INDEX, {"op": "stats"}, "stats"), self.handle.request_timeout_s)
        return IndexStats(**stats)

    async def astatus(self) -> IndexStats:
        """Async ``status``."""
        stats = await self._async.run(self._simple_flow(INDEX, {"op": "stats"}, "stats"),
                                      self.handle.request_timeout_s)
        return IndexStats(**stats)

    def sample_info(self, partition: str, sample_ids: Sequence[int] | None = None, limit: int = 1000) -> list[dict]:
        """Per sample: ``{"id", "fields" (ready), "tags", "consumed_by"}`` — metadata only, consumes nothing."""
        header = {"op": "sample_info", "partition": partition, "limit": limit,
                  "ids": None if sample_ids is None else [int(i) for i in sample_ids]}
        return self._sync.run(self._simple_flow(INDEX, header, "samples"), self.handle.request_timeout_s)

    async def asample_info(self, partition: str, sample_ids: Sequence[int] | None = None,
                           limit: int = 1000) -> list[dict]:
        """Async ``sample_info``."""
        header = {"op": "sample_info", "partition": partition, "limit": limit,
                  "ids": None if sample_ids is None else [int(i) for i in sample_ids]}
        return await self._async.run(self._simple_flow(INDEX, header, "samples"), self.handle.request_timeout_s)

    def unit_stats(self, unit: int) -> dict:
        """Byte and request counters of storage unit ``unit``."""
        return self._sync.run(self._unit_stats_flow(unit), self.handle.request_timeout_s)

    def _unit_stats_flow(self, unit: int) -> Flow:
        [(head, _)] = yield [Call(unit, {"op": "stats"})]
        return {k: v for k, v in head.items() if k not in ("ok", "rid")}

    def _timeout(self, timeout_s: float | None) -> float:
        t = self.handle.request_timeout_s if timeout_s is None else timeout_s
        if t < 0:
            raise ValueError(f"timeout_s must be >= 0, got {t}")
        return t

    def close(self) -> None:
        """Close every socket and mapping; later calls raise Closed."""
        self._sync.close()
        self._async.close()
        self.shm.close()
        self.buffers.clear()

    def __enter__(self) -> TQClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
