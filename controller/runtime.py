"""The pools of a job, started and stopped as one: the TransferQueue servers, the prompt feeder, the
roller pool, the trainer group, and the weight-sync wiring between trainers and rollers.

::

    controller ── TQClient (metadata only: get_meta / status / clear) ──┐
        │                                                              │
        ├── PromptFeeder (Ray actor, started first) ──put prompt rows──> TransferQueue servers (index + units)
        ├── RollerPool (controller.pool): N RollerActors, elastic ──take prompt / put samples──┘    ▲
        ├── TrainerGroup: M FSDP2 ranks (placement group) ──get_data(meta slice)──────────┘
        └── weight sync: trainer rank(s) ──checkpoint engine (versioned buckets)──> every roller

The prompt feeder is started first, on its own (``start_feeder``): it loads and checks the data once, so
a data error ends a job's start before its run directory or any other pool exists; ``Runtime`` takes it.
Every handle that crosses a process boundary is a small dict (addresses, keys); no tensor passes
through the controller. While a schedule runs (``Runtime.watch``), a TransferQueue server process that dies
ends the run at once with ``ServerLost`` naming it, how it ended and the run's last job checkpoint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from controller.config import HFlowConfig
from controller.layout import (
    PARTITION,
    PROMPT_PARTITION,
    index_samples,
    sample_fields,
)

if TYPE_CHECKING:
    from controller.feeder import DataFacts
    from controller.pool import RollerPool

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often start-up looks at the pools that are not ready yet
WATCH_PERIOD_S = 0.5  # how often a running schedule's TransferQueue server processes are checked (Runtime.watch)


def roller_channel(cfg: HFlowConfig, tq_handle: dict) -> Callable[[], Any]:
    """A factory of the ``rollers.tq_channel.TQGroupChannel`` each roller of this run builds in its own
    process (``tq_handle``: ``TQHandle.to_dict()``): training prompts from ``PROMPT_PARTITION``, samples of
    ``rollout.n`` into ``PARTITION``, validation groups first when ``data.val_size`` > 0, and
    ``response_text`` when ``sample_fields`` holds it."""
    from common import schema
    from controller.validation import VAL_PARTITION, VAL_PROMPT_PARTITION
    from rollers.tq_channel import GroupSource, TQGroupChannel

    validation = (GroupSource(VAL_PROMPT_PARTITION, VAL_PARTITION, cfg.val.n + int(cfg.val.greedy),
                              int(cfg.val.greedy)) if cfg.data.val_size else None)
    return functools.partial(TQGroupChannel.from_handle, tq_handle, PROMPT_PARTITION, PARTITION, cfg.rollout.n,
                             validation=validation, put_text=schema.RESPONSE_TEXT in sample_fields(cfg))


def start_feeder(cfg: HFlowConfig, num_batches: int, context_length: int | None) -> tuple[Any, DataFacts]:
    """Start the prompt feeder (a Ray actor: ``controller.feeder.FeederActor``), which loads, tokenizes and
    checks the data for ``num_batches`` prompt batches and the model's ``context_length`` (tokens; None: not
    checked); returns it with its ``DataFacts``. Raises the feeder's ValueError naming what is wrong with the
    data (the actor is killed then). Ray must be initialised; the caller owns the actor (``Runtime`` takes it)."""
    import ray

    from controller.feeder import FeederActor
    from controller.validation import VAL_PROMPT_PARTITION

    feeder = ray.remote(num_cpus=0.1)(FeederActor).remote(cfg, num_batches, context_length, PROMPT_PARTITION,
                                                          VAL_PROMPT_PARTITION)
    try:
        return feeder, ray.get(feeder.facts.remote())
    except ray.exceptions.RayTaskError as err:
        ray.kill(feeder, no_restart=True)
        cause = getattr(err, "cause", None)
        if isinstance(cause, ValueError):
            raise cause from None
        raise
    except BaseException:
        ray.kill(feeder, no_restart=True)
        raise


class Runtime:
    """Starts every pool of ``cfg`` around the prompt ``feeder`` already started (``start_feeder``; Ray must be
    initialised); ``close()`` stops them all, the feeder included, idempotently.

    ``on_stage``: called with a short line (``"starting 2 rollers (torch engine)"``) as each pool starts.
    """

    def __init__(self, cfg: HFlowConfig, feeder, on_stage: Callable[[str], None] = lambda what: None):
        from controller.resources import plan_threads

        self.cfg = cfg
        self.tq_servers = None
        self.feeder = feeder
        self.pool: RollerPool | None = None
        self.trainer = None
        self.tq = None
        # Seconds each start-up stage took. The rollers and the trainer start at the same time, so
        # rollers_s and trainer_s overlap (each is from its launch until it is ready).
        self.startup_s: dict[str, float] = {}
        self.core_lending_dir: str | None = None  # common.core_lending, when the thread plan lends
        try:
            self.threads = plan_threads(cfg)
            if self.threads.core_lending:
                self.core_lending_dir = tempfile.mkdtemp(prefix="hflow-cores-")
            self._start(cfg, on_stage)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: HFlowConfig, on_stage: Callable[[str], None]) -> None:
        import ray

        from common.schema import REMAX_BASELINE
        from controller.pool import RollerPool
        from controller.tasks import resolve_reward
        from rollers.actor import remote_roller
        from transferqueue.client import TQClient
        from transferqueue.launch import start_transferqueue

        n_units, n_ranks, n_rollers = (cfg.transferqueue.num_storage_units, cfg.trainer.num_ranks,
                                       cfg.rollers.num_replicas)
        clock = _StageClock(self.startup_s)
        on_stage(self.threads.describe(cfg.mode))
        on_stage(f"starting the TransferQueue (index + {n_units} storage unit{'s' * (n_units > 1)})")
        self.tq_servers = start_transferqueue(cfg.transferqueue.sized_for(index_samples(cfg)))
        handle = self.tq_servers.handle.to_dict()
        self.tq = TQClient(self.tq_servers.handle)
        ray.get(self.feeder.connect.remote(handle))
        clock.done("transferqueue_s")
        # Launch the rollers (actor creation does not block), then build the trainer meanwhile: their
        # processes start and load models concurrently.
        on_stage(f"starting {n_rollers} roller{'s' * (n_rollers > 1)} ({cfg.rollers.engine} engine) and "
                 f"{n_ranks} trainer rank{'s' * (n_ranks > 1)} (model {cfg.model.path}) at once")
        roller_cls = remote_roller(num_cpus=0.5, resources=cfg.rollers.resources)
        channel = roller_channel(cfg, handle)
        reward = resolve_reward(cfg.rollout.reward, cfg.data.task)
        rollers_cfg = dataclasses.replace(cfg.rollers, num_threads=self.threads.roller_threads)
        remax = REMAX_BASELINE in sample_fields(cfg)  # ReMax's greedy baseline, an estimator's roller extra

        def make_roller(name: str):
            return roller_cls.remote(cfg.model, cfg.rollout, rollers_cfg, reward, channel, remax_baseline=remax,
                                     roller_id=name, core_lending_dir=self.core_lending_dir)

        self.pool = RollerPool(cfg, make_roller)
        self.pool.place(n_rollers)
        waits = {m.actor.stats.remote(): "rollers_s" for m in self.pool.members.values()}  # answered once a constructor is done
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer-start") as pool:
            trainer = pool.submit(self._make_trainer)
            try:
                self._wait_ready(waits, trainer, clock)
            except BaseException:  # a roller failed: never leave the trainer's actors behind
                with contextlib.suppress(BaseException):
                    self.trainer = trainer.result()  # close() stops it
                raise
            self.trainer = trainer.result()
        clock.done("pools_s")
        on_stage(f"connecting weight sync ({cfg.checkpointengine.backend}) and starting the rollers' loops")
        self.pool.start(self.trainer)
        clock.done("weight_plane_s")

    def _make_trainer(self):
        """A new ``TrainerGroup`` of ``cfg.trainer`` (its ranks start and load the initial model; blocking)."""
        from trainers.group import TrainerGroup

        cfg = self.cfg
        trainer_cfg = dataclasses.replace(cfg.trainer, num_threads=self.threads.trainer_threads)
        return TrainerGroup(trainer_cfg, cfg.algorithm, cfg.model, temperature=cfg.rollout.temperature,
                            max_response_length=cfg.rollout.max_response_length,
                            tq_handle=self.tq_servers.handle.to_dict(), core_lending_dir=self.core_lending_dir)

    def restart_trainer(self) -> None:
        """Replace the trainer group with a new one (new processes and placement group, the initial weights;
        blocking): after a lost rank (``controller.trainer_restart``). The other pools keep running; the caller
        loads a checkpoint and rewires the weight plane (``RollerPool.rewire``)."""
        old, self.trainer = self.trainer, None
        if old is not None:
            old.shutdown()
        self.trainer = self._make_trainer()

    @staticmethod
    def _wait_ready(waits: dict, trainer: concurrent.futures.Future, clock: _StageClock) -> None:
        """Wait for every ref of ``waits`` (ref -> the ``startup_s`` key it completes) and for ``trainer``,
        noting when each pool became ready; raises the first failure (a pool's own error)."""
        import ray

        pending = dict(waits)
        while pending or not trainer.done():
            if trainer.done() and "trainer_s" not in clock.out:
                trainer.result()  # raises the trainer's start error
                clock.done("trainer_s", restart=False)
            if not pending:
                concurrent.futures.wait([trainer], timeout=_POLL_S)
                continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            for ref in ready:
                ray.get(ref)  # raises a failed constructor's error
                key = pending.pop(ref)
                if key not in pending.values():  # the last roller is ready
                    clock.done(key, restart=False)
        if "trainer_s" not in clock.out:
            trainer.result()
            clock.done("trainer_s", restart=False)

    async def watch(self, schedule: Coroutine) -> Any:
        """Run ``schedule`` (a coroutine) while checking the TransferQueue server processes every
        ``WATCH_PERIOD_S`` (``TQServers.check``: one ``waitpid`` each). When one has died, the schedule is
        cancelled and awaited while it unwinds, and ServerLost is raised naming the server, how it ended and
        the run's last job checkpoint: the samples it held are gone, so the run cannot go on (never a hang
        until a request timeout). A schedule that fails while a server is dead raises that ServerLost too
        (the schedule's own error chained: often a client's ServerLost, which cannot know the cause). A
        cancellation of the caller (a stop signal) is passed on to the schedule, which is awaited to its end (an
        error it ends with meanwhile is logged, and the cancellation re-raised)."""
        task = asyncio.ensure_future(schedule)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=WATCH_PERIOD_S)
                lost = None if task.done() else self._lost_server()
                if lost is not None:
                    logger.error("%s: stopping the run", lost)
                    task.cancel()
                    await _wait_out(task)
                    raise lost from _error_of(task)
        except asyncio.CancelledError:
            task.cancel()
            await _wait_out(task)
            # Retrieved here, or asyncio prints it as a traceback when the task is collected: a stop sent to every
            # process of the job can end a stage with the error of a rank it killed (TrainerRankLost) instead of
            # the cancellation.
            error = _error_of(task)
            if not isinstance(error, asyncio.CancelledError | None):
                logger.info("the schedule ended with %s: %s while it stopped", type(error).__name__, error)
            raise
        error = _error_of(task)
        if error is not None and not isinstance(error, asyncio.CancelledError):
            lost = self._lost_server()
            if lost is not None:
                raise lost from error
        return task.result()

    def _lost_server(self) -> Exception | None:
        """ServerLost for a TransferQueue server process that exited (with the run's resume point), or None."""
        from controller.job_checkpoint import list_checkpoints
        from transferqueue.records import ServerLost

        try:
            if self.tq_servers is not None:
                self.tq_servers.check()
        except ServerLost as lost:
            found = list_checkpoints(self.cfg.run_dir)
            resume = (f"hflow-async --resume {self.cfg.run_dir} continues it from its job checkpoint of step "
                      f"{max(found)}" if found else "no job checkpoint was written yet (trainer.save_every)")
            return ServerLost(lost.server, f"{lost}; what it held is lost, so the run stops: {resume}")
        return None

    def close(self) -> None:
        """Stop rollers, trainers, feeder and the TransferQueue servers (each at most once)."""
        import ray

        if self.pool is not None:
            self.pool.close()
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None
        if self.feeder is not None:
            ray.kill(self.feeder, no_restart=True)
            self.feeder = None
        if self.tq is not None:
            self.tq.close()
            self.tq = None
        if self.tq_servers is not None:
            self.tq_servers.shutdown()
            self.tq_servers = None
        if self.core_lending_dir is not None:
            shutil.rmtree(self.core_lending_dir, ignore_errors=True)
            self.core_lending_dir = None


class _StageClock:
    """Writes the seconds since the last (re)start into ``out[name]`` at each ``done``."""

    def __init__(self, out: dict[str, float]):
        self.out = out
        self.t0 = time.monotonic()

    def done(self, name: str, restart: bool = True) -> None:
        now = time.monotonic()
        self.out[name] = now - self.t0
        if restart:
            self.t0 = now


def _error_of(task: asyncio.Task) -> BaseException | None:
    """The exception ``task`` ended with (CancelledError when it was cancelled), None for a result."""
    return asyncio.CancelledError() if task.cancelled() else task.exception()


async def _wait_out(task: asyncio.Task) -> None:
    """Await ``task`` to its end. A cancellation arriving meanwhile (a stop signal is repeated each second)
    is passed on to ``task`` and does not end the wait: the caller goes on only once every stage unwound."""
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
