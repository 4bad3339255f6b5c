"""The roller: take a prompt group, generate ``rollout.n`` samples, score them, put the response fields back.

::

    channel.take_group() ──> PromptGroup ──> n requests (per-sample seeds) ──> engine (continuous batching)
                                                 │   finish_reason=abort (pause for a weight update)?
                                                 │   → resubmit prompt + partial output after resume
                                                 ▼
                          decode ─> reward fn (thread, timeout) ─> build_response_fields ─> channel.put_group
                                                 │ raised / NaN / timed out
                                                 ▼
                                 FailedGroup (counted in stats(), drained by the controller)

**Admission** is the controller's: its prompt feeder puts only the groups its staleness rule admits
(``controller.ledger``), so the roller takes whatever is there, at most ``max_groups_in_flight`` groups
generated at once (enough to fill the engine's batch slots).

**Channel.** ``GroupChannel`` is the roller's only view of the data plane: ``take_group`` (one prompt
group, i.e. its prompt row, not yet taken by the ``rollout`` task, or ``None`` on timeout) and
``put_group`` (the group's samples, one row each). ``rollers.tq_channel.TQGroupChannel`` is the
TransferQueue one (what runs use; tests also use in-process ones). The fields on each side are the
contract's (``common.schema.ROLLER``); ``build_response_fields`` and the per-sample seeds live in
``rollers.response_fields``, the records (``PromptGroup`` in, ``GroupResult``/``FailedGroup`` out) and the
``GroupChannel`` protocol in ``rollers.groups``.

**Truncation.** A response ends with ``finish_reason=length`` at ``rollout.max_response_length`` tokens
or where prompt + response reach the engine's context length; both count in ``truncation_ratio``.

**Failures.** A reward that raises, returns NaN/inf or times out (``rollout.reward_timeout_s``) fails its
whole group, and so does a request the engine rejects (ValueError, e.g. too long) or a sample aborted
more than ``rollout.max_resubmits`` times: nothing of the group is put, a ``FailedGroup`` is recorded
(``drain_failures``) and counted; other groups are unaffected. An ``EngineError`` (the engine died) or
a data-plane error ends ``run`` with that error, so the controller sees it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from common import schema
from rollers.agent_loop import AgentLoop
from rollers.config import RolloutConfig
from rollers.engine import Engine, EngineError, GenerationOutput, GenerationRequest, SamplingParams
from rollers.environment import AsyncReward
from rollers.groups import FailedGroup, GroupChannel, GroupResult, PromptGroup
from rollers.response_fields import build_response_fields, forced_response_length, sample_seed
from rollers.rewards import RewardFn, RewardResult

logger = logging.getLogger(__name__)

REWARD_BASELINES = schema.REMAX_BASELINE  # (batch,) fp32: reward of the prompt's greedy response (ReMax)
_MAX_FAILURES_KEPT = 1024
_MAX_BUSY_INTERVALS_KEPT = 8192
TAKE_POLL_S = 0.5  # a take's long-poll at the TransferQueue index lasts at most this (``Roller.poll_timeout_s``)


# ----------------------------------------------------------------------------------------- the roller


class _Aborted(Exception):
    """A sample was aborted more than ``rollout.max_resubmits`` times."""


@dataclass
class _Counters:
    started_at: float = field(default_factory=time.perf_counter)
    num_tokens: int = 0
    num_samples: int = 0
    num_groups: int = 0
    num_val_groups: int = 0
    num_val_samples: int = 0
    num_truncated: int = 0
    num_failed_rewards: int = 0
    num_failed_groups: int = 0
    num_resubmits: int = 0
    in_flight: int = 0
    busy_s: float = 0.0
    busy_since: float | None = None
    busy_since_wall: float | None = None
    busy_intervals: deque = field(default_factory=lambda: deque(maxlen=_MAX_BUSY_INTERVALS_KEPT))
    lengths: deque = field(default_factory=lambda: deque(maxlen=4096))


class Roller:
    """The generate → score → put loop over one engine (no Ray here; ``RollerActor`` wraps it).

    ``engine``: a started ``Engine``; ``tokenizer``: decodes responses for the reward and gives the pad
    id; ``reward_fn``: ``(response_text, ground_truth) -> float``; ``rollout``: sampling config;
    ``channel``: a ``GroupChannel`` (it decides which groups exist to take: the feeder puts only admitted
    ones); ``max_groups_in_flight``: groups generated concurrently; ``remax_baseline``:
    also generate one greedy response per group and put its reward as ``reward_baselines`` (ReMax,
    Li et al. 2023); ``pad_to_max_length``: pad responses to ``rollout.max_response_length`` instead of
    the group's longest; ``roller_id``: prefix of request ids.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        reward_fn: RewardFn,
        rollout: RolloutConfig,
        channel: GroupChannel,
        *,
        max_groups_in_flight: int = 4,
        remax_baseline: bool = False,
        pad_to_max_length: bool = False,
        poll_timeout_s: float = TAKE_POLL_S,
        roller_id: str = "roller0",
    ):
        if max_groups_in_flight < 1:
            raise ValueError(f"max_groups_in_flight must be >= 1, got {max_groups_in_flight}")
        self.engine, self.tokenizer = engine, tokenizer
        self.rollout, self.channel = rollout, channel
        self.max_groups_in_flight = max_groups_in_flight
        self.remax_baseline = remax_baseline
        self.pad_to_max_length = pad_to_max_length
        self.poll_timeout_s = poll_timeout_s
        self.roller_id = roller_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = tokenizer.eos_token_id
        self._stop_ids = (eos,) if eos is not None else ()
        # Every reward call of this roller, single-turn and environments' alike (concurrency and timeout)
        self.reward = AsyncReward(reward_fn, rollout.reward_max_concurrency, rollout.reward_timeout_s)
        self.agent = None  # multi-turn trajectories when rollout.environment is set (rollers.agent_loop)
        if rollout.environment:
            self.agent = AgentLoop(rollout, tokenizer, self.reward, self._stop_ids)
        self._counters = _Counters()
        self._failures: deque[FailedGroup] = deque(maxlen=_MAX_FAILURES_KEPT)
        self._stopping = asyncio.Event()
        self._held: dict[str, int] = {}  # uid -> prompt id of the groups taken and not yet done

    # ------------------------------------------------------------------------------ control

    def stop(self) -> None:
        """Ask ``run`` to stop starting groups; it returns once the running ones are put."""
        self._stopping.set()

    def held_uids(self, include_failed: bool = True) -> list[str]:
        """The uids of the groups this roller took and has not yet put or failed, and (``include_failed``)
        of its failed groups the controller has not drained yet: what would be lost with this roller."""
        return [*self._held, *(f.uid for f in self._failures if include_failed)]

    def drain_failures(self) -> list[FailedGroup]:
        """Failed groups since the last call (oldest first; at most the last 1024 are kept)."""
        out = list(self._failures)
        self._failures.clear()
        return out

    async def run(self, max_groups: int | None = None) -> int:
        """Take, generate, score and put groups until ``stop()`` (or ``max_groups`` are started).

        Returns the number of groups started. Raises the first ``EngineError`` (after cancelling the
        other groups in flight).
        """
        slots = asyncio.Semaphore(self.max_groups_in_flight)
        tasks: set[asyncio.Task] = set()
        errors: list[BaseException] = []

        def on_done(task: asyncio.Task) -> None:
            slots.release()
            tasks.discard(task)
            self._held.pop(task.get_name().removeprefix(f"{self.roller_id}-"), None)
            if not task.cancelled() and task.exception() is not None:
                errors.append(task.exception())

        started = 0
        try:
            while not self._stopping.is_set() and (max_groups is None or started < max_groups):
                if errors:
                    raise errors[0]
                if not await _acquire(slots, self.poll_timeout_s):
                    continue
                first = await self.channel.take_group(self.poll_timeout_s)
                if first is None:
                    slots.release()
                    continue
                self._held[first.uid] = first.prompt_id  # held from the take on (the pool's orphan check)
                room = None if max_groups is None else max_groups - started - 1
                for group in [first, *await self._take_waiting(slots, room)]:
                    task = asyncio.create_task(self.process_group(group), name=f"{self.roller_id}-{group.uid}")
                    tasks.add(task)
                    task.add_done_callback(on_done)
                    started += 1
            while tasks and not errors:
                await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
            if errors:
                raise errors[0]
        finally:
            pending = set(tasks)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        return started

    async def _take_waiting(self, slots: asyncio.Semaphore, room: int | None) -> list[PromptGroup]:
        """The groups already waiting in the channel, while ``slots`` has a free slot (each taken one holds
        it) and ``room`` (None: no limit) allows; none is waited for. Starting them together with the group
        just taken lets the engine admit them in one prefill instead of one per decode step."""
        groups: list[PromptGroup] = []
        while not slots.locked() and not self._stopping.is_set() and (room is None or len(groups) < room):
            await slots.acquire()  # a free slot: returns at once
            group = await self.channel.take_group(0.0)
            if group is None:
                slots.release()
                break
            self._held[group.uid] = group.prompt_id
            groups.append(group)
        return groups

    # ------------------------------------------------------------------------------ one group

    async def process_group(self, group: PromptGroup) -> GroupResult | FailedGroup:
        """Generate, score and put one group; returns what was put or the recorded failure."""
        n = group.num_samples
        greedy = tuple(i >= n - group.num_greedy for i in range(n))
        try:
            async with asyncio.TaskGroup() as samples:  # one failing sample cancels its siblings
                tasks = [samples.create_task(self._generate(group, i, greedy=greedy[i])) for i in range(n)]
                if self.remax_baseline and not group.validation:
                    tasks.append(samples.create_task(self._generate(group, n, greedy=True)))
        except ExceptionGroup as group_error:
            # A request the engine rejects (ValueError) or a sample aborted too often fails this group;
            # anything else (EngineError: the engine is gone) ends the roller.
            failed, fatal = group_error.split((_Aborted, ValueError))
            if fatal is not None:
                raise fatal.exceptions[0] from group_error
            return self._fail(group, "generate", [f"{type(e).__name__}: {e}" for e in failed.exceptions])
        outputs = [task.result() for task in tasks]
        texts = self.tokenizer.batch_decode([o.output_ids for o in outputs], skip_special_tokens=True)
        if self.agent is not None:  # multi-turn: each trajectory was scored by its environment
            failed = [f"sample {i}: {o.error}" for i, o in enumerate(outputs) if o.error]
            if failed:
                self._counters.num_failed_rewards += len(failed)
                return self._fail(group, "environment", failed)
            return await self._put(group, outputs[:n], [RewardResult(o.reward) for o in outputs], greedy,
                                   tuple(texts[:n]))
        results = await asyncio.gather(*(self.reward.score(text, group.ground_truth) for text in texts))
        failed = [f"sample {i}: {r.error}" for i, r in enumerate(results) if r.failed]
        if failed:
            self._counters.num_failed_rewards += len(failed)
            return self._fail(group, "reward", failed)
        return await self._put(group, outputs[:n], results, greedy, tuple(texts[:n]))

    async def _put(self, group: PromptGroup, outputs: list[GenerationOutput], results: list[RewardResult],
                   greedy: tuple[bool, ...], texts: tuple[str, ...]) -> GroupResult:
        scores = [r.score for r in results]
        pad_to = self.rollout.max_response_length if self.pad_to_max_length else None
        build = build_response_fields if self.agent is None else self.agent.build_fields
        fields = build(outputs, scores[: len(outputs)], self.pad_token_id, pad_to)
        if self.remax_baseline:
            fields[REWARD_BASELINES] = torch.full((len(outputs),), scores[-1], dtype=torch.float32)
        result = GroupResult(group, fields, scores[: len(outputs)], greedy, texts)
        await self.channel.put_group(result)
        c = self._counters
        if group.validation:  # validation groups are counted apart: the training counts stay the schedule's
            c.num_val_groups += 1
            c.num_val_samples += len(outputs)
            return result
        c.num_groups += 1
        c.num_samples += len(outputs)
        c.num_truncated += sum(o.finish_reason == "length" for o in outputs)
        c.lengths.extend(len(o.output_ids) for o in outputs)
        return result

    def _fail(self, group: PromptGroup, stage: str, errors: list[str]) -> FailedGroup:
        failure = FailedGroup(group.uid, group.prompt_id, stage, tuple(errors),
                              group.partition if group.validation else "")
        self._counters.num_failed_groups += 1
        self._failures.append(failure)
        # debug: the controller reports each failed group once (a warning when skipped, or the run's error)
        logger.debug("group %s failed at %s: %s", group.uid, stage, "; ".join(errors)[:500])
        return failure

    async def _generate(self, group: PromptGroup, index: int, greedy: bool) -> GenerationOutput:
        """One sample, resubmitting prompt + partial output after each abort (partial rollout)."""
        if self.agent is not None:  # a multi-turn trajectory (rollers.agent_loop)
            return await self.agent.run(group, index, greedy, self._tracked, f"{self.roller_id}/{group.uid}/{index}",
                                        self.engine.max_seq_len)
        cfg = self.rollout
        forced = None if greedy or group.validation else forced_response_length(cfg, group.uid, index)
        limit = cfg.max_response_length if forced is None else forced
        merged = GenerationOutput(request_id=f"{self.roller_id}/{group.uid}/{index}",
                                  prompt_tokens=len(group.input_ids))
        for attempt in range(cfg.max_resubmits + 1):
            done = len(merged.output_ids)
            sampling = SamplingParams(
                max_new_tokens=limit - done,
                temperature=0.0 if greedy else cfg.temperature,
                top_p=cfg.top_p, top_k=cfg.top_k,
                seed=sample_seed(cfg.seed, group.seed_key or group.uid, index, done),
                stop_token_ids=self._stop_ids if forced is None else (),
                ignore_eos=forced is not None,
            )
            request = GenerationRequest(f"{merged.request_id}/{attempt}",
                                        tuple(group.input_ids) + tuple(merged.output_ids), sampling)
            out = await self._tracked(request)
            merged.output_ids += out.output_ids
            merged.output_log_probs += out.output_log_probs
            merged.weight_versions += out.weight_versions
            if out.finish_reason != "abort":
                merged.finish_reason = out.finish_reason
                return merged
            if len(merged.output_ids) >= limit:
                merged.finish_reason = "length"
                return merged
            self._counters.num_resubmits += 1
        raise _Aborted(f"sample {index} aborted {cfg.max_resubmits + 1} times (rollout.max_resubmits)")

    async def _tracked(self, request: GenerationRequest) -> GenerationOutput:
        c = self._counters
        if c.in_flight == 0:
            c.busy_since, c.busy_since_wall = time.perf_counter(), time.time()
        c.in_flight += 1
        try:
            out = await self.engine.generate(request)
        finally:
            c.in_flight -= 1
            if c.in_flight == 0 and c.busy_since is not None:
                c.busy_s += time.perf_counter() - c.busy_since
                c.busy_intervals.append((c.busy_since_wall, time.time()))
                c.busy_since = c.busy_since_wall = None
        c.num_tokens += len(out.output_ids)
        return out

    # ------------------------------------------------------------------------------ metrics

    def busy_intervals(self) -> list[tuple[float, float]]:
        """The roller's busy intervals (>= 1 request in flight), oldest first, as ``(start, end)`` wall-clock
        times (``time.time()``, seconds since the epoch, comparable across processes of one machine); an
        interval still open ends now. At most the last 8192 are kept."""
        c = self._counters
        out = list(c.busy_intervals)
        if c.busy_since_wall is not None:
            out.append((c.busy_since_wall, time.time()))
        return out

    def stats(self) -> dict[str, float]:
        """Since construction: ``tokens_per_s`` (generated, incl. aborted parts), ``requests_in_flight``,
        ``busy_ratio`` (share of wall time with >= 1 request in flight), ``response_length_mean/min/max``
        (tokens, last 4096 put samples), ``truncation_ratio`` (finish_reason ``length`` / put samples),
        ``num_groups``, ``num_samples`` (training groups; validation ones in ``num_val_groups``,
        ``num_val_samples``), ``num_failed_groups``, ``num_failed_rewards`` (samples),
        ``num_resubmits`` (partial-rollout continuations)."""
        c = self._counters
        now = time.perf_counter()
        elapsed = max(now - c.started_at, 1e-9)
        busy = c.busy_s + (now - c.busy_since if c.busy_since is not None else 0.0)
        lengths = list(c.lengths)
        agent = self.agent.stats() if self.agent is not None else {}
        return agent | {
            "tokens_per_s": c.num_tokens / elapsed,
            "requests_in_flight": float(c.in_flight),
            "busy_ratio": min(busy / elapsed, 1.0),
            "response_length_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "response_length_min": float(min(lengths, default=0)),
            "response_length_max": float(max(lengths, default=0)),
            "truncation_ratio": c.num_truncated / c.num_samples if c.num_samples else 0.0,
            "num_groups": float(c.num_groups),
            "num_samples": float(c.num_samples),
            "num_val_groups": float(c.num_val_groups),
            "num_val_samples": float(c.num_val_samples),
            "num_failed_groups": float(c.num_failed_groups),
            "num_failed_rewards": float(c.num_failed_rewards),
            "num_resubmits": float(c.num_resubmits),
        }


async def _acquire(semaphore: asyncio.Semaphore, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(semaphore.acquire(), timeout_s)
        return True
    except TimeoutError:
        return False


__all__ = [
    "REWARD_BASELINES", "EngineError", "FailedGroup", "GroupChannel", "GroupResult",
    "PromptGroup", "Roller", "build_response_fields", "sample_seed",
]
