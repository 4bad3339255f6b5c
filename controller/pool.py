"""The roller pool of a running job: its members, their weight versions, their health, and how it changes.

::

    member states:   joining ──(weights at the trainer's weight_version, then start)──> active
                     active ──(scale-down)──> draining ──(held groups done or handed back)──> gone
                     any ──(process died / no answer within rollers.health_timeout_s /
                            weight update not acknowledged in time)──> lost ──> gone (+ replacement)

A roller joins in this order: placed (a Ray actor) → joins the weight plane (``attach_receiver``) → holds
the trainer's current ``weight_version`` (pushed while the trainer is idle: the caller's trainer lock) →
``start`` (takes work). So no roller ever generates with weights older than those it joined with, and a
weight sync targets exactly the members that lack the version.

Every call to a roller has a timeout (``rollers.health_timeout_s``; the start of a joining roller,
``JOIN_TIMEOUT_S`` plus an SGLang server's start-up). The groups a lost roller held are found in the data
plane (prompt rows taken by the ``rollout`` task and claimed by no live roller: ``find_orphans``) and
re-issued by the schedule's ``Stages.reissue``; ``PoolKeeper`` (``controller.pool_keeper``) drives all of
it while a schedule runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from controller.config import HFlowConfig

logger = logging.getLogger(__name__)

JOINING, ACTIVE, DRAINING = "joining", "active", "draining"
JOIN_TIMEOUT_S = 300.0  # a new roller's process start and model load (an SGLang launch adds its own timeout)
MAX_SYNC_ATTEMPTS = 4


class RollerLost(RuntimeError):
    """A roller left the pool unplanned; ``reason``: ``died`` | ``unresponsive`` | ``weight_sync``."""

    def __init__(self, name: str, reason: str, detail: str):
        self.name, self.reason = name, reason
        super().__init__(f"roller {name} lost ({reason}): {detail}")


@dataclass
class Member:
    """One roller of the pool: its Ray ``actor``, the ``weight_version`` it holds, its ``state``, the groups
    it held at its last health check and its last stats (kept when it leaves, for the run's counters)."""

    name: str
    actor: Any
    weight_version: int = 0
    state: str = JOINING
    held_uids: list[str] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    in_push: bool = False  # a weight push is under way: its own deadlines judge the roller, not pings


def _trainer_lost(exc: BaseException | None) -> bool:
    from trainers.group import TrainerRankLost

    return isinstance(exc, TrainerRankLost)


def _is_dead(exc: BaseException) -> bool:
    import ray

    return isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError)


