"""Fault injection for the roller pool: kill, hang or slow one roller of a running job on purpose.

``rollers.fault_injection`` is a list of specs ``ROLLER:FAULT:TRIGGER=N[:SECONDS]``, each applied inside
the roller process named ``ROLLER`` (``roller0``, ``roller1``, ... as the job names them; a replacement or
a scaled-up roller gets a new name, so it inherits no fault):

=========  ======================================================================================
FAULT      what the roller does when the trigger fires
=========  ======================================================================================
kill       its process exits at once (``os._exit``): a crash, the groups it holds are lost
hang       its event loop blocks for SECONDS (default: for good): it answers nothing, sends nothing
slow       it sleeps SECONDS (required) at this and every later trigger (it keeps answering)
=========  ======================================================================================

=================  =============================================================================
TRIGGER=N          fires
=================  =============================================================================
group=N            right after the roller takes its N-th prompt group from the data plane (the
                   group is then held by it: a kill loses it, and the controller re-issues it)
weight_sync=N      when its N-th weight update starts, before it asks the sender for the weights
=================  =============================================================================

Examples: ``roller1:kill:group=3``, ``roller0:hang:weight_sync=1``, ``roller0:slow:group=1:0.5``. The
controller's side (detection within ``rollers.health_timeout_s``, re-issue, replacement) is
``controller.pool``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FAULTS = ("kill", "hang", "slow")
TRIGGERS = ("group", "weight_sync")
_FOREVER_S = 10 * 365 * 24 * 3600.0


@dataclass(frozen=True)
class FaultSpec:
    """One parsed ``rollers.fault_injection`` entry (see the module docstring). ``seconds``: the hang's
    length (None = for good) or the slow-down per trigger."""

    roller: str
    fault: str
    trigger: str
    count: int
    seconds: float | None = None

    @classmethod
    def parse(cls, spec: str) -> FaultSpec:
        """Raises ValueError naming ``rollers.fault_injection``, the spec and the accepted form."""
        form = ("ROLLER:FAULT:TRIGGER=N[:SECONDS] with FAULT in kill|hang|slow and TRIGGER in group|weight_sync "
                "(e.g. roller1:kill:group=3)")
        parts = str(spec).split(":")
        try:
            if len(parts) not in (3, 4) or not parts[0]:
                raise ValueError("wrong number of fields")
            roller, fault, when = parts[:3]
            trigger, _, count = when.partition("=")
            seconds = float(parts[3]) if len(parts) == 4 else None
            if fault not in FAULTS or trigger not in TRIGGERS or int(count) < 1:
                raise ValueError("unknown fault or trigger, or N < 1")
            if fault == "slow" and (seconds is None or not 0 < seconds < _FOREVER_S):
                raise ValueError("slow needs SECONDS > 0")
            if fault == "kill" and seconds is not None:
                raise ValueError("kill takes no SECONDS")
            if seconds is not None and not seconds > 0:
                raise ValueError("SECONDS must be > 0")
            return cls(roller, fault, trigger, int(count), seconds)
        except ValueError as exc:
            raise ValueError(f"rollers.fault_injection entry {spec!r}: {exc}; accepted: {form}") from None


class FaultInjector:
    """The faults of one roller (``specs`` already filtered to it); ``fire(trigger)`` at each event."""

    def __init__(self, roller: str, specs: list[FaultSpec]):
        self.roller = roller
        self.specs = [s for s in specs if s.roller == roller]
        self.counts = dict.fromkeys(TRIGGERS, 0)

    async def fire(self, trigger: str) -> None:
        """Count one ``trigger`` event and apply every fault due at it (kill never returns; hang blocks
        the whole event loop on purpose)."""
        self.counts[trigger] += 1
        n = self.counts[trigger]
        for spec in self.specs:
            if spec.trigger != trigger:
                continue
            if spec.fault == "slow" and n >= spec.count:
                await asyncio.sleep(spec.seconds)
            elif n == spec.count and spec.fault == "kill":
                logger.warning("fault injection: roller %s exits at %s %d", self.roller, trigger, n)
                os._exit(17)
            elif n == spec.count and spec.fault == "hang":
                logger.warning("fault injection: roller %s hangs at %s %d", self.roller, trigger, n)
                time.sleep(spec.seconds or _FOREVER_S)  # blocks the event loop: the roller answers nothing


class FaultyChannel:
    """A ``GroupChannel`` that fires the ``group`` trigger after each group it hands out."""

    def __init__(self, channel, injector: FaultInjector):
        self.channel, self.injector = channel, injector

    async def take_group(self, timeout_s: float):
        group = await self.channel.take_group(timeout_s)
        if group is not None:
            await self.injector.fire("group")
        return group

    async def put_group(self, result) -> None:
        await self.channel.put_group(result)
