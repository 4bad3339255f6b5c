"""GEM environments in the agent loop: ``rollout.environment=gem`` with ``rollout.env_kwargs.env_id``.

GEM (``gem-llm``, axon-rl: "a gym for agentic LLMs", https://github.com/axon-rl/gem) is a gym-style library
of text environments: ``gem.make(env_id, **kwargs)`` builds one, ``reset(seed) -> (observation, info)`` and
``step(action) -> (observation, reward, terminated, truncated, info)`` with text observations and text actions.
That is token-in/token-out as the agent loop needs it: the model's turn goes to ``step`` as decoded text (for
parsing only; the trajectory keeps the sampled token ids) and only the environment's observation is tokenised,
as a chat turn of ``observation_role`` (default ``user``). The first observation (``reset``: the game's
instructions) is appended after the prompt of ``data.task``, so the task's prompt can be a short instruction.

Options (``rollout.env_kwargs``): ``env_id`` (a GEM id, e.g. ``game:GuessTheNumber-v0-easy``,
``game:Mastermind-v0-easy``, ``rg:chain_sum``; ``gem.print_envs()`` lists them; the word games need NLTK's
``words`` corpus on disk, which GEM downloads at run time: not on an offline machine), ``env_kwargs`` (passed to
``gem.make``), ``observation_role``. Checked when the config is read (``check_options``).

Determinism: each trajectory resets its environment with ``EnvContext.seed`` (mod 2**32), so the same sample
meets the same game in every schedule. GEM seeds the process-global ``random`` and ``numpy.random`` in
``reset``, so calls into GEM are serialized by one lock per process and run in a worker thread (the event loop
never blocks on an environment). ``step``'s ``info["suffix"]`` (GEM's prompt for the next move) is appended to
a continuing observation, as GEM's own observation wrappers do. The reward of each step lands on the turn it
answers; ``terminated or truncated`` ends the trajectory. Rewards are GEM's: this environment does not call the
task's reward (``rollout.reward``; ``data.task`` supplies the prompts that open each game).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from typing import Any

from rollers.environment import EnvContext, Environment, EnvironmentFailure, StepResult

_GEM_LOCK = threading.Lock()  # GEM's reset seeds process-global RNGs: one call at a time per process
_ROLES = ("user", "tool", "system")


def _import_gem():
    """``import gem``, undoing what its import does to the process's logging (gem-llm 0.1.0 calls
    ``logging.basicConfig(level=INFO)``: a root handler and level that would print every library's INFO lines)."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        import gem
    except ImportError as exc:
        raise ValueError("rollout.environment=gem needs the gem-llm package: pip install 'hflow-async[gem]' "
                         f"({exc})") from exc
    finally:
        root.setLevel(level)
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
    return gem


def check_options(options: dict[str, Any]) -> None:
    """Validate the ``gem`` environment's options (see the module docstring). Raises ValueError naming
    ``rollout.env_kwargs.KEY`` for an unknown ``env_id``, an ``observation_role`` not in user/tool/system, or
    when gem-llm is not installed."""
    gem = _import_gem()
    registry = gem.envs.registration.ENV_REGISTRY
    if options["env_id"] not in registry:
        close = sorted(k for k in registry if k.split(":")[0] == str(options["env_id"]).split(":")[0])[:12]
        raise ValueError(f"rollout.env_kwargs.env_id={options['env_id']!r} is not a GEM environment; e.g. {close}")
    if options["observation_role"] not in _ROLES:
        raise ValueError(f"rollout.env_kwargs.observation_role={options['observation_role']!r}: accepted {_ROLES}")


class GemEnvironment(Environment):
    """One trajectory's GEM environment: ``env_id`` built with ``env_kwargs`` and reset with ``seed`` (int,
    < 2**32) when the trajectory starts."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any], seed: int, observation_role: str = "user"):
        self.env_id, self.env_kwargs, self.seed = env_id, env_kwargs, seed
        self.observation_role = observation_role
        self.env = None

    @classmethod
    def from_context(cls, ctx: EnvContext) -> GemEnvironment:
        """The adapter for ``ctx.options["env_id"]`` and ``["env_kwargs"]``, seeded by ``ctx.seed``."""
        opts = ctx.options
        return cls(opts["env_id"], dict(opts["env_kwargs"]), ctx.seed % 2**32, opts["observation_role"])

    def _locked(self, fn, *args):
        with _GEM_LOCK:
            return fn(*args)

    def _make_and_reset(self):
        env = _import_gem().make(self.env_id, **self.env_kwargs)  # a constructor may reset (and reseed) too
        return env, env.reset(seed=self.seed)

    async def reset(self, ground_truth: dict) -> str:
        self.env, (observation, _info) = await asyncio.to_thread(self._locked, self._make_and_reset)
        return _text(observation, "reset")

    async def step(self, action: str) -> StepResult:
        observation, reward, terminated, truncated, info = await asyncio.to_thread(self._locked, self.env.step,
                                                                                   action)
        done = bool(terminated or truncated)
        reward = float(reward)
        if not math.isfinite(reward):
            raise EnvironmentFailure(f"GEM step returned reward {reward!r}")
        text = _text(observation, "step")
        suffix = info.get("suffix") if isinstance(info, dict) else None
        if not done and isinstance(suffix, str) and suffix:
            text = f"{text}\n{suffix}"
        return StepResult(text, reward, done)


def _text(observation, where: str) -> str:
    if not isinstance(observation, str):
        raise EnvironmentFailure(f"GEM {where} returned a {type(observation).__name__} observation; the agent loop "
                                 "takes text environments")
    return observation