class RollerPool:
    """The rollers of one job (see the module docstring). ``make_actor(name)`` places a new roller actor.
    Build with ``place(num_replicas)`` (their processes start meanwhile), then ``start(trainer)``."""

    def __init__(self, cfg: HFlowConfig, make_actor: Callable[[str], Any]):
        self.cfg = cfg
        self.make_actor = make_actor
        self.trainer = None  # the TrainerGroup (the weight plane's send side), given by start()
        self.timeout_s = cfg.rollers.health_timeout_s
        self.members: dict[str, Member] = {}
        self.sync_handle: dict | None = None
        self.num_created = 0
        self.retired_stats: dict[str, float] = {}  # summed last stats of the rollers that left
        self._sender_removals: list[str] = []      # left the pool; removed from the sender at the next push

    # ----------------------------------------------------------------------------------------- start

    def next_name(self) -> str:
        name = f"roller{self.num_created}"
        self.num_created += 1
        return name

    def place(self, num_replicas: int) -> None:
        """Place ``num_replicas`` rollers (Ray actors at ``weight_version`` 0; not blocking: their processes
        start and load the model while the caller goes on)."""
        for _ in range(num_replicas):
            name = self.next_name()
            self.members[name] = Member(name, self.make_actor(name))

    def start(self, trainer) -> None:
        """Connect the placed rollers to ``trainer``'s weight plane and start their loops (blocking; at job
        start)."""
        import ray

        from trainers.weight_sync import attach_sender

        self.trainer = trainer
        names = list(self.members)
        self.sync_handle = self.trainer.execute(attach_sender, self.cfg.checkpointengine, names)[0]
        ray.get([m.actor.attach_receiver.remote(self.sync_handle, m.name) for m in self.members.values()])
        ray.get([m.actor.start.remote() for m in self.members.values()])
        for m in self.members.values():
            m.state = ACTIVE

    async def rewire(self, trainer) -> list[RollerLost]:
        """After a trainer restart: a new weight sender on ``trainer`` (the new group) for every live member, which
        re-attaches to it (``RollerActor.attach_receiver`` cancels an update still waiting for the lost sender);
        each member's ``weight_version`` is then read back from the roller (what its engine committed). Returns
        the members that did not answer in time (not yet retired). Caller holds the trainer lock."""
        from trainers.weight_sync import attach_sender

        self.trainer = trainer
        self._sender_removals.clear()  # the old sender is gone with its rank
        members = self.live()
        self.sync_handle = (await asyncio.to_thread(trainer.execute, attach_sender, self.cfg.checkpointengine,
                                                    [m.name for m in members]))[0]

        async def attach(m: Member) -> None:
            await self.call(m, "attach_receiver", self.sync_handle, m.name)
            m.weight_version = int((await self.call(m, "ping"))["weight_version"])

        results = await asyncio.gather(*(attach(m) for m in members), return_exceptions=True)
        return [x for m, r in zip(members, results, strict=True) if (x := _failed(m, r, "weight_sync", "re-attach"))]

    # -------------------------------------------------------------------------------------- queries

    def live(self) -> list[Member]:
        """Members that generate or finish work (active and draining), in join order."""
        return [m for m in self.members.values() if m.state in (ACTIVE, DRAINING)]

    def size(self) -> int:
        """Active members (the pool size the gauge reports; draining ones are on their way out)."""
        return sum(m.state == ACTIVE for m in self.members.values())

    def state(self) -> dict:
        """The pool as the admin endpoint answers it: per roller its state, weight_version and held groups."""
        return {"pool_size": self.size(),
                "rollers": [{"name": m.name, "state": m.state, "weight_version": m.weight_version,
                             "num_groups_in_flight": len(m.held_uids)} for m in self.members.values()]}

    async def call(self, member: Member, method: str, *args, timeout_s: float | None = None) -> Any:
        """``member.actor.method(*args)`` within ``timeout_s`` (default ``rollers.health_timeout_s``).
        Raises RollerLost (``died`` when the process is gone, ``unresponsive`` on the timeout); the
        roller's own exception otherwise."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(self._remote(member, method, *args), limit)
        except TimeoutError:
            raise RollerLost(member.name, "unresponsive", f"{method} not answered within {limit:.1f} s") from None

    @staticmethod
    async def _remote(member: Member, method: str, *args) -> Any:
        """``member.actor.method(*args)``, unbounded (callers bound it); RollerLost(``died``) when the
        process is gone."""
        try:
            return await getattr(member.actor, method).remote(*args)
        except Exception as exc:
            if _is_dead(exc):
                raise RollerLost(member.name, "died", f"{type(exc).__name__} in {method}") from None
            raise

    async def check_health(self) -> list[RollerLost]:
        """Ping every live member at once; returns the lost ones (not yet removed). A member whose loop ended
        with an error (an engine crash) counts as died. Notes each member's held groups."""
        members = [m for m in self.live() if not m.in_push]
        results = await asyncio.gather(*(self.call(m, "ping") for m in members), return_exceptions=True)
        lost = []
        for m, result in zip(members, results, strict=True):
            failed = _failed(m, result, "died", "ping")
            if failed is not None:
                lost.append(failed)
            else:
                m.held_uids = list(result["held_uids"])
                if not result["running"] and m.state == ACTIVE:
                    lost.append(RollerLost(m.name, "died", f"its generation loop ended: {result['error'] or 'no error'}"))
        return lost

    async def held_by_live(self) -> set[str]:
        """The uids every live member holds now; a member that does not answer claims nothing."""
        members = self.live()
        results = await asyncio.gather(*(self.call(m, "ping") for m in members), return_exceptions=True)
        return {uid for r in results if isinstance(r, dict) for uid in r["held_uids"]}

    async def stats(self) -> dict[str, dict[str, float]]:
        """Each live member's stats (its last known ones when it does not answer in time)."""
        members = self.live()
        results = await asyncio.gather(*(self.call(m, "stats") for m in members), return_exceptions=True)
        for m, r in zip(members, results, strict=True):
            if isinstance(r, dict):
                m.stats = r
        return {m.name: m.stats for m in members}

    def totals(self, key: str) -> float:
        """``key`` of the stats summed over every roller of the run, those that left included."""
        return self.retired_stats.get(key, 0.0) + sum(m.stats.get(key, 0.0) for m in self.members.values())

    # -------------------------------------------------------------------------------------- changes

    def retire(self, name: str) -> Member | None:
        """Remove member ``name`` from the pool and kill its process (idempotent); its last stats are kept."""
        import ray

        member = self.members.pop(name, None)
        if member is None:
            return None
        for key, value in member.stats.items():
            if key.startswith("num_"):
                self.retired_stats[key] = self.retired_stats.get(key, 0.0) + value
        self._sender_removals.append(name)
        ray.kill(member.actor, no_restart=True)
        return member

    async def _flush_sender_removals(self) -> None:
        """Drop retired rollers from the weight sender (caller holds the trainer lock)."""
        from trainers.weight_sync import remove_roller

        while self._sender_removals:
            await asyncio.to_thread(self.trainer.execute, remove_roller, self._sender_removals.pop())

    async def join(self, name: str, trainer_lock: asyncio.Lock, weight_version: Callable[[], int]) -> Member:
        """Place roller ``name``, join it to the weight plane, push the trainer's current ``weight_version()``
        (under ``trainer_lock``, so the policy is at that version) and start it. Raises RollerLost, or the
        error of a weight push that failed; the caller retires the member then."""
        from trainers.weight_sync import add_roller

        member = self.members[name] = Member(name, self.make_actor(name))
        startup = JOIN_TIMEOUT_S + (self.cfg.rollers.sglang_startup_timeout_s if self.cfg.rollers.engine == "sglang"
                                    else 0.0)
        await self.call(member, "attach_receiver", self.sync_handle, name, timeout_s=startup)
        async with trainer_lock:
            await self._flush_sender_removals()
            await asyncio.to_thread(self.trainer.execute, add_roller, name)
            current = weight_version()
            if current > member.weight_version:
                lost, error = await self._push(current, [member], self.cfg.checkpointengine.pause_mode)
                if lost:
                    raise lost[0]
                if error is not None:
                    raise error
            await self.call(member, "start")
            member.state = ACTIVE
        return member

    async def push_weights(self, weight_version: int, pause_mode: str) -> tuple[dict, list[RollerLost]]:
        """Bring every live member to ``weight_version`` (caller holds the trainer lock: the policy is at it).

        A member that dies, or does not acknowledge within ``rollers.health_timeout_s`` after the sender
        finished or gave up (``checkpointengine.timeout_s``), is returned as lost (not yet retired); the
        others are updated again without it. Returns (the sender's report of the last push, the lost).
        Raises the sender's error when an attempt fails with no roller to blame.
        """
        await self._flush_sender_removals()
        lost: list[RollerLost] = []
        report: dict = {}
        for _ in range(MAX_SYNC_ATTEMPTS):
            gone = {x.name for x in lost}
            targets = [m for m in self.live() if m.weight_version < weight_version and m.name not in gone]
            if not targets:
                break
            new_lost, error = await self._push(weight_version, targets, pause_mode, report)
            lost += new_lost
            if error is not None and not new_lost:
                raise error
            if error is None:
                break
        else:
            raise RuntimeError(f"weight_version {weight_version}: still not on every roller after {MAX_SYNC_ATTEMPTS} "
                               f"attempts (lost on the way: {[x.name for x in lost]})")
        return report, lost

    async def _push(self, weight_version: int, targets: list[Member], pause_mode: str, report: dict | None = None
                    ) -> tuple[list[RollerLost], BaseException | None]:
        """One send of ``weight_version`` to ``targets``; (members lost, the sender's error or None)."""
        from trainers.weight_sync import send_weights

        names = [m.name for m in targets]
        for m in targets:
            m.in_push = True
        send = asyncio.ensure_future(asyncio.to_thread(self.trainer.execute, send_weights, weight_version, names))
        receives = {m.name: asyncio.ensure_future(self._remote(m, "update_weights", weight_version, pause_mode))
                    for m in targets}  # bounded below: the sender's deadlines, then rollers.health_timeout_s
        error = None
        try:
            sent = (await send)[0] or {}
            if report is not None:
                report.update(sent)
        except Exception as exc:  # a roller missed a deadline, or the send itself failed
            error = exc
        if _trainer_lost(error):  # no roller is to blame: the caller restarts the trainer, rollers re-attach
            for m in targets:
                m.in_push = False
            for fut in receives.values():
                fut.cancel()
            return [], error
        await asyncio.wait(list(receives.values()), timeout=self.timeout_s)
        lost = []
        for m in targets:
            m.in_push = False
            fut = receives[m.name]
            if not fut.done():
                fut.cancel()
                lost.append(RollerLost(m.name, "weight_sync", f"did not acknowledge weight_version {weight_version} "
                                       f"within {self.timeout_s:.1f} s of the sender's end"))
            elif isinstance(fut.exception(), RollerLost):
                lost.append(fut.exception())
            elif fut.exception() is None:
                m.weight_version = weight_version
            else:
                logger.warning("roller %s: weight_version %d not applied: %s", m.name, weight_version, fut.exception())
        return lost, error

    async def drain(self, name: str, timeout_s: float) -> list[str]:
        """Scale-down of member ``name``: it takes no new group, finishes what it holds within ``timeout_s``
        and hands back the rest (their uids are returned for re-issue); then it is retired. A group that
        failed on it is logged here (a training group's prompt row was never answered: ``find_orphans``
        re-issues it)."""
        member = self.members[name]
        member.state = DRAINING
        try:
            handed_back = await self.call(member, "drain", timeout_s, timeout_s=timeout_s + self.timeout_s)
            member.stats = await self.call(member, "stats")
            for f in await self.call(member, "drain_failures"):
                logger.warning("group %s failed in %s on roller %s as it left the pool: %s", f.uid, f.stage,
                               name, "; ".join(f.errors))
        finally:
            self.retire(name)
        return list(handed_back)

    def close(self) -> None:
        """Stop every member: a bounded ``shutdown`` each, then kill (idempotent)."""
        import ray

        members, self.members = list(self.members.values()), {}
        if members:
            refs = [m.actor.shutdown.remote(timeout_s=5.0) for m in members]
            ray.wait(refs, num_returns=len(refs), timeout=30)
            for m in members:
                ray.kill(m.actor, no_restart=True)


