"""Test environments for the agent loop, registered on import (``rollout.environment=tests.rollers.agent_envs:NAME``
works in any process that can import ``tests``).

* ``scripted_turns``: answers each of the first ``SCRIPT_TURNS`` turns with ``SCRIPT_OBSERVATION`` (words of the
  tiny vocabulary) and reward ``TURN_REWARD``; the next turn is scored with the task's reward and ends it.
* ``raising``: ``step`` raises; ``hanging``: ``step`` never returns (its trajectory times out);
  ``nan_reward``: ``step`` answers reward NaN; ``none_factory``: the factory returns None;
  ``sync_turns`` / ``sync_hanging``: plain (not ``async``) methods (:class:`SyncTurns`); ``numpy_reward``: one
  turn, reward ``np.float32(NUMPY_REWARD)``; ``done_str``: ``step`` answers ``done="False"``.
* ``close_raising`` / ``close_hanging``: ``scripted_turns`` whose ``close`` raises / never returns.
* ``gated``: like ``scripted_turns`` with one observation, but ``step`` waits for ``GATE`` (an
  ``asyncio.Event`` set by the test): a trajectory waiting on its tool while the weights change.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from rollers.environments import EnvContext, Environment, StepResult, register_environment

SCRIPT_TURNS = 2
SCRIPT_OBSERVATION = "say the word a"
TURN_REWARD = 0.25


class ScriptedTurns(Environment):
    observation_role = "user"

    def __init__(self, ctx: EnvContext, turns: int = SCRIPT_TURNS, gate: asyncio.Event | None = None):
        self.ctx, self.turns, self.gate = ctx, turns, gate
        self.ground_truth: dict = {}
        self.actions: list[str] = []

    async def reset(self, ground_truth: dict) -> str:
        self.ground_truth = ground_truth
        return ""

    async def step(self, action: str) -> StepResult:
        self.actions.append(action)
        if self.gate is not None:
            await self.gate.wait()
        if len(self.actions) <= self.turns:
            return StepResult(SCRIPT_OBSERVATION, TURN_REWARD, False)
        return StepResult(reward=await self.ctx.reward(action, self.ground_truth), done=True)


SEEDS: list[int] = []  # EnvContext.seed of every scripted_turns trajectory built in this process


@register_environment("scripted_turns")
def scripted_turns(ctx: EnvContext) -> Environment:
    SEEDS.append(ctx.seed)
    return ScriptedTurns(ctx)


class _Raising(ScriptedTurns):
    async def step(self, action: str) -> StepResult:
        raise ValueError("the environment broke")  # a ValueError too fails the trajectory, not as a rejected request


class _Hanging(ScriptedTurns):
    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


class _CloseRaising(ScriptedTurns):
    async def close(self) -> None:
        raise OSError("the sandbox is already gone")


class _CloseHanging(ScriptedTurns):
    async def close(self) -> None:
        await asyncio.sleep(3600)


@register_environment("close_raising")
def close_raising(ctx: EnvContext) -> Environment:
    return _CloseRaising(ctx)


@register_environment("close_hanging")
def close_hanging(ctx: EnvContext) -> Environment:
    return _CloseHanging(ctx)


@register_environment("raising")
def raising(ctx: EnvContext) -> Environment:
    return _Raising(ctx)


@register_environment("hanging")
def hanging(ctx: EnvContext) -> Environment:
    return _Hanging(ctx)


GATE: dict[str, asyncio.Event] = {}  # the test puts its event under "gate" before the trajectory starts


@register_environment("gated")
def gated(ctx: EnvContext) -> Environment:
    return ScriptedTurns(ctx, turns=1, gate=GATE["gate"])


class ToolOnlyReward(Environment):
    """``tool_only_reward``: the word ``copy`` anywhere in a turn is a tool call (answered with
    ``TOOL_OBSERVATION``); the trajectory's reward is 1.0 when it called the tool, else 0.0 — calling it is
    the only way to the reward."""

    observation_role = "user"

    def __init__(self):
        self.called = False

    async def reset(self, ground_truth: dict) -> str:
        return ""

    async def step(self, action: str) -> StepResult:
        if "copy" in action.split() and not self.called:
            self.called = True
            return StepResult(TOOL_OBSERVATION, 0.0, False)
        return StepResult(reward=1.0 if self.called else 0.0, done=True)


TOOL_OBSERVATION = "the word is a"


@register_environment("tool_only_reward")
def tool_only_reward(ctx: EnvContext) -> Environment:
    return ToolOnlyReward()


class _NaNReward(ScriptedTurns):
    async def step(self, action: str) -> StepResult:
        return StepResult(reward=float("nan"), done=True)


@register_environment("nan_reward")
def nan_reward(ctx: EnvContext) -> Environment:
    return _NaNReward(ctx)


@register_environment("none_factory")
def none_factory(ctx: EnvContext):
    return None  # a factory that forgot its return


class SyncTurns:
    """``sync_turns``: ``scripted_turns`` with plain (not ``async``) methods, its last turn scored 1.0; each
    call runs in a thread of its own (``rollers.user_calls``). ``sync_hanging``: its ``step`` blocks 2 s."""

    observation_role = "user"

    def __init__(self, block_s: float = 0.0):
        self.block_s, self.num_steps = block_s, 0

    def reset(self, ground_truth: dict) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        time.sleep(self.block_s)
        self.num_steps += 1
        if self.num_steps <= SCRIPT_TURNS:
            return StepResult(SCRIPT_OBSERVATION, TURN_REWARD, False)
        return StepResult(reward=1.0, done=True)

    def close(self) -> None:
        pass


@register_environment("sync_turns")
def sync_turns(ctx: EnvContext):
    return SyncTurns()


@register_environment("sync_hanging")
def sync_hanging(ctx: EnvContext):
    return SyncTurns(block_s=2.0)


NUMPY_REWARD = 0.5


class _NumpyReward(ScriptedTurns):
    async def step(self, action: str) -> StepResult:
        return StepResult(reward=np.float32(NUMPY_REWARD), done=True)


@register_environment("numpy_reward")
def numpy_reward(ctx: EnvContext) -> Environment:
    return _NumpyReward(ctx)


class _DoneStr(ScriptedTurns):
    async def step(self, action: str) -> StepResult:
        return StepResult("go on", 0.0, "False")


@register_environment("done_str")
def done_str(ctx: EnvContext) -> Environment:
    return _DoneStr(ctx)
