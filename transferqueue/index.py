"""The metadata index: a sample x field readiness table with per-task consumption. No sockets here.

::

    partition "step-3"          fields ->  input_ids  responses  ...     consumed by
      sample 96  uid=a  tags{..}            ready      ready              rollout, train
      sample 97  uid=a                      ready      -                  rollout
      ...

Sample ids are global and never reused, so a cleared id can never be served again, in any partition.
For every (partition, task, requested field set) that has been asked for, a ``Subscription`` keeps the
ready-and-unconsumed ids in readiness order and the ``uid`` groups that are complete, updated
incrementally as fields become ready or samples are consumed, so ``get_meta`` costs O(batch) rather than
O(samples indexed). Only ids, names, schemas, tags, byte counts and shapes ever reach this class.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Iterator

from transferqueue.records import BatchMeta, FieldSchema
from transferqueue.samplers import get_sampler
from transferqueue.wire import OBJECT_DTYPE, row_nbytes


class _Sample:
    __slots__ = ("sid", "mask", "consumed", "tags", "lengths", "nbytes")

    def __init__(self, sid: int):
        self.sid, self.mask, self.consumed, self.tags, self.lengths, self.nbytes = sid, 0, 0, {}, None, 0

    def group_key(self) -> Hashable:
        uid = self.tags.get("uid")
        return ("sample", self.sid) if uid is None else uid


class Subscription:
    """Ready, unconsumed samples of one partition for one task and field set (a ``samplers.ReadyView``)."""

    def __init__(self, part: _Partition, task_bit: int, mask: int, field_names: list[str]):
        self.part, self.task_bit, self.mask, self.field_names = part, task_bit, mask, field_names
        self.ready: dict[int, None] = {}
        self.groups: dict[Hashable, dict[int, None]] = {}
        self.complete: dict[Hashable, None] = {}
        self.complete_samples = 0

    def covers(self, s: _Sample) -> bool:
        return (s.mask & self.mask) == self.mask and not (s.consumed & self.task_bit)

    def add(self, s: _Sample) -> None:
        if s.sid in self.ready:
            return
        self.ready[s.sid] = None
        key = s.group_key()
        self.groups.setdefault(key, {})[s.sid] = None
        self._recheck(key)

    def remove(self, s: _Sample) -> None:
        if s.sid not in self.ready:
            return
        del self.ready[s.sid]
        key = s.group_key()
        group = self.groups[key]
        if key in self.complete:
            del self.complete[key]
            self.complete_samples -= len(group)
        del group[s.sid]
        if not group:
            del self.groups[key]

    def _recheck(self, key: Hashable) -> None:
        group = self.groups.get(key)
        done = group is not None and len(group) == self.part.group_count(key)
        if done and key not in self.complete:
            self.complete[key] = None
            self.complete_samples += len(group)
        elif not done and key in self.complete:
            del self.complete[key]
            self.complete_samples -= len(group) if group else 0

    # -- ReadyView
    def ready_ids(self) -> Iterator[int]:
        return iter(self.ready)

    def num_ready(self) -> int:
        return len(self.ready)

    def complete_groups(self) -> Iterator[tuple[Hashable, list[int]]]:
        for key in self.complete:
            yield key, sorted(self.groups[key])

    def num_complete_samples(self) -> int:
        return self.complete_samples

    def length(self, sample_id: int) -> int:
        s = self.part.samples[sample_id]
        total = 0
        for name in self.field_names:
            per_sample = s.lengths.get(name) if s.lengths else None
            if per_sample is not None:
                total += per_sample
            else:
                total += self.part.fixed_len.get(name, 1)
        return total


class _Partition:
    def __init__(self, name: str):
        self.name = name
        self.bits: dict[str, int] = {}
        self.schemas: dict[str, FieldSchema] = {}
        self.fixed_len: dict[str, int] = {}  # first dim of a field's samples put while it was fixed-shape
        self.samples: dict[int, _Sample] = {}
        self.uid_counts: dict[Hashable, int] = {}
        self.subs: dict[tuple[int, int], Subscription] = {}

    def group_count(self, key: Hashable) -> int:
        """Samples put with this uid (uids are str/int; a tuple key is a sample without uid: a group of 1)."""
        return 1 if isinstance(key, tuple) else self.uid_counts.get(key, 1)

    def field_mask(self, names: list[str], create: bool) -> int | None:
        mask = 0
        for n in names:
            if n not in self.bits:
                if not create:
                    return None
                self.bits[n] = 1 << len(self.bits)
            mask |= self.bits[n]
        return mask


class MetadataIndex:
    """The table itself. All methods raise ValueError for bad input (unknown/cleared ids, fields already
    written, unknown sampler...); the server turns those into error replies."""

    def __init__(self):
        self.partitions: dict[str, _Partition] = {}
        self.next_id = 0
        self.produced = 0
        self.reserved: dict[int, bytearray] = {}  # start -> one byte per id: 0 free, 1 used
        self.reserved_starts: list[int] = []
        self.task_bits: dict[str, int] = {}
        self.consumed: dict[str, int] = {}
        self.cleared = 0
        self.bytes_stored = 0

    def _task_bit(self, task: str) -> int:
        if not isinstance(task, str) or not task:
            raise ValueError(f"task must be a non-empty string, got {task!r}")
        if task not in self.task_bits:
            self.task_bits[task] = 1 << len(self.task_bits)
        return self.task_bits[task]

    def _partition(self, name: str, create: bool = False) -> _Partition:
        if not isinstance(name, str) or not name:
            raise ValueError(f"partition must be a non-empty string, got {name!r}")
        if name not in self.partitions:
            if not create:
                raise ValueError(f"unknown partition {name!r}")
            self.partitions[name] = _Partition(name)
        return self.partitions[name]

    # ------------------------------------------------------------------------------------------ put
    def prepare_put(self, partition: str, sample_ids: list[int] | None, count: int, fields: list[str]) -> list[int]:
        """Allocate ``count`` new ids (``sample_ids`` None) or check that ``sample_ids`` exist in
        ``partition`` and none of ``fields`` is written yet (fields are write-once per sample)."""
        part = self._partition(partition, create=sample_ids is None)
        if sample_ids is None:
            if not isinstance(count, int) or count < 0:
                raise ValueError(f"count must be a non-negative int, got {count!r}")
            ids = list(range(self.next_id, self.next_id + count))
            self.next_id += count
            self.produced += count
            for sid in ids:
                part.samples[sid] = _Sample(sid)
            return ids
        mask = part.field_mask(fields, create=False) or 0
        for sid in sample_ids:
            s = part.samples.get(sid)
            if s is None:
                state = "cleared" if isinstance(sid, int) and 0 <= sid < self.next_id else "unknown"
                raise ValueError(f"sample id {sid!r} is {state} in partition {partition!r}")
            if s.mask & mask:
                taken = [n for n in fields if s.mask & part.bits.get(n, 0)]
                raise ValueError(f"sample {sid}: fields {taken} already written (fields are write-once)")
        if len(set(sample_ids)) != len(sample_ids):
            raise ValueError("sample_ids contain duplicates")
        return list(sample_ids)

    def reserve(self, count: int) -> int:
        """Reserve ``count`` fresh ids for one client, which creates samples with them at ``notify(new=True)``
        without a round trip per put; returns the first id. Raises ValueError for ``count < 1``."""
        if not isinstance(count, int) or not 1 <= count <= 1 << 24:
            raise ValueError(f"reserve count must be an int in [1, 2**24], got {count!r}")
        start = self.next_id
        self.next_id += count
        self.reserved[start] = bytearray(count)
        self.reserved_starts.append(start)
        return start

    def _claim(self, sample_ids: list[int]) -> None:
        """Mark reserved ids used; ValueError (nothing marked) if one was not reserved or is used/cleared."""
        slots = []
        for sid in sample_ids:
            i = bisect.bisect_right(self.reserved_starts, sid) - 1 if isinstance(sid, int) else -1
            start = self.reserved_starts[i] if i >= 0 else None
            used = self.reserved.get(start) if start is not None else None
            if used is None or sid - start >= len(used) or used[sid - start]:
                raise ValueError(f"sample id {sid!r} was not reserved, or was already used or cleared")
            slots.append((start, sid - start))
        if len(set(slots)) != len(slots):
            raise ValueError("sample_ids contain duplicates")
        for start, off in slots:
            self.reserved[start][off] = 1
        for start in {start for start, _ in slots}:
            if all(self.reserved[start]):
                del self.reserved[start]
                self.reserved_starts.remove(start)

    def notify(self, partition: str, sample_ids: list[int], columns: list[dict], tags: list[dict] | None,
               new: bool = False) -> None:
        """Mark ``columns`` (validated wire descriptors) ready for ``sample_ids`` and merge ``tags``.
        ``new``: the ids come from ``reserve`` and the samples are created in ``partition`` now."""
        part = self._partition(partition, create=new)
        if tags is not None and len(tags) != len(sample_ids):
            raise ValueError(f"{len(tags)} tag dicts for {len(sample_ids)} samples")
        if new:
            self._check_new(part, sample_ids, columns, tags)
            self._claim(sample_ids)
            for sid in sample_ids:
                part.samples[sid] = _Sample(sid)
            self.produced += len(sample_ids)
        samples = []
        for sid in sample_ids:
            s = part.samples.get(sid)
            if s is None:
                raise ValueError(f"sample id {sid!r} is unknown or cleared in partition {partition!r}")
            samples.append(s)
        for i, s in enumerate(samples):
            if tags is not None and not isinstance(tags[i], dict):
                raise ValueError(f"sample {s.sid}: tags must be a map, got {type(tags[i]).__name__}")
            uid = tags[i].get("uid") if tags is not None else None
            if uid is not None and not isinstance(uid, str | int):
                raise ValueError(f"sample {s.sid}: uid must be a str or int, got {type(uid).__name__}")
        for col in columns:
            known = part.schemas.get(col["name"])
            if known is not None and known.dtype != col["dtype"]:
                raise ValueError(f"field {col['name']!r}: dtype {col['dtype']} differs from earlier puts ({known.dtype})")
        mask = part.field_mask([c["name"] for c in columns], create=True)
        for col in columns:
            self._merge_schema(part, col, samples)
        self._add_bytes(columns, samples)
        touched_groups: set = set()
        for i, s in enumerate(samples):
            if tags is not None and tags[i]:
                uid = tags[i].get("uid")
                if uid is not None and uid != s.tags.get("uid"):
                    self._move_group(part, s, uid, touched_groups)
                s.tags.update(tags[i])
            s.mask |= mask
        for sub in part.subs.values():
            for s in samples:
                if sub.covers(s):
                    sub.add(s)
            for key in touched_groups:
                sub._recheck(key)

    def _check_new(self, part: _Partition, sample_ids: list[int], columns: list[dict], tags) -> None:
        """The checks ``notify`` makes before changing anything, run before new samples are created."""
        for col in columns:
            known = part.schemas.get(col["name"])
            if known is not None and known.dtype != col["dtype"]:
                raise ValueError(f"field {col['name']!r}: dtype {col['dtype']} differs from earlier puts ({known.dtype})")
        for t in tags or []:
            if not isinstance(t, dict) or not isinstance(t.get("uid", ""), str | int):
                raise ValueError(f"tags must be maps whose uid is a str or int, got {t!r:.100}")

    def _move_group(self, part: _Partition, s: _Sample, uid: Hashable, touched: set) -> None:
        old = s.group_key()
        for sub in part.subs.values():
            sub.remove(s)
        if "uid" in s.tags:
            part.uid_counts[old] -= 1
        s.tags["uid"] = uid
        part.uid_counts[uid] = part.uid_counts.get(uid, 0) + 1
        touched.update((old, uid))

    def _merge_schema(self, part: _Partition, col: dict, samples: list[_Sample]) -> None:
        """Fold one column into the field schema. Per-sample lengths (for ``seqlen_balanced``) are kept
        only while a field is variable-length; samples put while it was fixed use ``part.fixed_len``."""
        name, dtype, shapes = col["name"], col["dtype"], col.get("shapes")
        fixed = col.get("shape")
        if fixed is None and shapes and dtype != OBJECT_DTYPE and all(sh == shapes[0] for sh in shapes):
            fixed = shapes[0]
        sch = part.schemas.get(name)
        if sch is None:
            sch = part.schemas[name] = FieldSchema(dtype, None if fixed is None else list(fixed))
            if fixed is not None:
                part.fixed_len[name] = fixed[0] if fixed else 1
        elif sch.shape is not None and (fixed is None or list(fixed) != sch.shape):
            sch.shape = None  # the field turns variable-length
        if sch.shape is None:
            lengths = [sh[0] if sh else 1 for sh in shapes] if shapes is not None else \
                [fixed[0] if fixed else 1] * len(samples)
            for smp, length in zip(samples, lengths, strict=True):
                if smp.lengths is None:
                    smp.lengths = {}
                smp.lengths[name] = length

    def _add_bytes(self, columns: list[dict], samples: list[_Sample]) -> None:
        const, var = 0, None
        for col in columns:
            if "shape" in col:
                const += col["nbytes"] // max(len(samples), 1)
            else:
                rows = row_nbytes(col)
                var = rows if var is None else [x + y for x, y in zip(var, rows, strict=True)]
        for i, smp in enumerate(samples):
            smp.nbytes += const + (var[i] if var is not None else 0)
        self.bytes_stored += sum(c["nbytes"] for c in columns)

    # ------------------------------------------------------------------------------------- get_meta
    def subscription(self, part: _Partition, task: str, fields: list[str]) -> Subscription | None:
        """The subscription of (task, fields), built with one scan on first use; None for unknown fields."""
        mask = part.field_mask(fields, create=False)
        if mask is None:
            return None
        bit = self._task_bit(task)
        sub = part.subs.get((bit, mask))
        if sub is None:
            sub = part.subs[(bit, mask)] = Subscription(part, bit, mask, list(fields))
            for s in part.samples.values():
                if sub.covers(s):
                    sub.add(s)
        return sub

    def get_meta(self, partition: str, fields: list[str], batch_size: int, task: str, sampler: str = "sequential",
                 options: dict | None = None) -> BatchMeta:
        """Hand out ``batch_size`` ready samples unconsumed by ``task`` and mark them consumed by it.

        Returns an empty BatchMeta with ``reason`` set when the sampler cannot fill the batch yet. Raises
        ValueError for a bad batch size, empty fields, or an unknown sampler.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not fields or not all(isinstance(f, str) for f in fields):
            raise ValueError(f"fields must be a non-empty list of names, got {fields!r}")
        chooser = get_sampler(sampler)
        part = self.partitions.get(partition)
        sub = self.subscription(part, task, fields) if part is not None else None
        if sub is None:
            self._task_bit(task)
            why = f"partition {partition!r} has no data yet" if part is None else f"fields {fields} not all put yet"
            return BatchMeta(partition, [], list(fields), task=task, reason=why)
        picked = chooser.select(sub, batch_size, options or {})
        if isinstance(picked, str):
            return BatchMeta(partition, [], list(fields), task=task, reason=picked)
        samples = [part.samples[i] for i in picked]
        for s in samples:
            s.consumed |= sub.task_bit
            for other in part.subs.values():
                if other.task_bit == sub.task_bit:
                    other.remove(s)
        self.consumed[task] = self.consumed.get(task, 0) + len(samples)
        return BatchMeta(partition, list(picked), list(fields), [dict(s.tags) for s in samples],
                         {f: part.schemas[f] for f in fields}, task)

    # --------------------------------------------------------------------------------- maintenance
    def clear(self, partition: str, sample_ids: list[int] | None = None) -> list[int]:
        """Remove samples (all of the partition when ``sample_ids`` is None); idempotent. Returns the ids
        that were actually removed (the storage units drop their tensors)."""
        part = self.partitions.get(partition)
        if part is None:
            return []
        targets = list(part.samples) if sample_ids is None else [i for i in sample_ids if i in part.samples]
        for sid in targets:
            s = part.samples.pop(sid)
            for sub in part.subs.values():
                sub.remove(s)
            if "uid" in s.tags:
                key = s.tags["uid"]
                part.uid_counts[key] -= 1
                if not part.uid_counts[key]:
                    del part.uid_counts[key]
                for sub in part.subs.values():
                    sub._recheck(key)
            self.bytes_stored -= s.nbytes
        self.cleared += len(targets)
        if sample_ids is None:
            del self.partitions[partition]
        return targets

    def reset_consumption(self, partition: str, task: str) -> None:
        """Make every sample of ``partition`` unconsumed for ``task`` again; idempotent."""
        part = self.partitions.get(partition)
        if part is None:
            return
        bit = self._task_bit(task)
        for s in part.samples.values():
            s.consumed &= ~bit
        for key in [k for k in part.subs if k[0] == bit]:
            del part.subs[key]  # rebuilt by the next get_meta

    def sample_info(self, partition: str, sample_ids: list[int] | None, limit: int) -> list[dict]:
        """``{"id", "fields", "tags", "consumed_by"}`` for up to ``limit`` samples (metadata only)."""
        part = self._partition(partition)
        ids = list(itertools.islice(part.samples, limit)) if sample_ids is None else sample_ids
        names = {bit: n for n, bit in part.bits.items()}
        tasks = {bit: n for n, bit in self.task_bits.items()}
        out = []
        for sid in ids:
            s = part.samples.get(sid)
            if s is None:
                raise ValueError(f"sample id {sid!r} is unknown or cleared in partition {partition!r}")
            out.append({"id": sid, "fields": [n for b, n in names.items() if s.mask & b], "tags": dict(s.tags),
                        "consumed_by": [n for b, n in tasks.items() if s.consumed & b]})
        return out

    def ready_counts(self) -> dict[str, dict[str, int]]:
        tasks = {bit: n for n, bit in self.task_bits.items()}
        return {p.name: {f"{tasks[b]}|{','.join(sub.field_names)}": len(sub.ready) for (b, _), sub in p.subs.items()}
                for p in self.partitions.values()}
