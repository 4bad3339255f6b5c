"""The rows of the metadata index and the per-task views the samplers read (``index.MetadataIndex`` owns
them): a ``Sample`` per sample id, a ``Partition`` per partition, and a ``Subscription`` per (partition,
task, field set) that keeps the ready-and-unconsumed ids in readiness order and the complete ``uid``
groups, updated incrementally so ``get_meta`` costs O(batch) rather than O(samples indexed)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from types import MappingProxyType

from transferqueue.records import FieldSchema

NO_TAGS: Mapping = MappingProxyType({})  # a sample's tags until it gets some (read-only: copy on write)


class Sample:
    __slots__ = ("sid", "mask", "consumed", "tags", "lengths", "nbytes")

    def __init__(self, sid: int, mask: int = 0, nbytes: int = 0):
        self.sid = sid
        self.mask = mask  # bit per ready field (``Partition.bits``)
        self.consumed = 0  # bit per task that consumed it (``MetadataIndex.task_bits``)
        self.tags: Mapping = NO_TAGS
        self.lengths: dict[str, int] | None = None  # first dim per variable-length field
        self.nbytes = nbytes

    def group_key(self) -> Hashable:
        uid = self.tags.get("uid")
        return ("sample", self.sid) if uid is None else uid


class Subscription:
    """Ready, unconsumed samples of one partition for one task and field set (a ``samplers.ReadyView``).

    ``complete`` maps each complete group (all ``group_count`` samples of its key ready here) to its size
    when counted, in the order the groups completed; ``complete_samples`` is the sum of those sizes."""

    def __init__(self, part: Partition, task_bit: int, mask: int, field_names: list[str]):
        self.part, self.task_bit, self.mask, self.field_names = part, task_bit, mask, field_names
        self.ready: dict[int, None] = {}
        self.groups: dict[Hashable, dict[int, None]] = {}
        self.complete: dict[Hashable, int] = {}
        self.complete_samples = 0

    def covers(self, s: Sample) -> bool:
        return (s.mask & self.mask) == self.mask and not (s.consumed & self.task_bit)

    def add_many(self, samples: Iterable[Sample]) -> None:
        """Add each sample that ``covers`` accepts, in order, rechecking its group after each (inlined:
        this runs once per put over all its samples)."""
        want, bit, ready, groups, complete = self.mask, self.task_bit, self.ready, self.groups, self.complete
        counts = self.part.uid_counts
        for s in samples:
            sid = s.sid
            if (s.mask & want) != want or s.consumed & bit or sid in ready:
                continue
            ready[sid] = None
            uid = s.tags.get("uid")
            key = ("sample", sid) if uid is None else uid
            group = groups.get(key)
            if group is None:
                group = groups[key] = {}
            group[sid] = None
            n = len(group)
            if n == (1 if uid is None else counts.get(uid, 1)):
                self.complete_samples += n - complete.get(key, 0)
                complete[key] = n
            elif key in complete:
                self.complete_samples -= complete.pop(key)

    def remove_many(self, samples: Iterable[Sample]) -> None:
        """Remove each sample (if here); groups are rechecked by the caller once the counts are updated."""
        ready, groups, complete = self.ready, self.groups, self.complete
        for s in samples:
            sid = s.sid
            if sid not in ready:
                continue
            del ready[sid]
            uid = s.tags.get("uid")
            key = ("sample", sid) if uid is None else uid
            if key in complete:
                self.complete_samples -= complete.pop(key)
            group = groups[key]
            del group[sid]
            if not group:
                del groups[key]

    def remove(self, s: Sample) -> None:
        self.remove_many((s,))

    def _recheck(self, key: Hashable) -> None:
        group = self.groups.get(key)
        if group is not None and len(group) == self.part.group_count(key):
            self.complete_samples += len(group) - self.complete.get(key, 0)  # a complete group can grow:
            self.complete[key] = len(group)  # a sample moved into it with its uid count
        elif key in self.complete:
            self.complete_samples -= self.complete.pop(key)

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


class Partition:
    def __init__(self, name: str, owner: bytes = b""):
        self.name = name
        self.owner = owner  # the client connection that created it (``transferqueue.max_client_partitions``)
        self.bits: dict[str, int] = {}
        self.schemas: dict[str, FieldSchema] = {}
        self.fixed_len: dict[str, int] = {}  # first dim of a field's samples put while it was fixed-shape
        self.samples: dict[int, Sample] = {}
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
