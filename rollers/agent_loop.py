"""The agent loop: one sample as a multi-turn trajectory of model and environment tokens.

::

    prompt ids ──> env.reset(ground_truth) ──> [first observation tokens, mask 0]
        ┌─> generate one turn (engine, input_ids = prompt + trajectory so far)   tokens mask 1, log-probs,
        │      finish_reason=abort (a weight update paused it)? resubmit prompt + trajectory (partial rollout)
        │   env.step(decoded turn) ──> StepResult(observation, reward, done)     reward on the turn's last token
        │   done, rollout.max_turns turns, or the length budget reached? ──> end
        └── append the observation as a chat turn (tokens, mask 0)

**Token-in/token-out.** The trajectory is kept as token ids: the model's tokens exactly as sampled, the
environment's tokens as :class:`ObservationFormatter` renders them with the model's chat template. A turn is
decoded only to be parsed by the environment; nothing is ever re-tokenised, so what the trainer scores is what
was sampled.

**Masks, log-probs, versions.** ``response_mask`` is 1 on model tokens only; ``rollout_log_probs`` are the
engine's on model tokens and 0 on environment tokens; ``token_level_scores`` carry each step's reward on the
last model token of the turn it answers (the final reward on the last model token). ``min_weight_version`` /
``max_weight_version`` span the model tokens of every turn, so a trajectory paused by a weight update while
decoding or while waiting on its environment records both versions.

**Budget.** ``rollout.max_response_length`` bounds the whole trajectory (model + environment tokens), and so
does the engine's context length. A turn cut by the budget ends the trajectory (``finish_reason=length``,
its action still answered by the environment, so it is scored); an observation that does not fit, or
``rollout.max_turns`` answered turns, ends it too (``length`` / the last turn's own reason).

**Forced lengths** (``rollout.forced_response_lengths``, throughput benchmarks: ``bench/agentic_bench.py``):
each sampled turn decodes exactly L tokens, EOS ignored, L drawn from the mixture per (uid, sample index,
turn number), so every schedule decodes the same turns.

**Seeds.** Each turn samples with ``sample_seed(rollout.seed, uid, index, tokens so far)``, and the environment
gets ``environment_seed(rollout.seed, uid, index)`` (``EnvContext.seed``): the trajectory does not depend on batch
composition, roller or schedule (``fully-async`` at ``max_staleness=0`` equals ``sync``).

**Failures.** An environment, tool or reward that raises or times out, or a turn aborted more than
``rollout.max_resubmits`` times, gives a trajectory with ``error`` set (the roller fails its group and counts
it); a request the engine rejects raises ValueError and an ``EngineError`` propagates, as in single-turn.
``close`` is cleanup: one that raises or times out is counted (``num_env_close_failures``; logged as a warning
the 1st, 10th, 100th... time) and the trajectory keeps its score.
"""

from __future__ import annotations

import logging
import math
import reprlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from common import schema
from rollers.config import RolloutConfig
from rollers.engine import GenerationOutput, GenerationRequest, SamplingParams
from rollers.environment import AsyncReward, EnvContext, Environment, EnvironmentFailure, StepResult
from rollers.environments import ENVIRONMENTS
from rollers.groups import PromptGroup
from rollers.response_fields import build_response_fields, forced_response_length, sample_seed
from rollers.rewards import reward_result
from rollers.user_calls import call_user

_PLACEHOLDER = "\x00OBSERVATION\x00"
_ARG_PREVIEW = 80
_ARG_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_ARG_REPR.maxstring = _ARG_REPR.maxother = _ARG_REPR.maxlong = _ARG_PREVIEW
logger = logging.getLogger(__name__)

GenerateFn = Callable[[GenerationRequest], Awaitable[GenerationOutput]]


class ObservationFormatter:
    """Token ids of an observation as a chat turn, to append after the model's turn (which ended with its
    stop token). Rendered with the tokenizer's chat template: the text the template puts between the end of a
    turn and the next turn (e.g. ChatML's ``\\n``), then the turn of ``role`` with the observation, then the
    generation prompt of the assistant. Raises ValueError at construction for a template that cannot be split
    this way."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._templates: dict[str, tuple[str, str]] = {}

    def _template(self, role: str) -> tuple[str, str]:
        if role not in self._templates:
            base_msgs = [{"role": "user", "content": "x"}]
            render = self.tokenizer.apply_chat_template
            base = render(base_msgs, tokenize=False)
            full = render([*base_msgs, {"role": role, "content": _PLACEHOLDER}], tokenize=False,
                          add_generation_prompt=True)
            if not full.startswith(base) or full.count(_PLACEHOLDER) != 1:
                raise ValueError(f"the chat template cannot render a {role!r} turn after a user turn as a suffix")
            eos = self.tokenizer.eos_token or ""
            glue = base[base.rfind(eos) + len(eos):] if eos and eos in base else ""
            before, after = full[len(base):].split(_PLACEHOLDER)
            self._templates[role] = (glue + before, after)
        return self._templates[role]

    def tokens(self, role: str, text: str) -> list[int]:
        """The ids of ``text`` as a ``role`` turn followed by the assistant's generation prompt."""
        before, after = self._template(role)
        return list(self.tokenizer.encode(before + text + after, add_special_tokens=False))


