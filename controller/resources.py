"""How many torch threads each pool gets: ``auto`` per mode, explicit integers as overrides.

::

    sync           generate ──> train ──> generate ...   the phases alternate: each pool may use every core
                   rollers: cores // num_replicas threads each; trainer: cores // num_ranks per rank
    one-step-off   generate ═══╗                          the phases overlap, cores split: half to the
                   train    ═══╝                          rollers, half (+ an odd core) to the trainer
    fully-async    generate ═══╗                          the trainer every core, the rollers half of them
                   train    ═══╝                          on top (oversubscribed while they decode)

Training scales with cores and is the bottleneck of the overlapping modes here; decoding is bound by reading
the weights and gains little from threads (``bench/modes_bench.py``'s calibration, 2 cores: a training
sample 0.69 s at 2 threads, 1.27 s at 1; a decode step 0.08-0.16 s at either). So the trainer gains from
every core while the rollers idle, and loses badly while they decode (two trainer threads on a core shared
with a roller wait on each other). Measured on 2 cores, quiet (bench/README.md):

* main job without validation (3 runs each): ``r1x1-t2`` (trainer 2 threads, roller 1 on top) beat a core
  each (``r1x1-t1``) by ~20% in both modes (one-step-off 0.93 vs 0.78, fully-async 0.97 vs 0.81 samples/s);
* the default preset with validation (``bench/learning_bench.py --quick``, one run each): an update that
  overlaps a validation round (160 held-out samples on the roller) takes 60-68 s at ``r1x1-t2`` instead of
  ~25 s. ``fully-async`` still gains (time to 12 updates, validation waits left out: 377 s vs 398 s at
  ``r1x1-t1``); ``one-step-off``, which also waits for each round before its next weight sync, loses
  (427 s vs 354 s).

Hence the split for ``one-step-off`` and the oversubscription for ``fully-async``, made cooperative by core
lending (``common.core_lending``: the trainer runs with its threads minus those of the rollers decoding
now, so ``trainer.num_threads`` is the most it uses) whenever, in either overlapping mode, the pools'
threads exceed the cores, the rollers use the torch engine and the job starts its own one-node Ray cluster
(``ray.address`` empty: every process on this machine). ``one-step-off`` at ``r1x1-t2`` with lending
(``algorithm.bypass_mode`` on) measured 1.10 samples/s (1.06-1.26, 3 runs) against 1.08 at its split
(one run): no clear gain, so its ``auto`` stays split. An explicit integer for
one pool is kept as given, and ``auto`` on the other pool then gets the cores left (at least one thread).
``cores`` is ``common.env.available_cores()``: the machine the controller runs on (one-node jobs). Ray's CPU
counts are logical and do not enter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from common.env import AUTO_THREADS, available_cores, pins_ray_to_loopback
from controller.config import HFlowConfig
from controller.schedules import SCHEDULES


@dataclass(frozen=True)
class ThreadPlan:
    """The torch threads of each roller process and each trainer rank, and how they were chosen."""

    num_cores: int
    roller_threads: int
    trainer_threads: int
    num_replicas: int
    num_ranks: int
    chosen: str  # "auto" / "explicit" per pool, e.g. "rollers auto, trainer explicit"
    core_lending: bool = False  # common.core_lending: the trainer takes the cores of idle rollers

    @property
    def oversubscribed(self) -> bool:
        """The pools' threads together exceed the cores (they share cores while both run)."""
        return self.roller_threads * self.num_replicas + self.trainer_threads * self.num_ranks > self.num_cores

    def describe(self, mode: str) -> str:
        share = ("phases alternate, every core to each" if not SCHEDULES.get(mode).overlapping
                 else "phases overlap, the trainer every core, rollers on top" if self.oversubscribed
                 else "phases overlap, cores split")
        share += ", the trainer yielding theirs while they decode" if self.core_lending else ""
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
    schedule = SCHEDULES.get(cfg.mode)
    if not schedule.overlapping:
        roller_cores = trainer_cores = cores
    elif roller == AUTO_THREADS and trainer == AUTO_THREADS:
        roller_cores = max(replicas, cores // 2)
        trainer_cores = cores if schedule.trainer_takes_every_core else max(ranks, cores - roller_cores)
    elif roller == AUTO_THREADS:
        roller_cores = cores - int(trainer) * ranks
        trainer_cores = 0
    else:
        roller_cores = 0
        trainer_cores = cores - int(roller) * replicas
    roller_threads = max(1, roller_cores // replicas) if roller == AUTO_THREADS else int(roller)
    trainer_threads = max(1, trainer_cores // ranks) if trainer == AUTO_THREADS else int(trainer)
    plan = ThreadPlan(cores, roller_threads, trainer_threads, replicas, ranks, chosen)
    lending = (schedule.overlapping and plan.oversubscribed and cfg.rollers.engine == "torch"
               and pins_ray_to_loopback(cfg.ray.address))
    return replace(plan, core_lending=lending)
