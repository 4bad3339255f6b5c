"""Staleness admission control, and the definition of staleness used everywhere.

``weight_version`` is the trainer's count of completed updates. A sample's staleness when trained is the
trainer's version at that update minus the sample's ``min_weight_version``. The controller starts a new
prompt group only while

    started − dropped ≤ (max_staleness + weight_version + 1) × train_batch_size − 1

so producers never run further ahead than the bound. ``weight_version`` here is the version the rollers hold
(the last synced one): it equals the trainer's version right after each sync, and is never ahead of it,
so the bound is kept even while a sync is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    """Counts prompt groups started and dropped; says how many more may start.

    ``train_batch_size``: prompt groups per trainer step; ``max_staleness``: the bound, in versions.
    ``started``/``dropped`` count since the start of the run (or resume, restored from the checkpoint).
    """

    train_batch_size: int
    max_staleness: int
    started: int = 0
    dropped: int = 0

    def __post_init__(self):
        if self.train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {self.train_batch_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def limit(self, weight_version: int) -> int:
        """The largest ``started − dropped`` at which one more group may still start."""
        return (self.max_staleness + weight_version + 1) * self.train_batch_size - 1

    def num_admissible(self, weight_version: int) -> int:
        """How many groups may start now at rollers' weight version ``weight_version`` (never negative)."""
        return max(0, self.limit(weight_version) + 1 - (self.started - self.dropped))

    def start(self, num_groups: int, weight_version: int) -> None:
        """Record ``num_groups`` started; raises ValueError if that exceeds what is admissible."""
        if num_groups > self.num_admissible(weight_version):
            raise ValueError(
                f"admitting {num_groups} groups exceeds the staleness bound: at weight_version {weight_version} "
                f"only {self.num_admissible(weight_version)} may start (started={self.started}, "
                f"dropped={self.dropped})"
            )
        self.started += num_groups

    def drop(self, num_groups: int) -> None:
        """Record ``num_groups`` dropped (discarded as too stale and re-issued, replaced by dynamic sampling, or
        failed and skipped in fully-async): their slots may start other groups."""
        self.dropped += num_groups


def max_live_groups(train_batch_size: int, max_staleness: int) -> int:
    """The most prompt groups any schedule has started and neither trained nor dropped at once: ``sync`` one
    batch, ``one-step-off`` two, ``fully-async`` ``max_staleness + 1`` (``Admission.limit`` at any version,
    every earlier version having trained its batch). What sizes the TransferQueue index
    (``transferqueue.max_samples``)."""
    return max(max_staleness + 1, 2) * train_batch_size


def staleness(trainer_weight_version: int, min_weight_version: int) -> int:
    """Staleness of a sample trained at ``trainer_weight_version`` whose first token came from
    ``min_weight_version``."""
    return trainer_weight_version - min_weight_version
