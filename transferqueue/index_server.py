"""The index process: ``MetadataIndex`` behind a ROUTER socket, with non-blocking long-poll ``get_meta``.

A ``get_meta`` that cannot be filled and has ``timeout_s > 0`` is *parked* (identity, request, deadline),
never slept on. Every ``notify``, ``reset_consumption`` or ``clear`` of a partition retries that
partition's parked requests in arrival order; ``tick`` answers the expired ones with an empty meta and
the sampler's reason. So one slow consumer never blocks another's request.

A ``get_meta`` reply that cannot be delivered (its consumer's process died while its request was parked:
a roller killed mid long-poll) gives its samples back to the task (``MetadataIndex.unconsume``), and that
partition's parked requests are retried: a dead consumer never takes samples with it.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import asdict
from itertools import repeat

from common.curve import CurveKeys
from transferqueue import wire
from transferqueue.config import TransferQueueConfig
from transferqueue.index import MetadataIndex
from transferqueue.records import Consume, IndexStats, LimitExceeded
from transferqueue.server import Reply, RouterServer


def _ids_or_none(value, what: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(map(isinstance, value, repeat(int))):
        raise wire.WireError(f"{what} must be a list of ints or null")
    return value


class IndexServer(RouterServer):
    """Ops: ``reserve``, ``prepare_put``, ``notify``, ``get_meta``, ``clear``, ``reset_consumption``, ``stats``,
    ``sample_info``, ``ping``. ``sampler_modules``: modules imported at start (they call
    ``samplers.register_sampler``). ``limits``: the config whose bounds apply (see ``TransferQueueConfig``);
    lapsed reservations are dropped every ``reservation_lease_s / 4``."""

    def __init__(self, address: str, curve: CurveKeys | None = None, sampler_modules: tuple[str, ...] = (),
                 local_address: str = "", limits: TransferQueueConfig | None = None):
        for mod in sampler_modules:
            importlib.import_module(mod)
        super().__init__(address, curve, local_address=local_address)
        self.index = MetadataIndex(limits)
        self.limits = self.index.limits
        self.timer_s = self.limits.reservation_lease_s / 4
        self.parked: list[tuple[float, bytes, dict, int]] = []  # (deadline, identity, header, header bytes)
        self.parked_bytes = 0
        self._given_back: set[str] = set()  # partitions with samples of undelivered replies: retried in tick

    def handle(self, identity: bytes, header: dict, frames: list) -> Reply | None:
        if frames:
            raise wire.WireError(f"the index takes no data frames, got {len(frames)}")
        op = header["op"]
        ix = self.index
        if op == "get_meta":
            return self._get_meta(identity, header)
        if op == "prepare_put":
            ids = ix.prepare_put(header.get("partition"), _ids_or_none(header.get("ids"), "ids"),
                                 header.get("count"), list(header.get("fields") or []), owner=identity)
            return {"ids": ids}, []
        if op == "notify":
            ids = _ids_or_none(header.get("ids"), "ids") or []
            cols = header.get("columns")
            if not isinstance(cols, list) or not cols:
                raise wire.WireError("notify: columns must be a non-empty list")
            ix.notify(header.get("partition"), ids,
                      [wire.validate_column(c, len(ids), self.limits.max_name_chars) for c in cols],
                      header.get("tags"), new=bool(header.get("new")),
                      consume=None if header.get("consume") is None else Consume.from_wire(header["consume"]),
                      owner=identity)
            self._retry(header.get("partition"))
            return {}, []
        if op == "reserve":
            return {"start": ix.reserve(header.get("count"), identity),
                    "lease_s": self.limits.reservation_lease_s}, []
        if op == "clear":
            removed = ix.clear(header.get("partition"), _ids_or_none(header.get("ids"), "ids"))
            return {"ids": removed}, []
        if op == "reset_consumption":
            ix.reset_consumption(header.get("partition"), header.get("task"))
            self._retry(header.get("partition"))
            return {}, []
        if op == "stats":
            return {"stats": asdict(self.stats())}, []
        if op == "sample_info":
            limit = header.get("limit", 1000)
            return {"samples": ix.sample_info(header.get("partition"), _ids_or_none(header.get("ids"), "ids"),
                                              limit if isinstance(limit, int) else 1000)}, []
        if op == "ping":
            return {}, []
        raise wire.WireError(f"unknown op {op!r} for the index")

    def _get_meta(self, identity: bytes, header: dict) -> Reply | None:
        meta = self._try(header)
        timeout_s = header.get("timeout_s", 0.0)
        if not isinstance(timeout_s, int | float) or timeout_s < 0:
            raise wire.WireError(f"get_meta: timeout_s must be a number >= 0, got {timeout_s!r}")
        if len(meta) or timeout_s == 0:
            return {"meta": meta.to_wire()}, []
        lim, size = self.limits, len(wire.pack(header))
        if len(self.parked) >= lim.max_parked:
            raise LimitExceeded("max_parked", f"get_meta: {len(self.parked)} requests wait already, the most "
                                f"transferqueue.max_parked={lim.max_parked} allows")
        if self.parked_bytes + size > lim.max_parked_bytes:
            raise LimitExceeded("max_parked_bytes", f"get_meta: waiting requests hold {self.parked_bytes} header "
                                f"bytes; {size} more would pass transferqueue.max_parked_bytes={lim.max_parked_bytes}")
        self.parked.append((time.monotonic() + timeout_s, identity, header, size))
        self.parked_bytes += size
        return None

    def _try(self, header: dict):
        options = header.get("options") or {}
        if not isinstance(options, dict):
            raise wire.WireError("get_meta: options must be a map")
        fields = header.get("fields")
        return self.index.get_meta(list(fields) if isinstance(fields, list) else fields, header.get("batch_size"),
                                   header.get("task"), header.get("partition"),
                                   header.get("sampler", "sequential"), options)

    def _answer(self, entry: tuple, expired: bool) -> bool:
        """Try parked request ``entry`` again; answer it when it is filled, fails or (``expired``) is due.
        Returns whether it was answered. A sampler error becomes an error reply (the options were checked
        when it was parked, but a custom sampler may raise later): it never reaches the loop."""
        _, identity, header, size = entry
        try:
            meta = self._try(header)
        except Exception as exc:
            reply = {"ok": False, "rid": header.get("rid"), "error": f"{type(exc).__name__}: {exc}"}
        else:
            if not len(meta) and not expired:
                return False
            if not len(meta):
                meta.reason = f"timed out after {header.get('timeout_s')} s: {meta.reason}"
            reply = {"ok": True, "rid": header.get("rid"), "meta": meta.to_wire()}
        self.reply(identity, header, reply)
        self.parked_bytes -= size
        return True

    def undelivered(self, request: dict, reply: dict) -> None:
        """A ``get_meta`` reply that never left: its samples are unconsumed again for the request's task."""
        meta = reply.get("meta")
        if request.get("op") != "get_meta" or not isinstance(meta, dict) or not meta.get("sample_ids"):
            return
        partition = request.get("partition")
        self.index.unconsume(partition, request.get("task"), list(meta["sample_ids"]))
        self._given_back.add(partition)

    def _retry(self, partition: str | None) -> None:
        self.parked = [e for e in self.parked if e[2].get("partition") != partition or not self._answer(e, False)]

    def tick(self) -> None:
        while self._given_back:
            self._retry(self._given_back.pop())
        if not self.parked:
            return
        now = time.monotonic()
        if all(e[0] > now for e in self.parked):
            return
        self.parked = [e for e in self.parked if e[0] > now or not self._answer(e, True)]

    def timer(self, now: float) -> None:
        self.index.reservations.expire(now)

    def stats(self) -> IndexStats:
        ix = self.index
        return IndexStats(
            num_samples=ix.num_samples,
            produced=ix.produced, consumed=dict(ix.consumed), cleared=ix.cleared, bytes_stored=ix.bytes_stored,
            ready=ix.ready_counts(), partitions={n: len(p.samples) for n, p in ix.partitions.items()},
            requests={k: list(v) for k, v in self.requests.items()}, waiting=len(self.parked),
            reserved_ids=ix.reservations.total)
