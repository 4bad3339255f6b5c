"""Environments for the agent loop: one small async interface, registered by name like tasks.

An :class:`Environment` serves one trajectory::

    first = await env.reset(ground_truth)          # text appended after the prompt ("" = nothing)
    result = await env.step(action_text)           # StepResult(observation, reward, done)

``action_text`` is the model's turn, decoded (for parsing only: the trajectory itself stays token ids,
``rollers.agent_loop``). ``observation`` is text the loop formats as a turn of role ``observation_role``
with the model's chat template and appends as tokens; ``reward`` lands on the last model token of the
turn it answers; ``done`` ends the trajectory.

Plug-ins. ``rollout.environment`` names an :class:`EnvironmentSpec` in ``ENVIRONMENTS`` (or ``module:name``
of a module that registers one, ``common/registry.py``). Its ``make(ctx)`` builds one environment per
trajectory from an :class:`EnvContext`: the reward (``rollout.reward`` resolved by the controller, wrapped
in an :class:`AsyncReward` with a concurrency limit and a timeout), the per-call timeout, the trajectory's
``seed`` (from ``rollout.seed``, uid and sample index: the same sample meets the same environment in every
schedule and run) and ``options``: ``rollout.env_kwargs`` over the defaults the spec declares (an unknown
key or a value of another type is refused when the config is read). A user one::

    from rollers.environments import EnvContext, register_environment

    @register_environment("my_game", options={"max_guesses": 5})
    def my_game(ctx: EnvContext) -> Environment:
        return MyGame(ctx.reward, ctx.options["max_guesses"], ctx.seed)

Built in: ``calculator`` (a :class:`ToolEnvironment` with ``rollers.tools.calculator``: the model may call
it any number of times; its first answer without a tool call is scored with the task's reward), and ``gem``:
any environment of GEM (``gem-llm``, axon-rl's gym-style text environments for LLMs: games, reasoning-gym
tasks, tool use), through the adapter ``rollers.env_adapters.gem``, which imports GEM only when used (the
optional extra ``hflow-async[gem]``). GEM was chosen among the public environment libraries that install here
(measured with ``pip install --dry-run`` against this project's dependencies, 2026-12): ``gem-llm`` adds 4
packages, is text-in/text-out gym-style, and its number games, puzzles and ``rg:`` tasks run offline;
``textarena`` adds 10 (an OpenAI client among them) and its word games call ``nltk.download`` at import
(GEM's word games, hangman/wordle/word search, need that NLTK data too: not offline); ``verifiers`` adds 38
and ``openenv-core`` 58 (web servers, MCP, gradio), both built around chat messages and HTTP sandboxes.

Failures: an environment whose ``reset``/``step`` raises or runs past ``rollout.env_timeout_s``, a factory
that raises or returns no environment, a tool that raises or times out (``rollers.tools.ToolError``), or a
reward that raises, returns NaN or times out fails its trajectory, and with it its group (counted as a reward
failure, like single-turn rewards); never the roller. A ``close`` that raises or times out is logged and
counted, and fails nothing (cleanup does not undo a scored trajectory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from common.registry import Registry
from rollers.env_adapters.gem import GemEnvironment, check_options
from rollers.environment import (
    AsyncReward,
    EnvContext,
    EnvFactory,
    Environment,
    EnvironmentFailure,
    StepResult,
)
from rollers.tools import Tool, calculator, call_tool, parse_tool_call

# The interface of one environment is defined in ``rollers.environment`` (below the adapters, which implement
# it); it is re-exported here so that a plug-in needs this one module.
__all__ = [
    "ENVIRONMENTS", "AsyncReward", "EnvContext", "EnvFactory", "Environment", "EnvironmentFailure",
    "EnvironmentSpec", "StepResult", "ToolEnvironment", "register_environment",
]


@dataclass(frozen=True)
class EnvironmentSpec:
    """An environment plug-in: ``make(ctx)`` builds one :class:`Environment` per trajectory; ``options``:
    the ``rollout.env_kwargs`` keys it accepts, with their defaults (JSON-like values); ``check(options)``:
    validates the resolved options when the config is read (raises ValueError naming the key)."""

    name: str
    make: EnvFactory
    options: Mapping[str, Any] = field(default_factory=dict)
    check: Callable[[dict[str, Any]], None] | None = None

    def resolve_options(self, env_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` overridden by ``env_kwargs``. Raises ValueError naming ``rollout.env_kwargs.KEY`` for a
        key the spec does not declare, or a value whose type differs from the default's (an int is accepted
        for a float; a default of None accepts anything)."""
        for key, value in env_kwargs.items():
            if key not in self.options:
                raise ValueError(f"rollout.env_kwargs.{key}: environment {self.name!r} has no such option; "
                                 f"accepted: {sorted(self.options)}")
            default = self.options[key]
            ok = default is None or isinstance(value, type(default)) or (
                isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool))
            if not ok or (isinstance(value, bool) and not isinstance(default, bool) and default is not None):
                raise ValueError(f"rollout.env_kwargs.{key}={value!r}: environment {self.name!r} expects a "
                                 f"{type(default).__name__} (default {default!r})")
        options = {**self.options, **env_kwargs}
        if self.check is not None:
            self.check(options)
        return options


