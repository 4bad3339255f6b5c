"""Send side of the weight plane: one ``WeightSender`` per trainer rank.

Rank 0 (the leader) owns the control socket (a ZMQ ROUTER on ``checkpointengine.host``, loopback by
default; with ``checkpointengine.curve`` a CURVE server whose keys the leader makes) and the weight_version
bookkeeping; the backend plug-in (``checkpointengine.backend``, one module per backend in ``backends/``)
owns how bytes travel (its slots, buffers, group or files). The leader makes the ``WeightSyncHandle`` that the
controller hands to the other ranks and to every roller. Two ways to send one ``weight_version``:

* ``send(named_tensors, weight_version)`` — full tensors (``named_full_tensors()``: every rank iterates, since
  ``full_tensor()`` is collective; only the leader sends). Any backend.
* ``send_shards(shards, weight_version)`` — backends that ``supports_shards`` (``shm``), on one node: every rank writes its own ``Shard(0)``
  rows (``RowShard``) straight into the shared slots; no gather. Ranks agree at every bucket boundary
  (an all-reduce of an "ok" flag in the trainer's process group), so an error on any rank aborts all.

Within an update (see ``protocol``): wait for every target's ``Want`` → ``Begin`` → per bucket: wait for
the slot to be consumed by every target (double buffering: packing k+1 overlaps the rollers reading k)
→ write → ``BucketReady`` → ``End`` → wait for every ``Ack``/``Fail``. Every wait ends after
``timeout_s`` with ``WeightSyncTimeout`` naming the rollers and the weight_version.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpointengine.backend import get_backend
from checkpointengine.bucket import RowShard, dtype_from_name
from checkpointengine.config import CheckpointEngineConfig
from checkpointengine.control import ControlServer, Round
from checkpointengine.naming import WeightNameMapper
from checkpointengine.protocol import End, WeightSyncError, WeightSyncHandle
from common.curve import make_job_keys
from common.net import resolve_bind_host

logger = logging.getLogger(__name__)


@dataclass
class SyncReport:
    """Outcome of one update on the leader: rollers that acked, duration (s), payload bytes, buckets."""

    weight_version: int
    acked: list[str]
    duration_s: float
    num_bytes: int
    num_buckets: int


class WeightSender:
    """One trainer rank's sender. ``rank`` 0 creates everything (``rollers``: the roller names it serves;
    ``mapper``: trainer → engine names and coverage check); other ranks pass the leader's ``handle``
    (they open no socket of the control plane and need no CURVE keys: ``handle_for_ranks``).

    Raises ValueError for a non-leader without a handle, an unknown backend, or ``send_shards`` on a
    backend that does not ``supports_shards``; zmq.ZMQError when ``cfg.host`` cannot be bound; RuntimeError
    for ``cfg.host`` ``node`` outside a Ray cluster.
    """

    def __init__(self, cfg: CheckpointEngineConfig, rollers: Iterable[str] = (), *, rank: int = 0,
                 handle: WeightSyncHandle | None = None, mapper: WeightNameMapper | None = None):
        if rank == 0:  # ``node``: this process's Ray node address; rollers connect to what the handle reports
            cfg = dataclasses.replace(cfg, host=resolve_bind_host("checkpointengine.host", cfg.host))
        self.cfg = cfg
        self.rank = rank
        self.mapper = mapper or WeightNameMapper()
        self.engine_dtype = dtype_from_name(cfg.dtype)
        self.rollers: list[str] = list(dict.fromkeys(rollers))
        self.control: ControlServer | None = None
        self._stats = {"num_syncs": 0, "num_failed_syncs": 0, "num_roller_failures": 0, "last_sync_s": 0.0,
                       "total_sync_s": 0.0, "last_bytes": 0, "total_bytes": 0, "last_error": ""}
        if rank != 0:
            if handle is None:
                raise ValueError(f"WeightSender rank {rank} needs the leader's handle")
            self.handle = handle
            self.backend = handle.plugin
            self._side = self.backend.sender.attach(cfg, handle)
            return
        self.backend = get_backend(cfg.backend)
        self._side = self.backend.sender.create(cfg)
        keys = make_job_keys() if cfg.curve else None
        try:
            self.control = ControlServer(cfg, keys)
        except BaseException:
            self._side.close()
            raise
        self.handle = WeightSyncHandle(cfg.backend, self.control.address, cfg.bucket_bytes, cfg.dtype,
                                       cfg.timeout_s, cfg.reuse_receive_buffers, self._side.fields,
                                       keys.for_clients() if keys is not None else None)

    def handle_for_ranks(self) -> WeightSyncHandle:
        """The handle without CURVE keys, for the other trainer ranks (they travel over the trainers'
        own process group, which CURVE does not protect; those ranks never talk to the control socket)."""
        return dataclasses.replace(self.handle, curve=None)

    # ------------------------------------------------------------------------------------ membership

    @property
    def weight_version(self) -> int:
        """The last ``weight_version`` this leader completed (-1 before the first; -1 on other ranks)."""
        return self.control.weight_version if self.control is not None else -1

    @property
    def roller_weight_versions(self) -> dict[str, int]:
        """Each roller's committed weight_version as it last reported or acked (leader only)."""
        return self.control.roller_weight_versions if self.control is not None else {}

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def add_roller(self, name: str) -> None:
        """Serve roller ``name`` from now on (pool scaling); send it the current weight_version before it works."""
        if name not in self.rollers:
            self.rollers.append(name)

    def remove_roller(self, name: str) -> None:
        if name in self.rollers:
            self.rollers.remove(name)
        self.roller_weight_versions.pop(name, None)

    # ---------------------------------------------------------------------------------------- sending

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int,
             targets: Iterable[str] | None = None) -> SyncReport | None:
        """Send full tensors ``(trainer_name, tensor)`` (any shape/dtype; floats cast to the engine dtype)
        as ``weight_version`` to ``targets`` (default: every roller). Non-leader ranks only iterate the stream
        (taking part in the gather) and return None.

        Raises ValueError for a weight_version below the last one or a target that already has it,
        MissingWeightsError when the update would leave engine tensors unset (rollers keep their old
        weight_version), WeightSyncTimeout naming the rollers that did not answer, WeightSyncError naming the
        rollers that failed.
        """
        if not self.is_leader:
            for _ in named_tensors:
                pass
            return None
        source = iter(named_tensors)
        stream = self.mapper.route(source)
        body = self._side.full_body(self, stream)
        try:
            return self._run(weight_version, targets, body)
        except BaseException:
            _drain(source)  # a gathered stream is collective: the other ranks wait for the rest of it
            raise

    def send_shards(self, shards: Iterable[RowShard], weight_version: int, targets: Iterable[str] | None = None,
                    group: dist.ProcessGroup | None = None) -> SyncReport | None:
        """Every rank: write this rank's ``Shard(0)`` rows into the shared slots (shm backend only).

        ``shards``: ``RowShard`` or any record with ``name``, ``tensor``, ``row_offset``, ``full_shape``
        (e.g. ``trainers.fsdp.LocalShard``).
        All ranks must pass the same names, full shapes and dtypes in the same order. ``group``: the
        trainer's process group (default: the default group; a single process needs none). Returns the
        report on the leader, None elsewhere; raises as ``send``, on every rank, when any rank fails.
        """
        if not self.backend.supports_shards:
            raise ValueError(f"send_shards needs a checkpointengine.backend that supports shards (shm), not "
                             f"{self.handle.backend!r}; use send(named_full_tensors()) across nodes")
        agree = _make_agree(group)
        rows = (s if isinstance(s, RowShard) else
                RowShard(s.name, s.tensor, s.row_offset, tuple(s.full_shape)) for s in shards)
        stream = self.mapper.route((s.name, s) for s in rows)
        body = self._side.shard_body(self, stream, agree)
        if not self.is_leader:
            if agree is not None and not agree(True):
                raise RuntimeError(f"trainer rank 0 could not start weight update {weight_version} (see its error)")
            body(Round(weight_version, [], set()))
            return None
        return self._run(weight_version, targets, body, agree)

    def _run(self, weight_version: int, targets: Iterable[str] | None, body: Callable[[Round], tuple[int, int]],
             agree: Callable[[bool], bool] | None = None) -> SyncReport:
        """The leader's update. ``agree``: with several ranks, tells them whether the update started."""
        targets = list(dict.fromkeys(targets if targets is not None else self.rollers))
        start = time.perf_counter()
        rnd = Round(weight_version, targets, set(targets))
        try:
            try:
                self._check_weight_version(weight_version, targets)
                self.control.await_wants(rnd)
                self._side.before_begin(self, rnd)
                self.control.begin(rnd)
            except BaseException:
                if agree is not None:
                    agree(False)  # the other ranks wait for this: release them
                raise
            if agree is not None:
                agree(True)
            num_buckets, num_bytes = body(rnd)
            self.control.broadcast(rnd, End(weight_version, num_buckets, num_bytes))
            self.control.await_results(rnd)
        except BaseException as exc:
            self.control.abort(rnd, f"{type(exc).__name__}: {exc}")
            self._stats["num_failed_syncs"] += 1
            self._stats["last_error"] = f"{type(exc).__name__}: {exc}"
            raise
        duration = time.perf_counter() - start
        failures = {r: e for r, e in rnd.results.items() if e is not None}
        acked = [r for r in targets if r in rnd.results and rnd.results[r] is None]
        for r in acked:
            self.roller_weight_versions[r] = weight_version
        self.control.weight_version = max(self.control.weight_version, weight_version)
        self._stats.update(num_syncs=self._stats["num_syncs"] + 1, last_sync_s=duration, last_bytes=num_bytes,
                           total_sync_s=self._stats["total_sync_s"] + duration,
                           total_bytes=self._stats["total_bytes"] + num_bytes)
        if failures:
            self._stats["num_roller_failures"] += len(failures)
            self._stats["num_failed_syncs"] += 1
            err = WeightSyncError(weight_version, failures)
            self._stats["last_error"] = str(err)
            raise err
        return SyncReport(weight_version, acked, duration, num_bytes, num_buckets)

    def _check_weight_version(self, weight_version: int, targets: list[str]) -> None:
        if weight_version < self.weight_version:
            raise ValueError(f"weight_version {weight_version} is below the last one sent ({self.weight_version})")
        if not targets:
            raise ValueError("no rollers to send to (add_roller first)")
        for r in targets:
            if r not in self.rollers:
                raise ValueError(f"roller {r!r} is not served by this sender (rollers: {self.rollers})")
            if self.roller_weight_versions.get(r, -1) >= weight_version:
                raise ValueError(f"roller {r!r} already has weight_version {self.roller_weight_versions[r]} "
                                 f">= {weight_version}")

    # --------------------------------------------------------------------------------------- misc

    def stats(self) -> dict:
        """Sync durations (s), bytes, failures, the leader's ``weight_version`` and each roller's."""
        return {**self._stats, "weight_version": self.weight_version,
                "roller_weight_versions": dict(self.roller_weight_versions)}

    @property
    def supports_shards(self) -> bool:
        """Whether ``send_shards`` works on this backend (every rank writes its own rows)."""
        return self.backend.supports_shards

    def close(self) -> None:
        """Release the control socket and the backend's resources (the leader unlinks shm files, removes
        its temp disk dir, destroys the broadcast group). Idempotent."""
        self._side.close()
        if self.control is not None:
            self.control.close()
            self.control = None


def _drain(source) -> None:
    try:
        for _ in source:
            pass
    except Exception as exc:  # the gather itself failed; the original error is the one to raise
        logger.warning("weight sender: draining the tensor stream after a failed update: %s", exc)


def _make_agree(group: dist.ProcessGroup | None) -> Callable[[bool], bool] | None:
    """All ranks' "ok" flags reduced with MIN (None for a single process)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree
