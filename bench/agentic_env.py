"""The environment of ``bench/agentic_bench.py``: a long-tail number of turns, each tool call a timed wait.

``rollout.environment=bench.agentic_env:longtail_turns`` (rollers import it from the repository root, as
``module:name``). Options (``rollout.env_kwargs``):

* ``turns``: the number of model turns of a trajectory, a mixture ``weight:min-max,...`` (``8:1-2,2:6-12``:
  80% of the trajectories take 1-2 turns, 20% 6-12), drawn with ``EnvContext.seed`` (``rollers.agent_loop.environment_seed``
  of ``rollout.seed``, uid and sample index) — the same sample takes the same number of turns in every schedule and run;
* ``tool_latency_s``: seconds each tool call waits before it answers (a tool's or a sandbox's latency; the
  engine decodes other trajectories meanwhile);
* ``log_dir``: where each trajectory appends one JSON line when it closes (one file per process): its
  ``seed``, ``num_turns``, ``tool_wait_s`` and wall-clock ``start``/``end`` (``time.time()``, the run's
  ``timeline.json`` clock); "" = no log.

Each of the first K−1 turns is a tool call answered with ``OBSERVATION`` (reward 0); the K-th turn is the answer,
scored with the task's reward (``ctx.reward``). With ``rollout.forced_response_lengths`` every turn's length is
drawn too (``rollers.agent_loop``), so sync and fully-async decode exactly the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

from bench.schedule_sim import parse_lengths
from rollers.environments import EnvContext, Environment, StepResult, register_environment

OBSERVATION = "The tool says: keep going."
DEFAULT_TURNS = "7:1-2,2:3-4,1:8-12"


def num_turns(turns: str, seed: int) -> int:
    """The number of turns a trajectory with environment seed ``seed`` takes under the mixture ``turns``
    (``weight:min-max,...``: a bucket by weight, then uniform in [min, max]). Raises ValueError on a bad spec."""
    buckets = parse_lengths(turns)
    rng = random.Random(seed)
    _, low, high = rng.choices(buckets, weights=[b[0] for b in buckets])[0]
    return rng.randint(low, high)


def _check(options: dict) -> None:
    try:
        parse_lengths(options["turns"])
    except ValueError as exc:
        raise ValueError(f"rollout.env_kwargs.turns={options['turns']!r}: {exc}") from exc
    if options["tool_latency_s"] < 0:
        raise ValueError(f"rollout.env_kwargs.tool_latency_s={options['tool_latency_s']} must be >= 0 (seconds)")


class LongTailTurns(Environment):
    """See the module docstring."""

    observation_role = "user"

    def __init__(self, ctx: EnvContext):
        self.ctx = ctx
        self.num_turns = num_turns(ctx.options["turns"], ctx.seed)
        self.latency_s = float(ctx.options["tool_latency_s"])
        self.log_dir = ctx.options["log_dir"]
        self.turn, self.tool_wait_s, self.start = 0, 0.0, time.time()
        self.ground_truth: dict = {}

    async def reset(self, ground_truth: dict) -> str:
        self.ground_truth, self.start = ground_truth, time.time()
        return ""

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.turn >= self.num_turns:
            return StepResult(reward=await self.ctx.reward(action, self.ground_truth), done=True)
        started = time.perf_counter()
        await asyncio.sleep(self.latency_s)
        self.tool_wait_s += time.perf_counter() - started
        return StepResult(OBSERVATION, 0.0, False)

    async def close(self) -> None:
        if not self.log_dir:
            return
        record = {"seed": self.ctx.seed, "num_turns": self.turn, "tool_wait_s": self.tool_wait_s,
                  "start": self.start, "end": time.time()}
        path = Path(self.log_dir)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / f"{os.getpid()}.jsonl", "a") as out:  # small appends from one event loop
            out.write(json.dumps(record) + "\n")


@register_environment("longtail_turns", options={"turns": DEFAULT_TURNS, "tool_latency_s": 0.2, "log_dir": ""},
                      check=_check)
def longtail_turns(ctx: EnvContext) -> Environment:
    return LongTailTurns(ctx)