@dataclass
class Trajectory(GenerationOutput):
    """A multi-turn sample: ``output_ids`` are model and environment tokens in order; ``response_mask`` 1 on
    model tokens; ``output_log_probs`` 0 and ``weight_versions`` -1 on environment tokens; ``token_scores``
    each step's reward at the last model token of its turn; ``reward`` their sum; ``num_turns`` model turns;
    ``error`` why the trajectory failed ("" = it did not); ``env_wait_s`` seconds spent in the environment."""

    response_mask: list[int] = field(default_factory=list)
    token_scores: list[float] = field(default_factory=list)
    reward: float = 0.0
    num_turns: int = 0
    error: str = ""
    env_wait_s: float = 0.0

    def _model_versions(self) -> list[int]:
        return [v for v, m in zip(self.weight_versions, self.response_mask, strict=True) if m]

    @property
    def min_weight_version(self) -> int | None:
        return min(self._model_versions(), default=None)

    @property
    def max_weight_version(self) -> int | None:
        return max(self._model_versions(), default=None)

    def append(self, ids: Sequence[int], log_probs: Sequence[float] | None,
               weight_versions: Sequence[int] | None) -> None:
        """Append model tokens (with their log-probs and weight versions) or, with ``None``, environment tokens."""
        self.output_ids += list(ids)
        self.output_log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.weight_versions += list(weight_versions) if weight_versions is not None else [-1] * len(ids)
        self.response_mask += [1 if log_probs is not None else 0] * len(ids)
        self.token_scores += [0.0] * len(ids)


class _TurnAborted(Exception):
    pass


def _seed_key(group: PromptGroup) -> str:
    """What a group's seeds derive from: its ``seed_key`` (validation rounds) or its uid, as in single-turn."""
    return group.seed_key or group.uid


def _describe_call(env_name: str, method: Callable, args: tuple) -> str:
    """``environment 'NAME'.step('<tool_call>{"name": "calc...')``: which call failed, each argument shown by
    ``reprlib`` (strings cut to ``_ARG_PREVIEW`` characters: a step's action shows the tool it calls; a
    ground truth too large to show, by its type)."""
    shown = []
    for arg in args:
        try:
            shown.append(_ARG_REPR.repr(arg))
        except Exception:  # noqa: BLE001 - e.g. an int too long to convert: the message must still be built
            shown.append(type(arg).__name__)
    return f"environment {env_name!r}.{getattr(method, '__name__', 'call')}({', '.join(shown)})"


def environment_seed(rollout_seed: int, key: str, index: int) -> int:
    """The seed of sample ``index``'s environment (``EnvContext.seed``; 62 bits) in group ``key`` (its uid, or
    ``seed_key``): depends on (``rollout.seed``, key, index) only, and differs from the turns' sampling seeds."""
    return sample_seed(rollout_seed, f"environment:{key}", index)


