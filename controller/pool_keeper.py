"""Keeps the roller pool whole while a schedule runs: health checks, lost rollers, joins and scale requests.

::

    PoolKeeper.run (a task beside the schedule)
       every HEALTH_PERIOD_S: ping every roller (RollerPool.check_health)
          lost → retire (kill) → re-issue the groups no live roller holds (find_orphans → Stages.reissue)
               → a replacement joins (rollers.max_restarts; past it the pool shrinks)
          no roller left and none joining → RolloutFailure (the run fails; never a silent hang)
       a scale request (``scale_to``): joins, or drains the oldest rollers, one request at a time
       rollers.autoscale: ``Autoscaler`` decides a scale_to from RL signals (trainer starved / staleness cap)

Each change is a scale event (direction, reason, roller, pool size): logged, counted in
``hflow_roller_scale_events_total{reason}``, and written with the next step's record of ``metrics.jsonl``.
Each roller that joins (scale-up, autoscale, replacement) gets a row of ``joins``: seconds from the request
to active (``join_to_active_s``: it holds the current weights and takes work) and to the end of the first
trainer step that trained a group it generated (``join_to_first_trained_s``). Samples do not name their
roller: the keeper asks the new roller which groups it put (``recent_put_uids``, each health period) and
matches them with the uids of the steps trained since it joined (``note_trained``, called by the schedule).
The rows go to the next step's record (``roller_joins``) once complete, and all of them to the summary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from controller.layout import PROMPT_PARTITION
from controller.ledger import REISSUED_ROLLER_LEFT
from controller.metrics import SCALE_REASONS
from controller.pool import RollerLost, find_orphans

logger = logging.getLogger(__name__)

HEALTH_PERIOD_S = 1.0
DRAIN_TIMEOUT_S = 60.0  # a draining roller's held groups finish within this, else they are handed back
MAX_TRAINED_STEPS_KEPT = 1000  # steps remembered while a joined roller waits for its first trained group
FINAL_CREDIT_TIMEOUT_S = 5.0  # the last look for first trained groups when the schedule ends


class NoRollerLeft(RuntimeError):
    """Every roller was lost and no replacement is allowed or joining: the run cannot go on."""


class PoolKeeper:
    """The keeper of ``stages.rt.pool`` (see the module docstring). ``start()`` once the schedule runs;
    ``stop()`` at its end; ``raise_error()`` re-raises what ended the keeper."""

    def __init__(self, stages):
        self.st = stages
        self.cfg = stages.cfg
        self.metrics = stages.metrics
        self.num_restarts = 0
        self.num_lost = 0
        self.num_weight_sync_timeouts = 0
        self.events: list[dict] = []        # since the last step record (take_events)
        # Rollers that joined while the schedule ran, one row each (the summary's roller_joins; rows completed
        # in place), and the rows whose first trained group became known since the last step record.
        self.joins: list[dict] = []
        self.first_trained: list[dict] = []
        self._waiting: dict[str, _Join] = {}  # joined rollers whose first trained group is not known yet
        # (end time, uids) of each step trained while a join waits: its first trained group may be learnt later
        self._trained: deque[tuple[float, frozenset[str]]] = deque(maxlen=MAX_TRAINED_STEPS_KEPT)
        self._asked: dict[str, float] = {}    # roller joining -> time.monotonic() it was asked for
        self._changing = asyncio.Lock()      # one recovery at a time
        self._scaling = asyncio.Lock()       # one scale request at a time
        self._reissuing = asyncio.Lock()     # one look for orphans (and their re-issue) at a time
        self._joins: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        self._autoscaling: asyncio.Task | None = None
        self.autoscaler = Autoscaler(self) if self.cfg.rollers.autoscale else None

    # --------------------------------------------------------------------------------------- running

    @property
    def pool(self):
        """The pool it keeps (``stages.rt.pool``; looked up when used, so a Stages without pools can exist)."""
        return self.st.rt.pool

    def start(self) -> None:
        self.metrics.pool_size.set(self.pool.size())
        self._task = asyncio.ensure_future(self.run())

    async def stop(self) -> None:
        """Cancel the keeper and any join in flight, and wait for them (the pools are closed after); then
        look once more for the first trained group of the rollers that still wait (the last steps may have
        trained it), for at most ``FINAL_CREDIT_TIMEOUT_S``."""
        tasks = [t for t in (self._task, self._autoscaling, *self._joins) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._waiting:
            try:
                await asyncio.wait_for(self.credit_joins(), FINAL_CREDIT_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a measurement must never fail the run's end
                logger.debug("last look for first trained groups: %s", exc)

    def raise_error(self) -> None:
        if self._task is not None and self._task.done() and not self._task.cancelled():
            self._task.result()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            lost = await self.pool.check_health()
            if lost:
                await self.recover(lost)
            self._check_alive()
            if self.autoscaler is not None:
                self._autoscale()
            if self._waiting:
                await self.credit_joins()

    def _autoscale(self) -> None:
        """Sample the autoscaler's signals; start its decision, if any, in the background."""
        self.autoscaler.sample()
        decision = self.autoscaler.decide()
        if decision is None or (self._autoscaling is not None and not self._autoscaling.done()):
            return
        num_rollers, reason, why = decision
        logger.info("autoscale: %d -> %d rollers (%s): %s", self.pool.size(), num_rollers, reason, why)
        self._autoscaling = asyncio.ensure_future(self.scale_to(num_rollers, up=reason, down=reason))

    def _check_alive(self, changing: bool | None = None) -> None:
        """Raise NoRollerLeft when no roller is live or joining (outside a change in progress)."""
        if self._changing.locked() if changing is None else changing:
            return
        if not self.pool.live() and not self._joins:
            raise NoRollerLeft(f"no roller left: {self.num_lost} lost, {self.num_restarts} replaced "
                               f"(rollers.max_restarts={self.cfg.rollers.max_restarts})")

    # --------------------------------------------------------------------------------------- changes

    def event(self, direction: str, reason: str, roller: str) -> None:
        size = self.pool.size()
        record = {"time": time.time(), "direction": direction, "reason": reason, "roller": roller,
                  "pool_size": size}
        self.events.append(record)
        assert reason in SCALE_REASONS, reason
        self.metrics.scale_events.labels(reason=reason).inc()
        self.metrics.pool_size.set(size)
        if direction == "down":
            try:
                self.metrics.roller_busy.remove(roller)  # a roller that left has no busy ratio
            except KeyError:
                pass
        logger.info("roller pool: %s %s (%s); %d active", "+" if direction == "up" else "-", roller, reason, size)

    async def recover(self, lost: list[RollerLost]) -> None:
        """Take ``lost`` rollers out (kill), re-issue the groups they held, start replacements."""
        async with self._changing:
            fresh = [x for x in lost if x.name in self.pool.members]
            for x in fresh:
                logger.warning("%s; its groups are re-issued", x)
                self.pool.retire(x.name)
                self.num_lost += 1
                if x.reason == "weight_sync":
                    self.num_weight_sync_timeouts += 1
                    self.metrics.weight_sync_timeouts.inc()
                self.event("down", f"lost_{x.reason}", x.name)
            for _ in fresh:  # replacements first: they start while the orphans are looked for
                if self.num_restarts >= self.cfg.rollers.max_restarts:
                    logger.warning("rollers.max_restarts=%d reached: the pool shrinks to %d",
                                   self.cfg.rollers.max_restarts, self.pool.size())
                    continue
                self.num_restarts += 1
                self.metrics.restarts.inc()
                self.spawn("replacement")
            if fresh:
                await self.reissue_orphans()
            self._check_alive(changing=False)

    async def reissue_orphans(self) -> None:
        """Re-issue every group taken by a roller that no live roller holds (metadata only)."""
        async with self._reissuing:
            if self.st.ledger.outstanding <= 0:  # nothing admitted and untrained: nothing can be held
                return
            orphans = await find_orphans(self.st.rt.tq, PROMPT_PARTITION, self.cfg.transferqueue.max_request_ids,
                                         self.pool.held_by_live)
            for uid, sample_ids in orphans.items():
                await self.reissue(uid, sample_ids)

    async def reissue(self, uid: str, sample_ids: list[int]) -> None:
        await self.st.reissue(uid, sample_ids, REISSUED_ROLLER_LEFT, "its roller left the pool",
                              partition=PROMPT_PARTITION)
        self.metrics.reissued_groups.inc()

    # ---------------------------------------------------------------------------------------- resizing

    def check_target(self, num_rollers: int) -> None:
        """ValueError unless ``1 <= num_rollers <= rollers.max_replicas``."""
        top = self.cfg.rollers.max_replicas
        if not 1 <= num_rollers <= top:
            raise ValueError(f"rollers={num_rollers}: the pool holds 1 .. rollers.max_replicas={top} rollers")

    async def scale_to(self, num_rollers: int, up: str = "scale_up", down: str = "scale_down") -> None:
        """Resize the pool to ``num_rollers`` active rollers; returns once the new ones joined (they hold the
        trainer's current weights and take work) or the removed ones drained and left. Serialised and
        idempotent (a request for the current size changes nothing). Scale-down removes the oldest rollers
        (those the job started with included): each takes no new group, finishes what it holds within
        ``DRAIN_TIMEOUT_S`` and hands back the rest, which is re-issued."""
        asked_at = time.monotonic()
        self.check_target(num_rollers)
        async with self._scaling:
            await asyncio.gather(*self._joins, return_exceptions=True)  # joins in flight count as done
            current = self.pool.size()
            if num_rollers > current:
                names = [self.spawn(up, asked_at) for _ in range(num_rollers - current)]
                await asyncio.gather(*[t for t in self._joins if t.get_name() in names], return_exceptions=True)
            elif num_rollers < current:
                victims = [m.name for m in self.pool.live() if m.state == "active"][: current - num_rollers]
                results = await asyncio.gather(*(self.pool.drain(n, DRAIN_TIMEOUT_S) for n in victims),
                                               return_exceptions=True)
                for name, result in zip(victims, results, strict=True):
                    if isinstance(result, BaseException):
                        logger.warning("roller %s left while draining: %s", name, result)
                    self.event("down", down, name)
                await self.reissue_orphans()  # the groups the drained rollers handed back
            self._check_alive(changing=False)

    def spawn(self, reason: str, asked_at: float | None = None) -> str:
        """Start a roller joining in the background (``RollerPool.join``); returns its name. ``asked_at``:
        the ``time.monotonic()`` of the request it answers (default: now), where its join times start."""
        name = self.pool.next_name()
        self._asked[name] = time.monotonic() if asked_at is None else asked_at
        task = asyncio.ensure_future(self._join(name, reason))
        task.set_name(name)
        self._joins.add(task)
        task.add_done_callback(self._joins.discard)
        return name

    async def _join(self, name: str, reason: str) -> None:
        try:
            await self.pool.join(name, self.st.trainer_lock, lambda: self.st.ledger.weight_version)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a roller that cannot join is retired; the pool goes on
            logger.error("roller %s could not join the pool: %s: %s", name, type(exc).__name__, exc)
            self.pool.retire(name)
            self._asked.pop(name, None)
            return
        self.event("up", reason, name)
        asked_at = self._asked.pop(name)
        row = {"roller": name, "reason": reason, "join_to_active_s": time.monotonic() - asked_at,
               "join_to_first_trained_s": None}
        self.joins.append(row)
        self._waiting[name] = _Join(row, asked_at)

    # ------------------------------------------------------------------------------ first trained group

    def take_events(self) -> tuple[list[dict], list[dict]]:
        """The scale events and the completed join rows since the last call (for a step record)."""
        events, self.events = self.events, []
        joins, self.first_trained = self.first_trained, []
        return events, joins

    def note_trained(self, uids: Iterable[str]) -> None:
        """The schedule trained the groups ``uids`` just now (``Stages._record``, at the end of the step)."""
        if self._waiting:
            self._trained.append((time.monotonic(), frozenset(uids)))

    async def credit_joins(self) -> None:
        """For each joined roller still waiting: learn the groups it put (``recent_put_uids``) and find the
        first step that trained one; its end gives ``join_to_first_trained_s`` (from the request). A roller
        that does not answer now is asked again next time; one that left before any of its groups was
        trained keeps None."""
        for name, join in list(self._waiting.items()):
            member = self.pool.members.get(name)
            if member is None:
                del self._waiting[name]
                continue
            if member.in_push:  # its event loop is busy with weights: next time
                continue
            try:
                join.put_uids.update(await self.pool.call(member, "recent_put_uids", timeout_s=2 * HEALTH_PERIOD_S))
            except Exception as exc:  # noqa: BLE001 - a lost roller is the health check's business
                logger.debug("recent_put_uids of %s: %s", name, exc)
                continue
            trained_at = next((t for t, uids in self._trained if not uids.isdisjoint(join.put_uids)), None)
            if trained_at is None or name not in self._waiting:
                continue
            del self._waiting[name]
            join.row["join_to_first_trained_s"] = trained_at - join.asked_at
            self.first_trained.append(dict(join.row))
            logger.info("roller %s (%s): active %.1f s and its first group trained %.1f s after it was asked for",
                        name, join.row["reason"], join.row["join_to_active_s"], join.row["join_to_first_trained_s"])
        if not self._waiting:
            self._trained.clear()


