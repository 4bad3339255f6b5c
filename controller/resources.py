"""How many torch threads each pool gets: ``auto`` per mode, explicit integers as overrides.

::

    sync           generate ──> train ──> generate ...   the phases alternate: each pool may use every core
                   rollers: cores // num_replicas threads each; trainer: cores // num_ranks per rank
    one-step-off,  generate ═══╗                          the phases overlap: the cores are split
    fully-async    train    ═══╝                          half to the rollers, half (+ an odd core) to the trainer

Why half and half: on the main job (SmolLM2-135M, ``chain_sum``, 16 samples of <= 32 tokens per step) a
step's generation and its training cost about the same at equal threads (issue 20: ~12 s and ~11 s at 2
threads); where they overlap the trainer is the bottleneck, so the odd core goes to it. An explicit
integer for one pool is kept as given, and ``auto`` on the other pool then gets the cores left (at least
one thread). ``cores`` is ``common.env.available_cores()``: the machine the controller runs on (one-node
jobs). Ray's CPU counts are logical and do not enter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from common.env import AUTO_THREADS, available_cores
from controller.config import HFlowConfig

OVERLAPPING_MODES = ("one-step-off", "fully-async")


@dataclass(frozen=True)
class ThreadPlan:
    """The torch threads of each roller process and each trainer rank, and how they were chosen."""

    num_cores: int
    roller_threads: int
    trainer_threads: int
    num_replicas: int
    num_ranks: int
    chosen: str  # "auto" / "explicit" per pool, e.g. "rollers auto, trainer explicit"

    def describe(self, mode: str) -> str:
        share = "phases alternate, every core to each" if mode not in OVERLAPPING_MODES else "phases overlap, cores split"
        return (f"threads: {self.num_replicas} roller(s) x {self.roller_threads}, {self.num_ranks} trainer rank(s) x "
                f"{self.trainer_threads} on {self.num_cores} cores ({mode}: {share}; {self.chosen})")

    def to_dict(self) -> dict:
        return asdict(self)


def plan_threads(cfg: HFlowConfig, num_cores: int | None = None) -> ThreadPlan:
    """Resolve ``rollers.num_threads`` and ``trainer.num_threads`` (``auto`` or integers) for ``cfg.mode`` on
    ``num_cores`` cores (default ``available_cores()``); see the module docstring. Never fewer than one
    thread per process (more processes than cores then share them)."""
    cores = num_cores or available_cores()
    replicas, ranks = cfg.rollers.num_replicas, cfg.trainer.num_ranks
    roller, trainer = cfg.rollers.num_threads, cfg.trainer.num_threads
    chosen = f"rollers {'auto' if roller == AUTO_THREADS else 'explicit'}, " \
             f"trainer {'auto' if trainer == AUTO_THREADS else 'explicit'}"
    if cfg.mode not in OVERLAPPING_MODES:
        roller_cores = trainer_cores = cores
    elif roller == AUTO_THREADS and trainer == AUTO_THREADS:
        roller_cores = max(replicas, cores // 2)
        trainer_cores = max(ranks, cores - roller_cores)
    elif roller == AUTO_THREADS:
        roller_cores = cores - int(trainer) * ranks
        trainer_cores = 0
    else:
        roller_cores = 0
        trainer_cores = cores - int(roller) * replicas
    roller_threads = max(1, roller_cores // replicas) if roller == AUTO_THREADS else int(roller)
    trainer_threads = max(1, trainer_cores // ranks) if trainer == AUTO_THREADS else int(trainer)
    return ThreadPlan(cores, roller_threads, trainer_threads, replicas, ranks, chosen)
