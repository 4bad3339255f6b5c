"""Samplers: which ready, unconsumed samples a ``get_meta`` hands out. They run inside the index process.

A sampler sees a ``ReadyView`` of one (partition, task, field set): the samples whose requested fields are
all ready and that this task has not consumed, in the order they became ready, plus the ``uid`` groups
all of whose samples are ready. It returns the chosen ids (``batch_size`` of them) or a reason string
when it cannot fill the batch; the index then waits (long-poll) or answers empty with that reason.

Built in: ``sequential``, ``group_complete`` (whole ``uid`` groups only) and ``seqlen_balanced``
(reorders a batch so its ``num_ranks`` equal chunks carry balanced token counts), the plug-ins of the
``SAMPLERS`` registry (``common.registry``). Add one with ``register_sampler(name, sampler)`` in a module
listed in ``transferqueue.sampler_modules`` (the index imports those at start; a request names a registered
sampler only, never a module to import).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Protocol

from common.registry import Registry
from transferqueue.records import chunk_sizes


class ReadyView(Protocol):
    """What a sampler may read (implemented by ``index.Subscription``)."""

    def ready_ids(self) -> Iterator[int]:
        """Ready, unconsumed sample ids in readiness order."""

    def num_ready(self) -> int: ...

    def complete_groups(self) -> Iterator[tuple[Hashable, list[int]]]:
        """``(uid, ids)`` of groups whose every sample is ready and unconsumed, in completion order; ids
        sorted (put order)."""

    def num_complete_samples(self) -> int: ...

    def length(self, sample_id: int) -> int:
        """Tokens of a sample: the summed first dimension of the requested per-sample-shaped fields."""


class Sampler(Protocol):
    def select(self, view: ReadyView, batch_size: int, options: dict) -> list[int] | str:
        """``batch_size`` ids from ``view`` or a reason string; ValueError for bad options."""


class SequentialSampler:
    """The first ``batch_size`` ready samples, in readiness order."""

    def select(self, view: ReadyView, batch_size: int, options: dict) -> list[int] | str:
        if view.num_ready() < batch_size:
            return f"insufficient ready samples: {view.num_ready()} ready, {batch_size} requested"
        return list(itertools.islice(view.ready_ids(), batch_size))


class GroupCompleteSampler:
    """Whole ``uid`` groups only, in the order groups became complete; ids inside a group in put order.

    A group is complete when every sample put with its uid is ready and unconsumed. ``options["group_size"]``
    (optional, e.g. ``rollout.n``): only groups of exactly this many samples are handed out, and
    ``batch_size`` must be a multiple of it (ValueError otherwise).
    """

    def select(self, view: ReadyView, batch_size: int, options: dict) -> list[int] | str:
        group_size = options.get("group_size")
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1
                                       or batch_size % group_size):
            raise ValueError(f"group_size={group_size!r} must be a positive int dividing batch_size={batch_size}")
        if view.num_complete_samples() < batch_size:
            return (f"insufficient complete groups: {view.num_complete_samples()} samples in complete groups, "
                    f"{batch_size} requested")
        chosen: list[int] = []
        for _uid, ids in view.complete_groups():
            if group_size is not None and len(ids) != group_size:
                continue  # e.g. a group partly cleared: never handed out as a "whole" group
            if len(chosen) + len(ids) > batch_size:
                continue
            chosen.extend(ids)
            if len(chosen) == batch_size:
                return chosen
        return f"complete groups cannot fill exactly {batch_size} samples (got {len(chosen)})"


def balanced_order(lengths: list[int], num_ranks: int) -> list[int]:
    """Positions of ``lengths`` reordered so ``chunk_sizes(len, num_ranks)`` consecutive chunks have equal
    counts and near-equal sums: longest-processing-time-first greedy (Graham 1969) with a per-rank
    cardinality cap; stable within a rank. Raises ValueError for ``num_ranks < 1``."""
    caps = chunk_sizes(len(lengths), num_ranks)
    heap = [(0, r) for r in range(num_ranks) if caps[r]]
    heapq.heapify(heap)
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    for pos in sorted(range(len(lengths)), key=lambda p: -lengths[p]):
        load, rank = heapq.heappop(heap)
        assigned[rank].append(pos)
        if len(assigned[rank]) < caps[rank]:
            heapq.heappush(heap, (load + lengths[pos], rank))
    return [p for rank in assigned for p in sorted(rank)]


class SeqlenBalancedSampler:
    """Takes a batch with ``options["base"]`` (``sequential`` default, or ``group_complete``) and reorders it
    so that ``BatchMeta.chunk(options["num_ranks"])`` gives each data-parallel rank a balanced token count."""

    def select(self, view: ReadyView, batch_size: int, options: dict) -> list[int] | str:
        num_ranks = options.get("num_ranks")
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"seqlen_balanced needs options.num_ranks >= 1, got {num_ranks!r}")
        base = options.get("base", "sequential")
        if base not in SAMPLERS or isinstance(SAMPLERS.get(base), SeqlenBalancedSampler):
            raise ValueError(f"seqlen_balanced: unknown base sampler {base!r}")
        ids = SAMPLERS.get(base).select(view, batch_size, options)
        if isinstance(ids, str):
            return ids
        # more ranks than samples leave ranks empty either way: the same order, with work and memory bound
        # by the batch, not by a ``num_ranks`` a request may set to anything
        order = balanced_order([view.length(i) for i in ids], min(num_ranks, len(ids)))
        return [ids[p] for p in order]


SAMPLERS: Registry[Sampler] = Registry("sampler", "get_meta sampler")


def register_sampler(name: str, sampler: Sampler) -> None:
    """Make ``sampler`` available as ``get_meta(..., sampler=name)`` in this process (the index process).
    Raises ValueError when the name is taken or malformed, or the object has no ``select``."""
    if not callable(getattr(sampler, "select", None)):
        raise ValueError(f"sampler {name!r} must have a select(view, batch_size, options) method")
    SAMPLERS.register(name, sampler)


register_sampler("sequential", SequentialSampler())
register_sampler("group_complete", GroupCompleteSampler())
register_sampler("seqlen_balanced", SeqlenBalancedSampler())


def get_sampler(name: str) -> Sampler:
    """The registered sampler ``name`` (a request's value: no ``module:name`` import in the index); raises
    ValueError naming it and the registered samplers otherwise."""
    if not isinstance(name, str) or name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; registered: {SAMPLERS.names()}")
    return SAMPLERS.get(name)