@dataclass
class _Join:
    """A roller waiting for its first trained group: its row of ``PoolKeeper.joins``, when it was asked for
    (``time.monotonic()``) and the uids of the groups it put, as learnt so far."""

    row: dict
    asked_at: float
    put_uids: set[str] = field(default_factory=set)


class Autoscaler:
    """``rollers.autoscale``: one decision per ``rollers.autoscale_period_s`` from signals averaged over that
    window (sampled each health period): add a roller when the trainer waited for data at least
    ``rollers.autoscale_wait_share`` of the window while prompts waited for a roller (the rollers are the
    bottleneck); remove one when, most of the window, admission sat at its staleness cap (fully-async) with
    no prompt waiting (the rollers idle because the bound stops them). Within ``rollers.min_replicas`` ..
    ``rollers.max_replicas``; the window restarts after each decision (the cooldown)."""

    def __init__(self, keeper: PoolKeeper):
        self.keeper, self.st, self.cfg = keeper, keeper.st, keeper.cfg.rollers
        self._reset()

    def _reset(self) -> None:
        self.window_start, self.wait_start = time.monotonic(), self.st.metrics.trainer_wait.total_s()
        self.num_looks = self.num_backlogged = self.num_capped_idle = 0

    def sample(self) -> None:
        st = self.st
        backlog = st.queue_depth.get("rollout", 0) > 0
        at_cap = st.schedule.bounded and st.ledger.at_cap()
        self.num_looks += 1
        self.num_backlogged += backlog
        self.num_capped_idle += at_cap and not backlog

    def decide(self) -> tuple[int, str, str] | None:
        """(new size, reason label, why) when the window is over and a signal fired; None otherwise."""
        elapsed = time.monotonic() - self.window_start
        if elapsed < self.cfg.autoscale_period_s or not self.num_looks:
            return None
        wait_share = (self.st.metrics.trainer_wait.total_s() - self.wait_start) / elapsed
        backlog_share, idle_share = self.num_backlogged / self.num_looks, self.num_capped_idle / self.num_looks
        size = self.keeper.pool.size()
        self._reset()
        logger.debug("autoscale window of %.1f s: trainer waited %.0f%%, prompts waiting %.0f%%, capped idle %.0f%%",
                     elapsed, 100 * wait_share, 100 * backlog_share, 100 * idle_share)
        if wait_share >= self.cfg.autoscale_wait_share and backlog_share >= 0.5 and size < self.cfg.max_replicas:
            return size + 1, "autoscale_up", (f"the trainer waited for data {wait_share:.0%} of {elapsed:.0f} s "
                                              f"(>= rollers.autoscale_wait_share) with prompts waiting for a "
                                              f"roller {backlog_share:.0%} of it")
        if idle_share >= 0.5 and size > self.cfg.min_replicas:
            return size - 1, "autoscale_down", (f"admission sat at its staleness cap with no prompt waiting "
                                                f"{idle_share:.0%} of {elapsed:.0f} s")
        return None
