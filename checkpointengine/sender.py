"""Send side of the weight plane: one ``WeightSender`` per trainer rank.

Rank 0 (the leader) owns the control socket (a ZMQ ROUTER on loopback), the bucket slots and the
version bookkeeping; it makes the ``WeightSyncHandle`` that the controller hands to the other ranks and
to every roller. Two ways to send one ``weight_version``:

* ``send(named_tensors, version)`` — full tensors (``named_full_tensors()``: every rank iterates, since
  ``full_tensor()`` is collective; only the leader sends). Any backend.
* ``send_shards(shards, version)`` — ``shm`` only, on one node: every rank writes its own ``Shard(0)``
  rows (``RowShard``) straight into the shared slots; no gather. Ranks agree at every bucket boundary
  (an all-reduce of an "ok" flag in the trainer's process group), so an error on any rank aborts all.

Within an update (see ``protocol``): wait for every target's ``Want`` → ``Begin`` → per bucket: wait for
the slot to be consumed by every target (double buffering: packing k+1 overlaps the rollers reading k)
→ write → ``BucketReady`` → ``End`` → wait for every ``Ack``/``Fail``. Every wait ends after
``timeout_s`` with ``WeightSyncTimeout`` naming the rollers and the version.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpointengine import broadcast as bc
from checkpointengine.bucket import (
    Bucket,
    BucketPlanner,
    RowShard,
    TensorEntry,
    dtype_name,
    write_full,
    write_rows,
)
from checkpointengine.config import CheckpointEngineConfig
from checkpointengine.control import ControlServer, Round
from checkpointengine.naming import WeightNameMapper, engine_dtype_of, to_engine_dtype
from checkpointengine.protocol import (
    Abort,
    Begin,
    BucketReady,
    End,
    GroupInit,
    WeightSyncError,
    WeightSyncHandle,
)
from checkpointengine.storage import DiskVersions, ShmSlots

logger = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"


@dataclass
class SyncReport:
    """Outcome of one update on the leader: rollers that acked, duration (s), payload bytes, buckets."""

    version: int
    acked: list[str]
    duration_s: float
    num_bytes: int
    num_buckets: int


def _resolve_group_backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return name


class WeightSender:
    """One trainer rank's sender. ``rank`` 0 creates everything (``rollers``: the roller names it serves;
    ``mapper``: trainer → engine names and coverage check); other ranks pass the leader's ``handle``.

    Raises ValueError for a non-leader without a handle, or ``send_shards`` on a backend other than shm.
    """

    def __init__(self, cfg: CheckpointEngineConfig, rollers: Iterable[str] = (), *, rank: int = 0,
                 handle: WeightSyncHandle | None = None, mapper: WeightNameMapper | None = None,
                 host: str = LOOPBACK):
        self.cfg = cfg
        self.rank = rank
        self.mapper = mapper or WeightNameMapper()
        self.engine_dtype = getattr(torch, cfg.dtype)
        self.rollers: list[str] = list(dict.fromkeys(rollers))
        self._control: ControlServer | None = None
        self._slots: ShmSlots | None = None
        self._buffers: list[torch.Tensor] = []
        self._disk: DiskVersions | None = None
        self._group: bc.WeightUpdateGroup | None = None
        self._group_members: list[str] = []
        self._stats = {"num_syncs": 0, "num_failed_syncs": 0, "num_roller_failures": 0, "last_sync_s": 0.0,
                       "total_sync_s": 0.0, "last_bytes": 0, "total_bytes": 0, "last_error": ""}
        self._own_disk_dir = ""  # a temp dir this sender made for the disk backend (removed by close)
        if rank != 0:
            if handle is None:
                raise ValueError(f"WeightSender rank {rank} needs the leader's handle")
            self.handle = handle
            if handle.backend == "shm":
                self._slots = ShmSlots.attach(handle.shm_paths, handle.bucket_bytes)
            return
        self._control = ControlServer(host, cfg)
        shm_paths, disk_dir = [], ""
        if cfg.backend == "shm":
            self._slots = ShmSlots.create(cfg.num_slots, cfg.bucket_bytes)
            shm_paths = self._slots.paths
        elif cfg.backend == "zmq":
            self._buffers = [torch.empty(cfg.bucket_bytes, dtype=torch.uint8) for _ in range(cfg.num_slots)]
        elif cfg.backend == "disk":
            self._own_disk_dir = "" if cfg.disk_dir else tempfile.mkdtemp(prefix="hflow-ce-disk-")
            disk_dir = cfg.disk_dir or self._own_disk_dir
            self._disk = DiskVersions(disk_dir)
        self.handle = WeightSyncHandle(cfg.backend, self._control.address, cfg.bucket_bytes, cfg.dtype,
                                       cfg.timeout_s, shm_paths, disk_dir,
                                       _resolve_group_backend(cfg.group_backend), cfg.reuse_receive_buffers)

    # ------------------------------------------------------------------------------------ membership

    @property
    def version(self) -> int:
        """The last ``weight_version`` this leader completed (-1 before the first; -1 on other ranks)."""
        return self._control.version if self._control is not None else -1

    @property
    def roller_versions(self) -> dict[str, int]:
        """Each roller's committed version as it last reported or acked (leader only)."""
        return self._control.roller_versions if self._control is not None else {}

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def add_roller(self, name: str) -> None:
        """Serve roller ``name`` from now on (pool scaling); send it the current version before it works."""
        if name not in self.rollers:
            self.rollers.append(name)

    def remove_roller(self, name: str) -> None:
        if name in self.rollers:
            self.rollers.remove(name)
        self.roller_versions.pop(name, None)

    # ---------------------------------------------------------------------------------------- sending

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
             targets: Iterable[str] | None = None) -> SyncReport | None:
        """Send full tensors ``(trainer_name, tensor)`` (any shape/dtype; floats cast to the engine dtype)
        as ``version`` to ``targets`` (default: every roller). Non-leader ranks only iterate the stream
        (taking part in the gather) and return None.

        Raises ValueError for a version below the last one or a target that already has it,
        MissingWeightsError when the update would leave engine tensors unset (rollers keep their old
        version), WeightSyncTimeout naming the rollers that did not answer, WeightSyncError naming the
        rollers that failed.
        """
        if not self.is_leader:
            for _ in named_tensors:
                pass
            return None
        source = iter(named_tensors)
        stream = self.mapper.route(source)
        backend = self.handle.backend
        if backend in ("shm", "zmq"):
            body = self._packed_body(stream, write_full, lambda t: (t.dtype, t.shape))
        elif backend == "broadcast":
            body = self._broadcast_body(stream)
        else:
            body = self._disk_body(stream)
        try:
            return self._run(version, targets, body)
        except BaseException:
            _drain(source)  # a gathered stream is collective: the other ranks wait for the rest of it
            raise

    def send_shards(self, shards: Iterable[RowShard], version: int, targets: Iterable[str] | None = None,
                    group: dist.ProcessGroup | None = None) -> SyncReport | None:
        """Every rank: write this rank's ``Shard(0)`` rows into the shared slots (shm backend only).

        ``shards``: ``RowShard`` or any record with ``name``, ``tensor``, ``row_offset``, ``full_shape``
        (e.g. ``trainers.fsdp.LocalShard``).
        All ranks must pass the same names, full shapes and dtypes in the same order. ``group``: the
        trainer's process group (default: the default group; a single process needs none). Returns the
        report on the leader, None elsewhere; raises as ``send``, on every rank, when any rank fails.
        """
        if self.handle.backend != "shm":
            raise ValueError(f"send_shards needs checkpointengine.backend='shm', not "
                             f"{self.handle.backend!r}; use send(named_full_tensors()) across nodes")
        agree = _make_agree(group)
        rows = (s if isinstance(s, RowShard) else
                RowShard(s.name, s.tensor, s.row_offset, tuple(s.full_shape)) for s in shards)
        stream = self.mapper.route((s.name, s) for s in rows)
        body = self._packed_body(stream, write_rows, lambda s: (s.tensor.dtype, s.full_shape), agree)
        if not self.is_leader:
            if agree is not None and not agree(True):
                raise RuntimeError(f"trainer rank 0 could not start weight update {version} (see its error)")
            body(Round(version, [], set()))
            return None
        return self._run(version, targets, body, agree)

    def _run(self, version: int, targets: Iterable[str] | None, body: Callable[[Round], tuple[int, int]],
             agree: Callable[[bool], bool] | None = None) -> SyncReport:
        """The leader's update. ``agree``: with several ranks, tells them whether the update started."""
        targets = list(dict.fromkeys(targets if targets is not None else self.rollers))
        start = time.perf_counter()
        rnd = Round(version, targets, set(targets))
        try:
            try:
                self._check_version(version, targets)
                self._control.await_wants(rnd)
                if self.handle.backend == "broadcast":
                    self._ensure_group(rnd)
                self._control.broadcast(rnd, Begin(version))
            except BaseException:
                if agree is not None:
                    agree(False)  # the other ranks wait for this: release them
                raise
            if agree is not None:
                agree(True)
            num_buckets, num_bytes = body(rnd)
            self._control.broadcast(rnd, End(version, num_buckets, num_bytes))
            self._control.await_results(rnd)
        except BaseException as exc:
            self._control.broadcast(rnd, Abort(version, f"{type(exc).__name__}: {exc}"), quiet=True)
            self._stats["num_failed_syncs"] += 1
            self._stats["last_error"] = f"{type(exc).__name__}: {exc}"
            raise
        duration = time.perf_counter() - start
        failures = {r: e for r, e in rnd.results.items() if e is not None}
        acked = [r for r in targets if r in rnd.results and rnd.results[r] is None]
        for r in acked:
            self.roller_versions[r] = version
        self._control.version = max(self._control.version, version)
        self._stats.update(num_syncs=self._stats["num_syncs"] + 1, last_sync_s=duration, last_bytes=num_bytes,
                           total_sync_s=self._stats["total_sync_s"] + duration,
                           total_bytes=self._stats["total_bytes"] + num_bytes)
        if failures:
            self._stats["num_roller_failures"] += len(failures)
            self._stats["num_failed_syncs"] += 1
            err = WeightSyncError(version, failures)
            self._stats["last_error"] = str(err)
            raise err
        return SyncReport(version, acked, duration, num_bytes, num_buckets)

    def _check_version(self, version: int, targets: list[str]) -> None:
        if version < self.version:
            raise ValueError(f"weight_version {version} is below the last one sent ({self.version})")
        if not targets:
            raise ValueError("no rollers to send to (add_roller first)")
        for r in targets:
            if r not in self.rollers:
                raise ValueError(f"roller {r!r} is not served by this sender (rollers: {self.rollers})")
            if self.roller_versions.get(r, -1) >= version:
                raise ValueError(f"roller {r!r} already has weight_version {self.roller_versions[r]} "
                                 f">= {version}")

    # ------------------------------------------------------------------------------- update bodies

    def _packed_body(self, stream, write: Callable, spec: Callable,
                     agree: Callable[[bool], bool] | None = None) -> Callable[[Round], tuple[int, int]]:
        """Body of an shm/zmq update: pack ``stream`` into the slots, publishing each closed bucket."""
        return lambda rnd: _SlotPacker(self, rnd, write, spec, agree).run(stream)

    def _broadcast_body(self, stream):
        def run(rnd: Round) -> tuple[int, int]:
            pending: list = []
            index = total = 0
            for bucket in self._whole_buckets(stream):
                entries = [TensorEntry(n, dtype_name(t.dtype), tuple(t.shape), 0, t.nbytes, (0, t.nbytes))
                           for n, t in bucket]
                used = sum(e.nbytes for e in entries)
                self._control.broadcast(rnd, BucketReady(rnd.version, index, entries, used))
                works = bc.broadcast_tensors(self._group, [t.to(self._group.device) for _, t in bucket])
                for work in pending:  # the previous bucket finishes while this one was cast
                    work.wait()
                pending = works
                index += 1
                total += sum(e.nbytes for e in entries)
            for work in pending:
                work.wait()
            return index, total

        return run

    def _disk_body(self, stream):
        def run(rnd: Round) -> tuple[int, int]:
            self._disk.begin(rnd.version)
            index = total = 0
            for bucket in self._whole_buckets(stream):
                path = self._disk.write_bucket(rnd.version, index, bucket)
                entries = [TensorEntry(n, dtype_name(t.dtype), tuple(t.shape), 0, t.nbytes, (0, t.nbytes))
                           for n, t in bucket]
                used = sum(e.nbytes for e in entries)
                self._control.broadcast(rnd, BucketReady(rnd.version, index, entries, used, path=path))
                index += 1
                total += sum(e.nbytes for e in entries)
            self._disk.finish(rnd.version, total)
            return index, total

        return run

    def _whole_buckets(self, stream):
        """Group whole tensors (cast, contiguous) into buckets of at most ``bucket_bytes`` (a larger
        tensor travels alone); then check that the update covers the engine."""
        bucket, used, sent = [], 0, []
        for name, tensor in stream:
            tensor = to_engine_dtype(tensor, self.engine_dtype)
            if bucket and used + tensor.nbytes > self.handle.bucket_bytes:
                yield bucket
                bucket, used = [], 0
            bucket.append((name, tensor))
            used += tensor.nbytes
            sent.append(name)
        self.mapper.check_coverage(sent)
        if bucket:
            yield bucket

    # ------------------------------------------------------------------------------ control plane

    def _publish(self, rnd: Round, bucket: Bucket, slot: int, buffer: torch.Tensor) -> None:
        msg = BucketReady(rnd.version, bucket.index, bucket.entries, bucket.used_bytes, slot=slot)
        if self.handle.backend == "zmq":
            frame = memoryview(buffer[: bucket.used_bytes].numpy())
            self._control.broadcast(rnd, msg, frames=[frame])
        else:
            self._control.broadcast(rnd, msg)

    def _ensure_group(self, rnd: Round) -> None:
        members = sorted(rnd.active)
        if self._group is not None and members == self._group_members:
            return
        bc.destroy_group(self._group)
        self._group = None
        store = bc.create_sender_store(LOOPBACK, 0, len(members) + 1, self.cfg.timeout_s)
        name = f"hflow-weights-{uuid.uuid4().hex[:12]}"
        for i, roller in enumerate(members):
            msg = GroupInit(LOOPBACK, store.port, i + 1, len(members) + 1, name,
                            self.handle.broadcast_backend)
            self._control.send_to(roller, msg)
        self._group = bc.create_sender_group(store, len(members) + 1, name, self.handle.broadcast_backend,
                                             self.cfg.timeout_s)
        self._group_members = members

    # --------------------------------------------------------------------------------------- misc

    def stats(self) -> dict:
        """Sync durations (s), bytes, failures, the leader's ``weight_version`` and each roller's version."""
        return {**self._stats, "weight_version": self.version, "roller_versions": dict(self.roller_versions)}

    def close(self) -> None:
        """Release sockets, slots (the leader unlinks the shm files) and the broadcast group. Idempotent."""
        bc.destroy_group(self._group)
        self._group = None
        if self._slots is not None:
            self._slots.close()
            self._slots = None
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._own_disk_dir:
            shutil.rmtree(self._own_disk_dir, ignore_errors=True)
            self._own_disk_dir = ""