def _failed(m: Member, result, reason: str, call: str) -> RollerLost | None:
    """``result`` of ``call`` on member ``m`` (from ``asyncio.gather(..., return_exceptions=True)``) as the
    RollerLost it means (``reason`` when the call raised anything else), or None when it succeeded."""
    if isinstance(result, RollerLost):
        return result
    if isinstance(result, BaseException):
        return RollerLost(m.name, reason, f"{call} raised {type(result).__name__}: {result}")
    return None


async def find_orphans(tq, prompt_partition: str, limit: int, held_by_live: Callable,
                       grace_s: float = 1.0) -> dict[str, list[int]]:
    """Groups no live roller will finish: prompt rows of ``prompt_partition`` taken by the rollers' task
    (``rollers.tq_channel.ROLLOUT_TASK``) and claimed by no live roller (``held_by_live()``, awaited) in two
    looks ``grace_s`` apart (a group whose take is still in flight to a live roller is claimed by the second
    look). Returns uid → prompt row ids (metadata only).

    A roller puts its group's samples and marks the prompt row consumed by ``ANSWERED_TASK`` in one index
    step (``TQGroupChannel.put_group``), then clears the row. A row marked so (its roller left between the
    put and the clear) is cleared here and never returned: its samples exist, or were trained and cleared
    already, so re-issuing it would train the group twice. A row without the mark has no samples (the put
    never reached the index), so re-issuing it loses nothing. ``limit``: at most this many rows are looked
    at (the TransferQueue's ``max_request_ids``)."""
    from common import schema
    from rollers.tq_channel import ANSWERED_TASK, ROLLOUT_TASK

    answered: list[int] = []

    async def look() -> dict[str, list[int]]:
        rows = await _rows(tq, prompt_partition, limit)  # the groups in flight: a few steps' at most
        held = await held_by_live()
        by_uid: dict[str, list[int]] = {}
        answered.clear()
        for r in rows:
            uid = r["tags"].get(schema.UID)
            if ANSWERED_TASK in r["consumed_by"]:
                answered.append(r["id"])
            elif uid is not None and uid not in held and ROLLOUT_TASK in r["consumed_by"]:
                by_uid.setdefault(uid, []).append(r["id"])
        return by_uid

    first, second = await look(), {}
    if first:
        await asyncio.sleep(grace_s)
        second = {uid: ids for uid, ids in (await look()).items() if uid in first}
    if answered:
        await tq.aclear(prompt_partition, list(answered))
    return second


async def _rows(tq, partition: str, limit: int) -> list[dict]:
    """``tq.asample_info`` of ``partition``; [] while nothing was ever put there."""
    from transferqueue.records import RemoteError

    try:
        return await tq.asample_info(partition, None, limit=limit)
    except RemoteError as exc:
        if "unknown partition" not in str(exc):
            raise
        return []
