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

import itertools
from collections.abc import Hashable
from operator import attrgetter

from transferqueue.config import TransferQueueConfig
from transferqueue.records import BatchMeta, Consume, FieldSchema, LimitExceeded
from transferqueue.reservations import Reservations
from transferqueue.samplers import get_sampler
from transferqueue.table import NO_TAGS, Partition, Sample, Subscription
from transferqueue.wire import OBJECT_DTYPE, check_id_count, row_nbytes

_NBYTES = attrgetter("nbytes")
_DICT, _UID_TYPES = frozenset({dict}), frozenset({str, int})


def _row_bytes(columns: list[dict], count: int) -> tuple[int, list[int] | None]:
    """Bytes per sample of validated columns for ``count`` samples: the same for every sample (fixed-shape
    columns) plus, when a column has per-sample ``shapes``, a list of the rest (else None)."""
    const, var = 0, None
    for col in columns:
        if "shape" in col:
            const += col["nbytes"] // max(count, 1)
        else:
            rows = row_nbytes(col)
            var = rows if var is None else [x + y for x, y in zip(var, rows, strict=True)]
    return const, var


def _set_lengths(samples: list[Sample], lengths: list[tuple[str, list[int]]]) -> None:
    """Record per-sample lengths (``(field, [length per sample])``)."""
    for name, per_sample in lengths:
        for smp, length in zip(samples, per_sample, strict=True):
            if smp.lengths is None:
                smp.lengths = {}
            smp.lengths[name] = length