ENVIRONMENTS: Registry[EnvironmentSpec] = Registry("environment", "rollout.environment")


def register_environment(name: str, options: Mapping[str, Any] | None = None,
                         check: Callable[[dict[str, Any]], None] | None = None) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator registering ``fn(ctx) -> Environment`` as the environment ``name`` with the ``options``
    (``rollout.env_kwargs`` keys and defaults) it accepts and their ``check`` (``EnvironmentSpec``); returns
    ``fn``. Raises ValueError on a duplicate name."""

    def wrap(fn: EnvFactory) -> EnvFactory:
        ENVIRONMENTS.register(name, EnvironmentSpec(name, fn, dict(options or {}), check))
        return fn

    return wrap


class ToolEnvironment(Environment):
    """The model calls ``tools`` (``rollers.tools`` format) as often as it likes; each call is answered with
    the tool's result (reward 0). Its first turn without a tool call is its answer: scored with ``reward``
    against the ground truth, and the trajectory is done."""

    observation_role = "tool"

    def __init__(self, tools: list[Tool], reward: AsyncReward, timeout_s: float):
        self.tools = {t.name: t for t in tools}
        self.reward, self.timeout_s = reward, timeout_s
        self.ground_truth: dict = {}
        self.num_tool_calls = 0

    async def reset(self, ground_truth: dict) -> str:
        self.ground_truth = ground_truth
        return ""

    async def step(self, action: str) -> StepResult:
        call = parse_tool_call(action)
        if call is None:
            return StepResult(reward=await self.reward(action, self.ground_truth), done=True)
        self.num_tool_calls += 1
        return StepResult(observation=await call_tool(self.tools, call, self.timeout_s))


@register_environment("calculator")
def calculator_environment(ctx: EnvContext) -> Environment:
    """``calculator``: a :class:`ToolEnvironment` with the ``calculator`` tool (``rollers.tools``)."""
    return ToolEnvironment([calculator], ctx.reward, ctx.timeout_s)


@register_environment("gem", options={"env_id": "game:GuessTheNumber-v0-easy", "env_kwargs": {},
                                      "observation_role": "user"}, check=check_options)
def gem_environment(ctx: EnvContext) -> Environment:
    """``gem``: the GEM environment ``env_id`` (built with ``env_kwargs``), ``rollers.env_adapters.gem``;
    needs ``gem-llm`` (``pip install 'hflow-async[gem]'``), which the adapter imports only when the environment
    is checked or built."""
    return GemEnvironment.from_context(ctx)