class AgentLoop:
    """Runs trajectories for a roller (see the module docstring). ``rollout``: the config (``environment``,
    ``max_turns``, ``env_timeout_s``, sampling); ``tokenizer``: decodes turns and formats observations;
    ``reward``: the roller's task reward (what environments score with, ``EnvContext.reward``); ``stop_ids``:
    the model's stop tokens. Raises ValueError for an unknown ``rollout.environment``."""

    def __init__(self, rollout: RolloutConfig, tokenizer, reward: AsyncReward, stop_ids: tuple[int, ...]):
        self.rollout, self.tokenizer, self.stop_ids = rollout, tokenizer, stop_ids
        self.spec = ENVIRONMENTS.get(rollout.environment)
        self.context = EnvContext(reward, rollout.env_timeout_s, self.spec.resolve_options(rollout.env_kwargs))
        self.formatter = ObservationFormatter(tokenizer)
        self.num_turns = 0
        self.num_trajectories = 0
        self.env_wait_s = 0.0
        self.num_turn_resubmits = 0
        self.num_close_failures = 0

    def stats(self) -> dict[str, float]:
        """``num_turns`` (model turns of finished trajectories), ``turns_per_trajectory``, ``env_wait_s``
        (seconds trajectories spent in their environments, summed), ``num_turn_resubmits`` (partial-rollout
        continuations of turns), ``num_env_close_failures`` (``close`` calls that raised or timed out)."""
        per = self.num_turns / self.num_trajectories if self.num_trajectories else 0.0
        return {"num_turns": float(self.num_turns), "turns_per_trajectory": per, "env_wait_s": self.env_wait_s,
                "num_turn_resubmits": float(self.num_turn_resubmits),
                "num_env_close_failures": float(self.num_close_failures)}

    async def run(self, group: PromptGroup, index: int, greedy: bool, generate: GenerateFn, request_id: str,
                  max_seq_len: int | None) -> Trajectory:
        """Sample ``index`` of ``group`` as a trajectory, each turn through ``generate`` (the roller's engine
        call). Returns it with ``error`` set on an environment failure or too many aborts."""
        traj = Trajectory(request_id=request_id, prompt_tokens=len(group.input_ids))
        try:
            seed = environment_seed(self.rollout.seed, _seed_key(group), index)
            env = self.spec.make(replace(self.context, seed=seed))
        except Exception as exc:  # a user's factory may fail in any way: its trajectory fails
            traj.error = f"environment {self.spec.name!r} could not be built: {type(exc).__name__}: {exc}"
            return traj
        missing = [m for m in ("reset", "step", "close") if not callable(getattr(env, m, None))]
        if missing:  # e.g. a factory that forgot its return: None
            traj.error = (f"environment {self.spec.name!r}'s factory returned {type(env).__name__}, not an "
                          f"Environment (no {', '.join(missing)})")
            return traj
        try:  # engine errors (ValueError: a rejected request; EngineError) propagate as in single-turn
            await self._run(env, traj, group, index, greedy, generate, max_seq_len)
        except (EnvironmentFailure, _TurnAborted) as exc:
            traj.error = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                await self._env_call(traj, env.close)
            except EnvironmentFailure as exc:  # cleanup only: the trajectory keeps its score (or its error)
                self.num_close_failures += 1
                count = self.num_close_failures
                level = logging.WARNING if math.log10(count).is_integer() else logging.DEBUG  # 1st, 10th, ...
                logger.log(level, "group %s, trajectory %s: %s (%d close failures in this roller)", group.uid,
                           request_id, exc, count)
        self.num_trajectories += 1
        self.num_turns += traj.num_turns
        self.env_wait_s += traj.env_wait_s
        return traj

    async def _env_call(self, traj: Trajectory, method: Callable, *args):
        """``method(*args)`` (an environment's ``reset``/``step``/``close``: async, or sync in a thread of its
        own, ``rollers.user_calls``), bounded by ``rollout.env_timeout_s``; whatever the call raises (but
        cancellation) becomes EnvironmentFailure, so it can only fail its trajectory."""
        started = time.perf_counter()
        try:
            return await call_user(self.rollout.env_timeout_s, method, *args)
        except TimeoutError as exc:
            raise EnvironmentFailure(f"{_describe_call(self.spec.name, method, args)} took longer than "
                                     f"rollout.env_timeout_s={self.rollout.env_timeout_s}") from exc
        except EnvironmentFailure:
            raise
        except Exception as exc:  # a user's environment or tool may fail in any way
            raise EnvironmentFailure(f"{_describe_call(self.spec.name, method, args)} raised "
                                     f"{type(exc).__name__}: {exc}") from exc
        finally:
            traj.env_wait_s += time.perf_counter() - started

    def _observation(self, role: str, text: str) -> list[int]:
        try:
            return self.formatter.tokens(role, text)
        except Exception as exc:  # a template that cannot render the role, or a non-str observation
            raise EnvironmentFailure(f"cannot format a {role!r} observation: {type(exc).__name__}: {exc}") from exc

    def _room(self, traj: Trajectory, group: PromptGroup, max_seq_len: int | None) -> int:
        room = self.rollout.max_response_length - len(traj.output_ids)
        if max_seq_len is not None:
            room = min(room, max_seq_len - len(group.input_ids) - len(traj.output_ids))
        return room

    async def _run(self, env: Environment, traj: Trajectory, group: PromptGroup, index: int, greedy: bool,
                   generate: GenerateFn, max_seq_len: int | None) -> None:
        first = await self._env_call(traj, env.reset, group.ground_truth)
        if first:
            ids = self._observation(env.observation_role, first)
            if len(ids) >= self._room(traj, group, max_seq_len):
                raise EnvironmentFailure(f"the first observation ({len(ids)} tokens) leaves no room for a turn")
            traj.append(ids, None, None)
        while True:
            reason = await self._turn(traj, group, index, greedy, generate, max_seq_len)
            traj.num_turns += 1
            result = await self._env_call(traj, env.step, self._last_turn_text(traj))
            if not isinstance(result, StepResult):
                raise EnvironmentFailure(f"step returned {type(result).__name__}, not a StepResult")
            scored = reward_result(result.reward)  # the same numbers a reward function may return
            if scored.failed:
                raise EnvironmentFailure(f"step's StepResult.reward: {scored.error}")
            if not isinstance(result.done, bool | np.bool_):  # "False" would end the trajectory
                raise EnvironmentFailure(f"step returned StepResult.done={result.done!r}, not a bool")
            last = max(i for i, m in enumerate(traj.response_mask) if m)
            traj.token_scores[last] += scored.score
            traj.reward += scored.score
            if result.done or reason == "length" or traj.num_turns >= self.rollout.max_turns:
                traj.finish_reason = reason
                return
            ids = self._observation(env.observation_role, result.observation)
            if len(ids) >= self._room(traj, group, max_seq_len):  # no room for the observation and a turn
                traj.finish_reason = "length"
                return
            traj.append(ids, None, None)

    def _last_turn_text(self, traj: Trajectory) -> str:
        end = len(traj.output_ids)
        start = end
        while start > 0 and traj.response_mask[start - 1]:
            start -= 1
        return self.tokenizer.decode(traj.output_ids[start:end], skip_special_tokens=True)

    async def _turn(self, traj: Trajectory, group: PromptGroup, index: int, greedy: bool, generate: GenerateFn,
                    max_seq_len: int | None) -> str:
        """One model turn, resubmitted with its partial output after each abort; returns its finish_reason."""
        cfg = self.rollout
        budget = self._room(traj, group, max_seq_len)
        forced = None if greedy or group.validation else \
            forced_response_length(cfg, f"{group.uid}/turn{traj.num_turns}", index)
        limit = budget if forced is None else min(forced, budget)
        start = len(traj.output_ids)
        for attempt in range(cfg.max_resubmits + 1):
            sampling = SamplingParams(
                max_new_tokens=limit - (len(traj.output_ids) - start), temperature=0.0 if greedy else cfg.temperature,
                top_p=cfg.top_p, top_k=cfg.top_k,
                seed=sample_seed(cfg.seed, _seed_key(group), index, len(traj.output_ids)),
                stop_token_ids=self.stop_ids if forced is None else (), ignore_eos=forced is not None)
            request = GenerationRequest(f"{traj.request_id}/t{traj.num_turns}/{attempt}",
                                        tuple(group.input_ids) + tuple(traj.output_ids), sampling)
            out = await generate(request)
            traj.append(out.output_ids, out.output_log_probs, out.weight_versions)
            generated = len(traj.output_ids) - start
            if out.finish_reason == "abort" and generated < limit:  # paused by a weight update: resubmit
                self.num_turn_resubmits += 1
                continue
            if forced is not None and generated >= limit:  # a forced turn that got its length is a stop
                return "stop" if limit < budget else "length"
            return "length" if out.finish_reason == "abort" else out.finish_reason
        raise _TurnAborted(f"turn {traj.num_turns} aborted {cfg.max_resubmits + 1} times (rollout.max_resubmits)")

    def build_fields(self, outputs: Sequence[Trajectory], scores: Sequence[float], pad_token_id: int,
                     pad_to: int | None = None) -> dict[str, Any]:
        """``rollers.response_fields.build_response_fields`` for trajectories, with ``response_mask`` 1 on model
        tokens only, ``rollout_log_probs`` 0 on environment tokens and ``token_level_scores`` the per-turn
        rewards (``(batch, response_len)`` each; ``scores`` must be the trajectories' ``reward``)."""
        fields = build_response_fields(outputs, scores, pad_token_id, pad_to)
        for row, traj in enumerate(outputs):
            length = len(traj.output_ids)
            fields[schema.RESPONSE_MASK][row, :length] = torch.tensor(traj.response_mask, dtype=torch.int64)
            fields[schema.TOKEN_LEVEL_SCORES][row, :] = 0.0
            fields[schema.TOKEN_LEVEL_SCORES][row, :length] = torch.tensor(traj.token_scores, dtype=torch.float32)
        return fields

