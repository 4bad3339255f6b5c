"""One environment of the agent loop: the interface it implements and what its factory gets.

An :class:`Environment` serves one trajectory (``reset``, then ``step`` per model turn, each answered by a
:class:`StepResult`); its factory (an ``EnvFactory``, registered in ``rollers.environments``) gets an
:class:`EnvContext`, whose ``reward`` is the roller's :class:`AsyncReward`. Failures of an environment, a
tool or a reward are :class:`EnvironmentFailure`. ``rollers.environments`` (the registry and the built-in
environments) and the adapters of ``rollers.env_adapters`` build on this module and re-export it; see
``rollers.environments`` for how a trajectory uses them.
"""

from __future__ import annotations

import abc
import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollers.rewards import RewardResult, reward_result
from rollers.user_calls import call_user


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one action: ``observation`` text (ignored when ``done``), the
    ``reward`` for that action (a finite real number, as a reward function returns:
    ``rewards.reward_result``), and whether the trajectory is ``done`` (a bool)."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False


class Environment(abc.ABC):
    """One trajectory's environment (see the module docstring). ``observation_role``: the chat role its
    observations are formatted as (``tool`` for tool results; ``user`` for a text game). Its methods are
    ``async``; an object with plain (sync) ``reset``/``step``/``close`` works too: each call then runs in a
    thread of its own (``rollers.user_calls``), bounded by ``rollout.env_timeout_s`` all the same."""

    observation_role: str = "tool"

    @abc.abstractmethod
    async def reset(self, ground_truth: dict) -> str:
        """Start the trajectory for a prompt with ``ground_truth``; returns text to append before the model's
        first turn ("" = none: the prompt is the first observation)."""

    @abc.abstractmethod
    async def step(self, action: str) -> StepResult:
        """Answer the model's turn ``action`` (decoded text)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release what the environment holds (called once, however the trajectory ended; one that raises or
        times out is logged and counted, and fails nothing)."""


class EnvironmentFailure(RuntimeError):
    """An environment, tool or reward failed a trajectory (raised, timed out, or returned NaN)."""


class AsyncReward:
    """A roller's reward function ``fn(text, ground_truth) -> float`` (sync, run in a thread of its own; or
    async), called with at most ``max_concurrency`` calls at once (``rollout.reward_max_concurrency``) and each
    bounded by ``timeout_s`` seconds (``rollout.reward_timeout_s``): ``rollers.user_calls.call_user``.
    Single-turn groups and environments score through the same one.

    ``await reward.score(text, ground_truth)`` returns a ``RewardResult``: failed (never 0) when the function
    raises, times out, or returns something that is not a finite real number (``rewards.reward_result``: bool,
    numpy scalars, Fraction and Decimal count as numbers). ``await reward(text, ground_truth)`` returns the
    float and raises EnvironmentFailure where ``score`` fails (what environments call)."""

    def __init__(self, fn: Callable, max_concurrency: int, timeout_s: float):
        if max_concurrency < 1 or timeout_s <= 0:
            raise ValueError(f"AsyncReward needs max_concurrency >= 1 and timeout_s > 0, got "
                             f"{max_concurrency}, {timeout_s}")
        self.fn, self.timeout_s = fn, timeout_s
        self._slots = asyncio.Semaphore(max_concurrency)

    async def score(self, text: str, ground_truth: dict) -> RewardResult:
        async with self._slots:
            try:
                value = await call_user(self.timeout_s, self.fn, text, ground_truth)
            except TimeoutError:
                return RewardResult(math.nan, f"reward took longer than rollout.reward_timeout_s={self.timeout_s}")
            except Exception as exc:  # a user's reward may fail in any way: its sample fails
                return RewardResult(math.nan, f"reward raised {type(exc).__name__}: {exc}")
        return reward_result(value)

    async def __call__(self, text: str, ground_truth: dict) -> float:
        result = await self.score(text, ground_truth)
        if result.failed:
            raise EnvironmentFailure(result.error)
        return result.score


@dataclass(frozen=True)
class EnvContext:
    """What an environment factory gets: ``reward`` (the task's reward as an :class:`AsyncReward`),
    ``timeout_s`` (``rollout.env_timeout_s``, for calls it makes itself, e.g. tools), ``options`` (the
    spec's options: its defaults overridden by ``rollout.env_kwargs``) and ``seed`` (this trajectory's,
    ``rollers.agent_loop.environment_seed`` of (``rollout.seed``, uid, sample index); 62 bits)."""

    reward: AsyncReward
    timeout_s: float
    options: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0


EnvFactory = Callable[[EnvContext], Environment]