class MetadataIndex:
    """The table itself. All methods raise ValueError for bad input (unknown/cleared ids, fields already
    written, unknown sampler...) and ``LimitExceeded`` (a ValueError too) for a request past one of
    ``limits``' bounds, changing nothing; the server turns those into error replies. ``limits``: the
    ``transferqueue`` config whose ``max_*`` and ``reservation_lease_s`` bounds apply (defaults when None).

    Its memory is bounded: at most ``limits.sample_bound`` samples over all partitions (``num_samples``),
    ``max_partitions`` partitions, ``max_client_partitions`` of them created by one client connection
    (``owner``: its ZMQ identity) and not cleared yet, and the reservations' bounds."""

    def __init__(self, limits: TransferQueueConfig | None = None):
        self.limits = limits or TransferQueueConfig()
        self.max_request_ids = self.limits.max_request_ids  # read on every notify
        self.max_fields = self.limits.max_fields
        self.max_samples = self.limits.sample_bound
        self.partitions: dict[str, Partition] = {}
        self.partitions_by_owner: dict[bytes, int] = {}  # partitions each client created, not cleared yet
        self.num_samples = 0  # samples held, over all partitions
        self.next_id = 0
        self.produced = 0
        self.reservations = Reservations(self.limits)
        self.task_bits: dict[str, int] = {}
        self.consumed: dict[str, int] = {}
        self.cleared = 0
        self.bytes_stored = 0

    def _check_task(self, task: str) -> None:
        """ValueError for a task that is not a non-empty string; LimitExceeded when a new task's name is past
        ``max_name_chars`` or it would pass ``max_tasks``. Registers nothing (``_task_bit`` does)."""
        if not isinstance(task, str) or not task:
            raise ValueError(f"task must be a non-empty string, got {task!r}")
        if task not in self.task_bits:
            self._check_name("task", task)
            if len(self.task_bits) >= self.limits.max_tasks:
                raise LimitExceeded("max_tasks", f"task {task!r:.100} would be task number {len(self.task_bits) + 1}: "
                                    f"past transferqueue.max_tasks={self.limits.max_tasks}")

    def _task_bit(self, task: str) -> int:
        """The consumption bit of ``task``, registered now if it is new (errors as ``_check_task``)."""
        self._check_task(task)
        if task not in self.task_bits:
            self.task_bits[task] = 1 << len(self.task_bits)
        return self.task_bits[task]

    def _check_name(self, what: str, name: str) -> None:
        if len(name) > self.limits.max_name_chars:
            raise LimitExceeded("max_name_chars", f"{what} {name:.64}...: a name of {len(name)} characters, past "
                                f"transferqueue.max_name_chars={self.limits.max_name_chars}")

    def _check_count(self, what: str, n: int) -> None:
        check_id_count(what, n, self.max_request_ids)

    def _check_new_fields(self, part: Partition, columns: list[dict]) -> None:
        """ValueError (before anything changes) when ``columns`` would take ``part`` past ``max_fields``."""
        if len(part.bits) + len(columns) > self.max_fields:  # usually false: no per-column work
            new = len({c["name"] for c in columns if c["name"] not in part.bits})
            if len(part.bits) + new > self.max_fields:
                raise LimitExceeded("max_fields", f"partition {part.name!r}: {new} new fields would make "
                                    f"{len(part.bits) + new}, past transferqueue.max_fields={self.max_fields}")

    def _check_room(self, what: str, n: int) -> None:
        """LimitExceeded when ``n`` new samples would take the index past ``max_samples``."""
        if self.num_samples + n > self.max_samples:
            raise LimitExceeded("max_samples", f"{what}: the index holds {self.num_samples} samples; {n} more would "
                                f"pass {self.limits.sample_bound_source()} (clear consumed samples first)")

    def _partition(self, name: str, create: bool = False, owner: bytes = b"") -> Partition:
        """Partition ``name``. With ``create`` and no such partition: a new one for client ``owner``, checked
        against the partition bounds (LimitExceeded past ``max_name_chars``, ``max_partitions`` or ``owner``'s
        ``max_client_partitions``) but not in the index yet: the caller adds it with ``_keep`` once every
        other check of its request has passed, so a refused request leaves no partition behind."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"partition must be a non-empty string, got {name!r:.100}")
        part = self.partitions.get(name)
        if part is not None:
            return part
        if not create:
            raise ValueError(f"unknown partition {name!r:.100}")
        lim = self.limits
        self._check_name("partition", name)
        if len(self.partitions) >= lim.max_partitions:
            raise LimitExceeded("max_partitions", f"partition {name!r:.100} would be partition number "
                                f"{len(self.partitions) + 1}: past transferqueue.max_partitions={lim.max_partitions}")
        held = self.partitions_by_owner.get(owner, 0)
        if held >= lim.max_client_partitions:
            raise LimitExceeded("max_client_partitions", f"partition {name!r:.100}: this client created {held} "
                                f"partitions not cleared yet, the most transferqueue.max_client_partitions="
                                f"{lim.max_client_partitions} allows")
        return Partition(name, owner)

    def _keep(self, part: Partition) -> None:
        """Add ``part`` (from ``_partition``) to the index if it is new, charged to its owner's
        ``max_client_partitions`` until ``clear`` removes it."""
        if part.name not in self.partitions:
            self.partitions[part.name] = part
            self.partitions_by_owner[part.owner] = self.partitions_by_owner.get(part.owner, 0) + 1

    # ------------------------------------------------------------------------------------------ put
    def prepare_put(self, partition: str, sample_ids: list[int] | None, count: int, fields: list[str],
                    owner: bytes = b"") -> list[int]:
        """Create ``count`` new samples with fresh ids in ``partition`` (``sample_ids`` None; the partition is
        created for client ``owner`` if new) or check that ``sample_ids`` exist in ``partition`` and none of
        ``fields`` is written yet (fields are write-once per sample). Returns the ids. Raises
        LimitExceeded, creating nothing, past ``max_request_ids``, ``max_samples``, ``max_partitions`` or
        ``max_client_partitions``; ValueError for unknown/cleared ids or a written field."""
        if sample_ids is None:
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"count must be a non-negative int, got {count!r}")
            self._check_count("prepare_put", count)
            self._check_room("prepare_put", count)
            part = self._partition(partition, create=True, owner=owner)
            self._keep(part)
            ids = list(range(self.next_id, self.next_id + count))
            self.next_id += count
            self.produced += count
            self.num_samples += count
            for sid in ids:
                part.samples[sid] = Sample(sid)
            return ids
        part = self._partition(partition)
        self._check_count("prepare_put", len(sample_ids))
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

    def reserve(self, count: int, owner: bytes = b"") -> int:
        """Reserve ``count`` fresh ids for client ``owner`` (its connection's identity), which creates samples
        with them at ``notify(new=True)`` without a round trip per put; returns the first id. See
        ``Reservations.reserve`` for the bounds and the lease."""
        self.reservations.reserve(self.next_id, count, owner)
        self.next_id += count
        return self.next_id - count

    def notify(self, partition: str, sample_ids: list[int], columns: list[dict], tags: list[dict] | None,
               new: bool = False, consume: Consume | None = None, owner: bytes = b"") -> None:
        """Mark ``columns`` (validated wire descriptors) ready for ``sample_ids`` and merge ``tags``.
        ``new``: the ids come from ``reserve`` and the samples are created in ``partition`` now (the partition
        for client ``owner`` if it is new; LimitExceeded past ``max_samples`` or the partition bounds).
        ``consume``: other samples this put answers (a roller's group answers its prompt row), marked
        consumed by ``consume.task`` in the same step (``mark_consumed``): no reader ever sees the put
        without the mark, or the mark without the put.

        Every check (ids, tags, uid types, dtypes, ``consume``'s names, a new partition's bounds) runs before
        anything changes, so a rejected notify leaves the index as it was: no partition, task or claimed id. Raises ValueError naming the first offending id, tag or
        field."""
        if consume is not None:
            self._check_consume(consume)
        if len(sample_ids) > self.max_request_ids:  # the fast path pays one comparison
            self._check_count("notify", len(sample_ids))
        if new:
            self._check_room("notify", len(sample_ids))
        part = self._partition(partition, create=new, owner=owner)
        if tags is not None and len(tags) != len(sample_ids):
            raise ValueError(f"{len(tags)} tag dicts for {len(sample_ids)} samples")
        self._check_new_fields(part, columns)
        if new:
            uids = self._check_new(part, columns, tags)
            self.reservations.claim(sample_ids)  # the last check: it marks the ids used when it passes
            self._keep(part)
        else:
            samples = self._existing(part, sample_ids, tags, columns)
            self._check_dtypes(part, columns)
        mask = part.field_mask([c["name"] for c in columns], create=True)
        lengths = []
        for col in columns:
            per_sample = self._merge_schema(part, col, len(sample_ids))
            if per_sample is not None:
                lengths.append((col["name"], per_sample))
        const, var = _row_bytes(columns, len(sample_ids))
        self.bytes_stored += sum(c["nbytes"] for c in columns)
        if new:
            samples = self._create(part, sample_ids, mask, const, var)
            touched = self._tag_new(part, samples, tags, uids) if tags is not None else {}
        else:
            touched = self._update(part, samples, mask, const, var, tags)
        _set_lengths(samples, lengths)
        for sub in part.subs.values():
            # Every sample covered by a subscription is in it: a new sample (its mask is ``mask``) can only
            # enter one whose fields it has; an existing one only if ``mask`` adds one of its fields or
            # the sample changed group (``_move_group`` took it out of every subscription).
            if (new and mask & sub.mask == sub.mask) or (not new and (touched or mask & sub.mask)):
                sub.add_many(samples)
            for key in touched:
                sub._recheck(key)
        if consume is not None:
            self.mark_consumed(consume)

    def _check_consume(self, consume: Consume) -> None:
        if not isinstance(consume.partition, str) or not consume.partition:
            raise ValueError(f"consume: partition must be a non-empty string, got {consume.partition!r:.100}")
        self._check_count("consume", len(consume.sample_ids))
        self._check_task(consume.task)  # registered by mark_consumed, once the notify is accepted

    def mark_consumed(self, consume: Consume) -> None:
        """Mark ``consume.sample_ids`` of ``consume.partition`` consumed by ``consume.task`` (so that task's
        ``get_meta`` never hands them out); ids already cleared, or an unknown partition, are skipped
        (idempotent, like ``clear``). Raises ValueError for a bad task name."""
        bit = self._task_bit(consume.task)
        part = self.partitions.get(consume.partition)
        if part is None:
            return
        for sid in consume.sample_ids:
            s = part.samples.get(sid)
            if s is None or s.consumed & bit:
                continue
            s.consumed |= bit
            for sub in part.subs.values():
                if sub.task_bit == bit:
                    sub.remove(s)

    def _check_dtypes(self, part: Partition, columns: list[dict]) -> None:
        for col in columns:
            known = part.schemas.get(col["name"])
            if known is not None and known.dtype != col["dtype"]:
                raise ValueError(f"field {col['name']!r}: dtype {col['dtype']} differs from earlier puts ({known.dtype})")

    def _check_new(self, part: Partition, columns: list[dict], tags: list[dict] | None) -> list | None:
        """The checks ``notify`` makes before changing anything, run before new samples are created.
        Returns the uid of each tag dict (None where it has none), or None without tags."""
        self._check_dtypes(part, columns)
        if tags is None:
            return None
        if set(map(type, tags)) <= _DICT:  # the usual case, checked in bulk: plain dicts, each with a uid
            uids = list(map(dict.get, tags, itertools.repeat("uid")))
            if set(map(type, uids)) <= _UID_TYPES:
                return uids
        for t in tags:
            if not isinstance(t, dict) or not isinstance(t.get("uid", ""), str | int):
                raise ValueError(f"tags must be maps whose uid is a str or int, got {t!r:.100}")
        return [t.get("uid") for t in tags]

    def _existing(self, part: Partition, sample_ids: list[int], tags, columns: list[dict]) -> list[Sample]:
        """The samples of ``sample_ids``; ValueError for an unknown/cleared id, a field of ``columns`` some
        sample has already (fields are write-once: so no notify can merge tags into a sample without
        adding a field, and a sample's tags grow at most ``max_fields`` times), or a bad tag dict or uid."""
        samples = list(map(part.samples.get, sample_ids))
        if None in samples:
            sid = sample_ids[samples.index(None)]
            raise ValueError(f"sample id {sid!r} is unknown or cleared in partition {part.name!r}")
        written = 0
        for col in columns:
            written |= part.bits.get(col["name"], 0)
        if written and any(s.mask & written for s in samples):
            s = next(s for s in samples if s.mask & written)
            taken = [c["name"] for c in columns if s.mask & part.bits.get(c["name"], 0)]
            raise ValueError(f"sample {s.sid}: fields {taken} already written (fields are write-once)")
        for s, t in zip(samples, tags or (), strict=False):
            if not isinstance(t, dict):
                raise ValueError(f"sample {s.sid}: tags must be a map, got {type(t).__name__}")
            uid = t.get("uid")  # a null uid would leave the sample in its group under another key
            if "uid" in t and not isinstance(uid, str | int):
                raise ValueError(f"sample {s.sid}: uid must be a str or int, got {type(uid).__name__}")
        return samples

    def _create(self, part: Partition, sample_ids: list[int], mask: int, const: int,
                var: list[int] | None) -> list[Sample]:
        """New samples (ids just claimed) with ``mask`` ready and their bytes (``const`` + ``var[i]``)."""
        if var is None:
            samples = [Sample(sid, mask, const) for sid in sample_ids]
        else:
            samples = [Sample(sid, mask, const + v) for sid, v in zip(sample_ids, var, strict=True)]
        part.samples.update(zip(sample_ids, samples, strict=True))
        self.produced += len(samples)
        self.num_samples += len(samples)
        return samples

    @staticmethod
    def _tag_new(part: Partition, samples: list[Sample], tags: list[dict], uids: list) -> dict:
        """Give new samples their tags and count their uids; returns the uids (groups to recheck)."""
        counts = part.uid_counts
        for s, t, uid in zip(samples, tags, uids, strict=True):
            if uid is not None:
                s.tags = {"uid": uid, **t}  # uid first, as _move_group then update would leave it
                counts[uid] = counts.get(uid, 0) + 1
            elif t:
                s.tags = dict(t)
        return dict.fromkeys(uids if None not in uids else (u for u in uids if u is not None))

    def _update(self, part: Partition, samples: list[Sample], mask: int, const: int, var: list[int] | None,
                tags: list[dict] | None) -> set:
        """Existing samples: add ``mask`` and bytes, merge tags (moving samples between uid groups).
        Returns the group keys whose completeness may have changed."""
        touched: set = set()
        for i, s in enumerate(samples):
            if tags is not None and tags[i]:
                if s.tags is NO_TAGS:
                    s.tags = {}
                uid = tags[i].get("uid")
                if uid is not None and uid != s.tags.get("uid"):
                    self._move_group(part, s, uid, touched)
                s.tags.update(tags[i])
            s.mask |= mask
            s.nbytes += const if var is None else const + var[i]
        return touched

    def _move_group(self, part: Partition, s: Sample, uid: Hashable, touched: set) -> None:
        old = s.group_key()
        for sub in part.subs.values():
            sub.remove(s)
        if "uid" in s.tags:
            part.uid_counts[old] -= 1
            if not part.uid_counts[old]:
                del part.uid_counts[old]
        s.tags["uid"] = uid
        part.uid_counts[uid] = part.uid_counts.get(uid, 0) + 1
        touched.update((old, uid))

    def _merge_schema(self, part: Partition, col: dict, count: int) -> list[int] | None:
        """Fold one column into the field schema; returns the per-sample lengths to record (first dim;
        for ``seqlen_balanced``), kept only while a field is variable-length, else None (samples put
        while it was fixed use ``part.fixed_len``)."""
        name, dtype, shapes = col["name"], col["dtype"], col.get("shapes")
        fixed = col.get("shape")
        if fixed is None and shapes and dtype != OBJECT_DTYPE and shapes.count(shapes[0]) == len(shapes):
            fixed = shapes[0]
        sch = part.schemas.get(name)
        if sch is None:
            sch = part.schemas[name] = FieldSchema(dtype, None if fixed is None else list(fixed))
            if fixed is not None:
                part.fixed_len[name] = fixed[0] if fixed else 1
        elif sch.shape is not None and (fixed is None or list(fixed) != sch.shape):
            sch.shape = None  # the field turns variable-length
        if sch.shape is not None:
            return None
        if shapes is not None:
            return [sh[0] if sh else 1 for sh in shapes]
        return [fixed[0] if fixed else 1] * count

    # ------------------------------------------------------------------------------------- get_meta
    def subscription(self, part: Partition, task: str, fields: list[str]) -> Subscription | None:
        """The subscription of (task, fields), built with one scan on first use; None for unknown fields.
        ``part.subs`` is kept in least-recently-used order; past ``max_subscriptions`` the first one goes
        (it is a cache: rebuilt by one scan when asked for again)."""
        mask = part.field_mask(fields, create=False)
        if mask is None:
            return None
        bit = self._task_bit(task)
        subs, key = part.subs, (bit, mask)
        sub = subs.pop(key, None)
        if sub is None:
            if len(subs) >= self.limits.max_subscriptions:
                del subs[next(iter(subs))]
            sub = Subscription(part, bit, mask, list(fields))
            sub.add_many(part.samples.values())
        subs[key] = sub
        return sub

    def get_meta(self, fields: list[str], batch_size: int, task: str, partition: str, sampler: str = "sequential",
                 options: dict | None = None) -> BatchMeta:
        """Hand out ``batch_size`` ready samples of ``partition`` unconsumed by ``task`` and mark them consumed
        by it (arguments in the order of ``TQClient.get_meta``).

        Returns an empty BatchMeta with ``reason`` set when the sampler cannot fill the batch yet. Raises
        ValueError for a bad batch size, empty fields, or an unknown sampler.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self._check_count("get_meta batch_size", batch_size)
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
        if sample_ids is None:  # its subscriptions and uid counts go with it
            del self.partitions[partition]
            left = self.partitions_by_owner[part.owner] - 1
            if left:
                self.partitions_by_owner[part.owner] = left
            else:
                del self.partitions_by_owner[part.owner]
            self.bytes_stored -= sum(map(_NBYTES, part.samples.values()))
            self.cleared += len(part.samples)
            self.num_samples -= len(part.samples)
            return list(part.samples)
        removed = list(map(part.samples.pop, sample_ids, itertools.repeat(None)))
        targets = list(sample_ids)
        if None in removed:  # unknown, cleared or repeated ids: skipped
            targets = [sid for sid, s in zip(targets, removed, strict=True) if s is not None]
            removed = [s for s in removed if s is not None]
        # Groups are rechecked once per uid, in the order of each uid's last removed sample: that leaves
        # ``Subscription.complete`` (membership and order) as a remove-and-recheck per sample would.
        touched: dict[Hashable, None] = {}
        counts = part.uid_counts
        for s in removed:
            if "uid" in s.tags:
                key = s.tags["uid"]
                counts[key] -= 1
                if not counts[key]:
                    del counts[key]
                touched.pop(key, None)
                touched[key] = None
        for sub in part.subs.values():
            sub.remove_many(removed)
            for key in touched:
                sub._recheck(key)
        self.bytes_stored -= sum(map(_NBYTES, removed))
        self.cleared += len(removed)
        self.num_samples -= len(removed)
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

    def unconsume(self, partition: str, task: str, sample_ids: list[int]) -> None:
        """Make ``sample_ids`` of ``partition`` unconsumed for ``task`` again (a ``get_meta`` whose reply never
        reached its consumer: ``IndexServer.undelivered``); unknown or cleared ids are skipped."""
        part = self.partitions.get(partition)
        if part is None:
            return
        bit = self._task_bit(task)
        given = [s for s in map(part.samples.get, sample_ids) if s is not None and s.consumed & bit]
        for s in given:
            s.consumed &= ~bit
        for key in [k for k in part.subs if k[0] == bit]:
            del part.subs[key]  # rebuilt by the next get_meta
        self.consumed[task] = self.consumed.get(task, 0) - len(given)

    def sample_info(self, partition: str, sample_ids: list[int] | None, limit: int) -> list[dict]:
        """``{"id", "fields", "tags", "consumed_by"}`` for up to ``limit`` samples (metadata only)."""
        part = self._partition(partition)
        self._check_count("sample_info", limit if sample_ids is None else len(sample_ids))
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