class _SlotPacker:
    """One shm/zmq update on one rank: places ``(engine_name, item)`` pairs with ``BucketPlanner`` and
    writes each entry into slot ``bucket % num_slots`` (``write(buffer, entry, item)``; ``spec(item)``
    gives the item's dtype and full shape). Before reusing a slot the leader waits until every roller
    consumed its previous bucket; with several ranks, all agree at every slot reuse and bucket close, so
    an error on any rank (kept until the next agreement) raises on all of them at the same point."""

    def __init__(self, sender: WeightSender, rnd: Round, write: Callable, spec: Callable,
                 agree: Callable[[bool], bool] | None):
        self.sender, self.rnd, self.write, self.spec, self.agree = sender, rnd, write, spec, agree
        self.num_slots = len(sender.handle.shm_paths) if sender._slots is not None else len(sender._buffers)
        self.bucket = -1
        self.item = None
        self.error: BaseException | None = None

    def buffer(self, index: int) -> torch.Tensor:
        slots, slot = self.sender._slots, index % self.num_slots
        return slots.buffer(slot) if slots is not None else self.sender._buffers[slot]

    def sync(self, point: str) -> None:
        ok = self.error is None
        if self.agree is not None and not self.agree(ok):
            raise self.error or RuntimeError(f"another trainer rank failed ({point})")
        if not ok:
            raise self.error

    def on_write(self, index: int, entry: TensorEntry) -> None:
        if index != self.bucket:
            self.bucket = index
            if index >= self.num_slots:
                try:
                    if self.sender.is_leader:
                        self.sender._control.await_consumed(self.rnd, index - self.num_slots)
                except Exception as exc:  # reported to every rank at the agreement below
                    self.error = exc
                self.sync(f"reusing the slot of bucket {index - self.num_slots}")
        if self.error is None:
            try:
                self.write(self.buffer(index), entry, self.item)
            except Exception as exc:
                self.error = exc

    def on_close(self, bucket: Bucket) -> None:
        self.sync(f"closing bucket {bucket.index}")
        if self.sender.is_leader:
            self.sender._publish(self.rnd, bucket, bucket.index % self.num_slots, self.buffer(bucket.index))

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
