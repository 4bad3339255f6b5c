"""Helpers shared by the rollers tests (imported as ``tests.rollers.engine_helpers``)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import torch

from common.models import ModelConfig, load_model

TIMEOUT_S = 90  # below pytest-timeout's 120 s; generous for a loaded 2-core machine


def run(coro, timeout_s: float = TIMEOUT_S):
    """Run ``coro`` on a fresh event loop with a timeout (no test may hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def spiced_tiny(seed: int = 0) -> torch.nn.Module:
    """The tiny Llama with its matrices re-drawn from N(0, 0.2²) (seeded): varied, non-degenerate outputs,
    EOS not too likely."""
    model = load_model(ModelConfig(path="tiny"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def concurrency_probe(score, delay_s: float):
    """An async reward that sleeps ``delay_s`` then returns ``score(text, ground_truth)``, and its state:
    ``state.peak`` is the most calls that ran at once."""
    state = SimpleNamespace(running=0, peak=0)

    async def reward(text, ground_truth):
        state.running += 1
        state.peak = max(state.peak, state.running)
        await asyncio.sleep(delay_s)
        state.running -= 1
        return score(text, ground_truth)

    return reward, state


class PermitAdmission:
    """Counted permits: ``grant(k)`` allows ``k`` more groups; ``acquire`` waits up to ``timeout_s``.

    Test-only: runs admit at the prompt feeder (``controller.ledger``); the roller takes what is there."""

    def __init__(self, permits: int = 0):
        if permits < 0:
            raise ValueError(f"permits must be >= 0, got {permits}")
        self._permits = permits
        self._changed = asyncio.Event()

    @property
    def permits(self) -> int:
        return self._permits

    def grant(self, num_groups: int) -> None:
        """Allow ``num_groups`` (>= 0, else ValueError) more groups to start."""
        if num_groups < 0:
            raise ValueError(f"grant needs num_groups >= 0, got {num_groups}")
        self._permits += num_groups
        self._changed.set()

    async def acquire(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._permits == 0:
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        self._permits -= 1
        return True

    def give_back(self) -> None:
        self._permits += 1
        self._changed.set()


class PermitChannel:
    """A ``GroupChannel`` that hands out a group of ``inner`` only against a permit of ``admission``; a poll
    that finds no group gives the permit back."""

    def __init__(self, inner, admission: PermitAdmission):
        self.inner, self.admission = inner, admission

    async def take_group(self, timeout_s: float):
        if not await self.admission.acquire(timeout_s):
            return None
        group = await self.inner.take_group(timeout_s)
        if group is None:
            self.admission.give_back()
        return group

    async def put_group(self, result) -> None:
        await self.inner.put_group(result)


class LocalGroupChannel:
    """An in-process ``GroupChannel``: bounded asyncio queues of groups in and results out."""

    def __init__(self, maxsize: int = 1024):
        self.groups: asyncio.Queue = asyncio.Queue(maxsize)
        self.results: asyncio.Queue = asyncio.Queue(maxsize)

    async def take_group(self, timeout_s: float):
        if timeout_s <= 0:  # answer at once (wait_for with 0 would cancel even a ready get)
            try:
                return self.groups.get_nowait()
            except asyncio.QueueEmpty:
                return None
        try:
            return await asyncio.wait_for(self.groups.get(), timeout_s)
        except TimeoutError:
            return None

    async def put_group(self, result) -> None:
        await asyncio.wait_for(self.results.put(result), 60.0)
