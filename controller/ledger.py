"""The group ledger: the one owner of every prompt group's life, the admission bound, the weight versions and
the run's group counters. Stages, job checkpoints, trainer restarts and the pool keeper ask it and tell it
what happened through typed operations; none of them edits its fields (they are private).

::

    reserve(k) ─> admitted(uids) ──(a roller takes it, generates rollout.n samples, scores them: the data plane)──┐
         │                                                                                                        │
         │          ┌──────────────────────── generated: a step's batch holds it ──(trained)──> gone, counted ────┘
         │          │
         ├─ replaced(uid, new, REISSUED_*)   its roller left / too stale / newer weights: the same prompt again
         ├─ replaced(uid, new, ZERO_VARIANCE)  DAPO dynamic sampling: a fresh prompt in its slot
         └─ failed(uids)                      rollers.on_failed_group=skip: its slot freed for a fresh prompt when
                                              the schedule replaces failed groups (fully-async)

**Versions, one convention.** ``weight_version`` is the trainer's count of completed updates (0 at the start;
``step`` is the same count: one update per step). ``synced_weight_version`` is the version every roller
holds, never ahead of ``weight_version``. The **staleness** of a sample trained by the update that starts
from version ``v`` (the trainer's ``weight_version`` before it) is ``v − min_weight_version``, the sample's
first token's version (:func:`staleness`). A step record's ``weight_version`` is the one the update made
(``v + 1``).

**Admission.** A new group may start only while

    started − released ≤ (max_staleness + synced_weight_version + 1) × train_batch_size − 1

(``started``: groups started since the start of the run; ``released``: slots given back — a group dropped
and replaced, or failed in a schedule that replaces failed groups, or trained prompts requeued by a trainer
restart). The rollers' version, not the trainer's: the bound then holds while a sync is in flight. A
*bounded* schedule (fully-async) admits under it; ``sync`` and ``one-step-off`` bound staleness by their
structure and only count. A replacement takes its predecessor's slot: ``started`` and ``released`` both grow.

**Checkpoints.** :meth:`GroupLedger.to_state` is a JSON-able dict with ``format``; :meth:`from_state` reads
it, and also the flat job.json of the checkpoints written before the ledger (format 1, no ``format`` key);
any other format is refused with one line naming it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

FORMAT = 2  # of to_state(); 1: the flat JobState fields of the checkpoints written before the ledger
# What happened to a group that left the ledger other than by training (``replaced``'s ``why``).
REISSUED_ROLLER_LEFT = "roller_left"      # its roller was lost or drained: the same prompt again, not counted dropped
REISSUED_STALE = "stale"                  # staler than algorithm.max_staleness (stale_policy=drop): counted dropped
REISSUED_NEWER_WEIGHTS = "newer_weights"  # a token of weights a trainer restart undid: counted dropped
ZERO_VARIANCE = "zero_variance"           # DAPO dynamic sampling: a fresh prompt in its slot
REPLACE_REASONS = (REISSUED_ROLLER_LEFT, REISSUED_STALE, REISSUED_NEWER_WEIGHTS, ZERO_VARIANCE)


def staleness(trained_from: int, min_weight_version: int) -> int:
    """Staleness of a sample trained by the update that starts from the trainer's ``weight_version``
    ``trained_from``, whose first token came from ``min_weight_version`` (both in versions)."""
    return trained_from - min_weight_version


def max_live_groups(train_batch_size: int, max_staleness: int) -> int:
    """The most prompt groups any schedule has started and neither trained nor released at once: ``sync``
    one batch, ``one-step-off`` two, ``fully-async`` ``max_staleness + 1`` batches (the bound at any version,
    every earlier version having trained its batch). What sizes the TransferQueue index
    (``transferqueue.max_samples``)."""
    return max(max_staleness + 1, 2) * train_batch_size


@dataclass(frozen=True)
class TrainedGroup:
    """A group a step trained, as the ledger knew it: seconds since it was admitted (``age_s``) and the
    dynamic-sampling round that admitted it (``refill_round``: it replaced that many zero-variance groups)."""

    uid: str
    age_s: float
    refill_round: int


@dataclass
class _Group:
    admitted_at: float  # time.monotonic()
    refill_round: int = 0


class GroupLedger:
    """Every live prompt group of a run and its counters (see the module docstring).

    ``train_batch_size``: prompt groups per batch (``data.train_batch_size``); ``max_staleness``: the bound,
    in versions; ``total_groups``: groups the whole run trains (steps × groups per step); ``replaces_failed``:
    a failed group's slot goes to a fresh prompt (the schedule's declaration). Raises ValueError for a
    batch size below 1 or a negative bound.
    """

    def __init__(self, train_batch_size: int, max_staleness: int, total_groups: int, replaces_failed: bool):
        if train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {train_batch_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self._batch, self._max_staleness = train_batch_size, max_staleness
        self._total_groups, self._replaces_failed = total_groups, replaces_failed
        self._groups: dict[str, _Group] = {}  # admitted, not yet trained, replaced or failed
        self._started = self._released = 0
        self._weight_version = self._synced_weight_version = 0
        self._num_syncs = 0
        self._exhausted = False  # the feeder has no more prompts
        self._closed = False     # the schedule is done: admit nothing more
        self._counts = {"num_dropped_groups": 0, "num_failed_groups": 0, "num_zero_variance_groups": 0,
                        "num_reissued_groups": 0}

    # ------------------------------------------------------------------------------------------ reading

    @property
    def weight_version(self) -> int:
        """The trainer's completed updates."""
        return self._weight_version

    @property
    def step(self) -> int:
        """Trainer steps done (one update each: equal to ``weight_version``)."""
        return self._weight_version

    @property
    def synced_weight_version(self) -> int:
        """The version every roller holds."""
        return self._synced_weight_version

    @property
    def num_syncs(self) -> int:
        return self._num_syncs

    @property
    def num_started(self) -> int:
        """Groups started since the start of the run (replacements included)."""
        return self._started

    @property
    def outstanding(self) -> int:
        """Groups admitted and not yet trained, replaced or failed."""
        return len(self._groups)

    @property
    def exhausted(self) -> bool:
        """The feeder has no more prompts."""
        return self._exhausted

    @property
    def closed(self) -> bool:
        """The schedule is done: nothing more is admitted."""
        return self._closed

    def counts(self) -> dict[str, int]:
        """The run's group counters: ``num_dropped_groups`` (too stale, or of undone weights),
        ``num_failed_groups``, ``num_zero_variance_groups`` (replaced by dynamic sampling),
        ``num_reissued_groups`` (re-issued because their roller left the pool)."""
        return dict(self._counts)

    def holds(self, uid: str) -> bool:
        return uid in self._groups

    def refill_round(self, uid: str) -> int:
        """The dynamic-sampling round that admitted ``uid`` (0: a prompt of the stream)."""
        group = self._groups.get(uid)
        return group.refill_round if group is not None else 0

    def staleness(self, min_weight_version: int) -> int:
        """Staleness of a sample if the trainer's next update trained it (:func:`staleness` from
        ``weight_version``)."""
        return staleness(self._weight_version, min_weight_version)

    def admission_limit(self) -> int:
        """The largest ``started − released`` at which one more group may still start, at the rollers'
        version."""
        return (self._max_staleness + self._synced_weight_version + 1) * self._batch - 1

    def _bound_headroom(self) -> int:
        """Groups the staleness bound alone would still let start (negative past it)."""
        return self.admission_limit() + 1 - (self._started - self._released)

    def num_admissible(self, bounded: bool = True) -> int:
        """How many groups may start now: within the run's total, and with ``bounded`` within the staleness
        bound; 0 once the data is exhausted or admission is closed."""
        if self._exhausted or self._closed:
            return 0
        k = self._total_groups - (self._started - self._released)
        if bounded:
            k = min(k, self._bound_headroom())
        return max(0, k)

    def at_cap(self) -> bool:
        """A bounded schedule could admit nothing now for the staleness bound alone (the data not exhausted)."""
        return not self._exhausted and self._bound_headroom() <= 0

    # ---------------------------------------------------------------------------------------- admission

    def reserve(self, max_groups: int, bounded: bool = True) -> int:
        """Count up to ``max_groups`` groups as started before the feeder is asked for them (a concurrent
        admission sees them); how many. Follow with :meth:`admitted`."""
        k = min(max_groups, self.num_admissible(bounded))
        if k <= 0:
            return 0
        self._started += k
        return k

    def admitted(self, reserved: int, uids: list[str]) -> None:
        """The feeder put ``uids`` for ``reserved`` slots: track them; fewer than reserved means the data ran
        out (the unfilled slots are un-started)."""
        if len(uids) > reserved:
            raise ValueError(f"{len(uids)} groups admitted for {reserved} slots")
        if len(uids) < reserved:
            self._exhausted = True
            self._started -= reserved - len(uids)
        self._track(uids)

    def adopt(self, uids: list[str]) -> None:
        """Track groups a job checkpoint restored (buffered samples, or in flight and re-issued): already
        counted as started by the restored counters."""
        self._track(uids)

    def out_of_data(self) -> None:
        """The feeder had no prompt for a replacement."""
        self._exhausted = True

    def close(self) -> None:
        """The schedule ended: admit nothing more (until :meth:`reopen`)."""
        self._closed = True

    def reopen(self) -> None:
        """A trainer restart runs the schedule again."""
        self._closed = False

    def _track(self, uids: list[str], refill_round: int = 0) -> None:
        now = time.monotonic()
        for uid in uids:
            self._groups[uid] = _Group(now, refill_round)

    # ------------------------------------------------------------------------------------------ outcomes

    def replaced(self, uid: str, new_uid: str, why: str) -> None:
        """Group ``uid`` left untrained and ``new_uid`` took its slot (``why``: one of ``REPLACE_REASONS``):
        a re-issue keeps its dynamic-sampling round, a zero-variance replacement is one round deeper. Raises
        ValueError for an unknown reason; an unknown ``uid`` (not tracked: e.g. a roller's group seen after a
        resume) is replaced all the same."""
        if why not in REPLACE_REASONS:
            raise ValueError(f"replacement reason {why!r} is not one of {list(REPLACE_REASONS)}")
        old = self._groups.pop(uid, None)
        depth = old.refill_round if old is not None else 0
        self._released += 1
        self._started += 1
        if why == ZERO_VARIANCE:
            self._counts["num_zero_variance_groups"] += 1
            depth += 1
        elif why == REISSUED_ROLLER_LEFT:
            self._counts["num_reissued_groups"] += 1
        else:
            self._counts["num_dropped_groups"] += 1
        self._track([new_uid], depth)

    def failed(self, uids: list[str], skipped: bool) -> None:
        """Groups ``uids`` failed; ``skipped`` (``rollers.on_failed_group=skip``): they leave the ledger, and
        in a schedule that replaces failed groups their slots are released for fresh prompts."""
        self._counts["num_failed_groups"] += len(uids)
        if not skipped:
            return
        for uid in uids:
            self._groups.pop(uid, None)
        if self._replaces_failed:
            self._released += len(uids)

    def trained(self, uids: list[str]) -> list[TrainedGroup]:
        """A trainer update on the groups ``uids`` completed: the version and step advance by one and the
        groups leave the ledger; what it knew of each (in the order given, each uid once)."""
        self._weight_version += 1
        now = time.monotonic()
        out = []
        for uid in dict.fromkeys(uids):
            group = self._groups.pop(uid, None)
            out.append(TrainedGroup(uid, now - group.admitted_at if group else 0.0, group.refill_round if group else 0))
        return out

    def synced(self, weight_version: int) -> None:
        """Every roller holds ``weight_version`` now (a completed sync): admission may allow more. Raises
        ValueError when that is ahead of the trainer's version."""
        if weight_version > self._weight_version:
            raise ValueError(f"synced weight_version {weight_version} is ahead of the trainer's "
                             f"{self._weight_version}")
        self._synced_weight_version = weight_version
        self._num_syncs += 1

    def rewind(self, weight_version: int) -> None:
        """A trainer restart took the trainer back to ``weight_version`` (its step with it). The rollers'
        version is taken no higher (the rollers newer than it are replaced; until the next sync the bound
        counts from the restored version)."""
        self._weight_version = weight_version
        self._synced_weight_version = min(self._synced_weight_version, weight_version)

    def requeued(self, uids: list[str]) -> None:
        """Trained groups a trainer restart undid go back to the feeder: their slots are released (each starts
        again when admitted) and the data is not exhausted any more."""
        self._released += len(uids)
        self._exhausted = False

    # ------------------------------------------------------------------------------------------- state

    def to_state(self) -> dict:
        """The ledger's part of a job checkpoint (JSON-able; ``format`` = ``FORMAT``). The live groups are not
        in it: a resume finds them in the data plane (buffered) or re-issues them (in flight), and adopts
        them; their refill rounds are."""
        return {"format": FORMAT, "weight_version": self._weight_version,
                "synced_weight_version": self._synced_weight_version, "num_syncs": self._num_syncs,
                "started": self._started, "released": self._released, "exhausted": self._exhausted,
                "counts": dict(self._counts),
                "refill_rounds": {u: g.refill_round for u, g in self._groups.items() if g.refill_round}}

    def restore(self, state: dict) -> dict[str, int]:
        """Take the counters and versions of a ``to_state`` dict (or of a format-1 job.json: see
        :func:`ledger_state`) for a resume; returns the refill rounds of the groups then live (uid -> round),
        for :meth:`adopt_rounds`. The rollers' version is 0 (a resume starts fresh rollers, holding the initial
        weights until its first sync). Raises ValueError naming an unknown format."""
        state = ledger_state(state)
        self._weight_version = int(state["weight_version"])
        self._synced_weight_version = 0
        self._num_syncs = int(state["num_syncs"])
        self._started, self._released = int(state["started"]), int(state["released"])
        self._exhausted = bool(state["exhausted"])
        self._counts.update({k: int(v) for k, v in state["counts"].items() if k in self._counts})
        return {str(u): int(r) for u, r in state["refill_rounds"].items()}

    def adopt_rounds(self, rounds: dict[str, int]) -> None:
        """Give tracked groups their refill rounds (after :meth:`restore`; a re-issued group keeps its
        predecessor's: pass it under the new uid)."""
        for uid, depth in rounds.items():
            if uid in self._groups:
                self._groups[uid].refill_round = depth


def ledger_state(job: dict) -> dict:
    """The ledger state (format ``FORMAT``) in a job.json dict: its ``ledger`` entry, or — a checkpoint
    written before the ledger (no ``format``: format 1) — built from its flat fields. Raises ValueError
    naming the format when it is neither."""
    if "format" not in job and "admission_started" in job:  # format 1: 8a54b85 and before
        return {"format": FORMAT, "weight_version": job["weight_version"],
                "synced_weight_version": job["synced_weight_version"], "num_syncs": job["num_syncs"],
                "started": job["admission_started"], "released": job["admission_dropped"],
                "exhausted": bool(job["feeder"]["exhausted"]),
                "counts": {"num_dropped_groups": job["num_dropped_groups"],
                           "num_failed_groups": job["num_failed_groups"],
                           "num_zero_variance_groups": job["num_zero_variance_groups"]},
                "refill_rounds": dict(job["refill_depth"])}
    state = job.get("ledger", job)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"job checkpoint format {found!r} is not one this version reads (1 or {FORMAT})")
    return state
