"""The roller as a Ray actor: one asyncio event loop runs the engine, the roller loop, weight updates and
the controller's calls.

Engines: ``rollers.engine=torch`` builds the in-process ``TorchEngine``; ``sglang`` launches (or connects to,
``rollers.sglang_url``) an SGLang server and uses ``SGLangEngine``. Weight updates arrive through the
checkpoint engine: ``attach_receiver(handle, name)`` once, then ``update_weights(weight_version, pause_mode)``
per sync (pause → receive every bucket → load → commit → flush → resume, ``rollers.weight_update.apply_update``).
The elastic pool (``controller.pool``) calls ``ping`` (health and held groups), ``drain`` (leave) and
``recent_put_uids`` (the groups it finished: a joining roller's first trained group);
``rollers.fault_injection`` faults (``rollers.faults``) fire in ``take_group`` and ``update_weights``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import torch

from rollers.config import RolloutConfig
from rollers.faults import FaultInjector, FaultSpec, FaultyChannel
from rollers.groups import FailedGroup, GroupResult, PromptGroup
from rollers.roller import Roller

logger = logging.getLogger(__name__)

PUT_LOG_SIZE = 256  # uids of the last groups put that a roller remembers (the pool reads them each second)


class RollerActor:
    """One roller (see the module docstring). ``reward``: ``rollout.reward`` with ``auto`` resolved by the
    controller (``rollers.rewards.build_reward_fn``). ``channel_factory()`` is called inside the actor and
    must be serialisable by Ray (runs pass ``rollers.tq_channel.TQGroupChannel.from_handle`` bound to the
    TransferQueue handle; the feeder puts only admitted groups). ``core_lending_dir``: the job's core-lending
    directory (``common.core_lending``; torch engine only), or None. Use ``remote_roller(num_cpus)`` to get the Ray class."""

    def __init__(self, model_cfg, rollout_cfg: RolloutConfig, rollers_cfg, reward: str, channel_factory,
                 *, remax_baseline: bool = False, roller_id: str = "roller0", core_lending_dir: str | None = None):
        from common.env import resolve_num_threads, set_torch_threads
        from common.models import load_tokenizer
        from rollers.rewards import build_reward_fn

        set_torch_threads(resolve_num_threads(rollers_cfg.num_threads))
        # No master weights here: the engine holds the model in model.compute_dtype (common.models).
        self.model_cfg, self.rollout_cfg, self.rollers_cfg = model_cfg.for_inference(), rollout_cfg, rollers_cfg
        self.roller_id = roller_id
        self.tokenizer = load_tokenizer(model_cfg)
        self.reward_fn = build_reward_fn(reward)
        self.channel_factory = channel_factory
        self.remax_baseline = remax_baseline
        self.engine = None
        self.roller: Roller | None = None
        self.receiver = None
        self._updating = asyncio.Lock()  # one weight update at a time; a re-attach waits for it to end
        self._run_task: asyncio.Task | None = None
        self.put_uids: deque[str] = deque(maxlen=PUT_LOG_SIZE)  # uids of the last groups put (recent_put_uids)
        self.faults = FaultInjector(roller_id, [FaultSpec.parse(f) for f in rollers_cfg.fault_injection])
        self.core_lending_dir = core_lending_dir
        if rollers_cfg.engine == "torch":  # build now: a bad model fails the actor's construction
            self._set_engine(self._torch_engine())

    def _torch_engine(self):
        from common.models import load_model
        from rollers.torch_engine import TorchEngine

        busy = None
        if self.core_lending_dir is not None:  # the trainer takes this roller's cores while it idles
            from common.core_lending import BusyFlag

            try:
                busy = BusyFlag(self.core_lending_dir, self.roller_id, torch.get_num_threads())
            except OSError as exc:  # an optimisation: the roller runs without it
                logger.warning("roller %s: no core lending (%s)", self.roller_id, exc)
        engine = TorchEngine(load_model(self.model_cfg), self.tokenizer,
                             max_batch_slots=self.rollers_cfg.max_batch_slots, seed=self.rollout_cfg.seed,
                             busy_flag=busy)
        self.rollout_cfg.check_model(engine.vocab_size)  # ValueError naming rollout.top_k
        return engine

    def _set_engine(self, engine) -> None:
        self.engine = engine
        channel = _PutLog(self.channel_factory(), self.put_uids)
        self.roller = Roller(
            engine, self.tokenizer, self.reward_fn, self.rollout_cfg,
            FaultyChannel(channel, self.faults) if self.faults.specs else channel,
            max_groups_in_flight=max(1, self.rollers_cfg.max_batch_slots // self.rollout_cfg.n),
            remax_baseline=self.remax_baseline, roller_id=self.roller_id,
        )

    async def _ensure_engine(self) -> None:
        if self.engine is None:  # rollers.engine=sglang: the server is launched inside the event loop
            from rollers.sglang_launcher import launch_sglang_engine

            self._set_engine(await launch_sglang_engine(self.rollers_cfg, self.model_cfg, seed=self.rollout_cfg.seed))

    async def start(self, max_groups: int | None = None) -> None:
        """Start the loop in the background (idempotent while it runs)."""
        await self._ensure_engine()
        if self._run_task is None or self._run_task.done():
            self._run_task = asyncio.create_task(self.roller.run(max_groups), name=f"{self.roller_id}-run")

    async def wait(self, timeout_s: float) -> int | None:
        """The loop's result (groups started) once it ended, None if still running after ``timeout_s``;
        re-raises the loop's error (e.g. ``EngineError``). Raises RuntimeError if never started."""
        if self._run_task is None:
            raise RuntimeError("the roller was never started")
        done, _ = await asyncio.wait({self._run_task}, timeout=timeout_s)
        return self._run_task.result() if done else None

    async def ping(self) -> dict:
        """Health check (answered from the event loop, so a blocked loop does not answer): the committed
        ``weight_version``, the uids of the groups this roller holds (``Roller.held_uids``), whether its
        loop is running, and the error that ended it ("" when none)."""
        return {
            "weight_version": self.engine.weight_version if self.engine is not None else -1,
            "held_uids": self.roller.held_uids() if self.roller is not None else [],
            "running": self._run_task is not None and not self._run_task.done(),
            "error": (f"{type(self._run_task.exception()).__name__}: {self._run_task.exception()}"
                      if self._run_task is not None and self._run_task.done() and not self._run_task.cancelled()
                      and self._run_task.exception() is not None else ""),
        }

    async def drain(self, timeout_s: float) -> list[str]:
        """Leave the pool gently: take no new group, let the held ones finish within ``timeout_s``, then
        cancel the rest. Returns the uids of the groups it still held (the controller re-issues them)."""
        if self.roller is None or self._run_task is None:
            return []
        self.roller.stop()
        done, _ = await asyncio.wait({self._run_task}, timeout=timeout_s)
        held = self.roller.held_uids(include_failed=False)  # failed ones: drain_failures, as usual
        if not done:
            self._run_task.cancel()
            await asyncio.gather(self._run_task, return_exceptions=True)
        return held

    async def stats(self) -> dict[str, float]:
        stats = self.roller.stats() if self.roller is not None else {}
        if self.engine is not None:
            stats["weight_version"] = float(self.engine.weight_version)
        return stats

    async def metrics_url(self) -> str | None:
        """Base URL of the SGLang server whose ``/metrics`` Prometheus can scrape: a real SGLang server this
        roller launched (with ``--enable-metrics``) or ``rollers.sglang_url``; None otherwise (the torch
        engine, or our torch server behind SGLang's API, which serves no ``/metrics``)."""
        cfg = self.rollers_cfg
        if cfg.engine != "sglang" or self.engine is None or not (cfg.sglang_url or cfg.sglang_launch == "sglang"):
            return None
        return self.engine.url

    async def busy_intervals(self) -> list[tuple[float, float]]:
        """``Roller.busy_intervals``: (start, end) wall-clock seconds with >= 1 request in flight."""
        return self.roller.busy_intervals() if self.roller is not None else []

    async def recent_put_uids(self) -> list[str]:
        """The uids of the last ``PUT_LOG_SIZE`` groups this roller put (oldest first; validation groups
        included): how the pool learns which trained groups a new roller generated (``PoolKeeper``)."""
        return list(self.put_uids)

    async def drain_failures(self) -> list[FailedGroup]:
        return self.roller.drain_failures() if self.roller is not None else []

    async def pause(self, mode: str = "abort") -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        await self.engine.load_weights(named_tensors, weight_version)

    async def attach_receiver(self, handle: dict, name: str) -> None:
        """Join the checkpoint engine's weight plane as roller ``name`` (``handle`` from the trainer side). Called
        again after a trainer restart (``controller.trainer_restart``), with the new trainer's handle: an update
        still waiting for the lost sender is cancelled first (the engine keeps its weights and version)."""
        from checkpointengine import WeightReceiver, WeightSyncHandle

        await self._ensure_engine()
        old, self.receiver = self.receiver, None
        if old is not None:
            old.cancel()
            async with self._updating:  # the cancelled update has ended (and resumed the engine)
                old.close()
        self.receiver = WeightReceiver(WeightSyncHandle.from_dict(handle), name)

    async def update_weights(self, weight_version: int, pause_mode: str) -> dict:
        """Receive and apply ``weight_version`` (``rollers.weight_update.apply_update``); returns duration and
        bytes.
        Raises WeightUpdateError (the old version is kept) or RuntimeError without ``attach_receiver``."""
        from rollers.weight_update import apply_update

        async with self._updating:
            if self.receiver is None:
                raise RuntimeError(f"roller {self.roller_id}: attach_receiver was never called")
            await self.faults.fire("weight_sync")
            result = await apply_update(self.engine, self.receiver, weight_version, pause_mode)
        return {"duration_s": result.duration_s, "num_bytes": result.num_bytes}

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (running groups finish, bounded by ``timeout_s``), then the engine. Idempotent."""
        if self.roller is not None:
            self.roller.stop()
        if self._run_task is not None and not self._run_task.done():
            done, _ = await asyncio.wait({self._run_task}, timeout=timeout_s)
            if not done:
                self._run_task.cancel()
                await asyncio.gather(self._run_task, return_exceptions=True)
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.engine is not None:
            await self.engine.shutdown()


def remote_roller(num_cpus: float = 0.5, resources: dict[str, float] | None = None):
    """``RollerActor`` as a Ray actor class with ``num_cpus`` logical CPUs and Ray custom ``resources``
    (``rollers.resources``) (imports Ray lazily)."""
    import ray

    return ray.remote(num_cpus=num_cpus, resources=dict(resources or {}))(RollerActor)


class _PutLog:
    """A ``GroupChannel`` that notes the uid of each group it puts into ``log`` (a bounded deque); any other
    attribute is the wrapped channel's (e.g. its TransferQueue ``client``)."""

    def __init__(self, channel, log: deque[str]):
        self.channel, self.log = channel, log

    def __getattr__(self, name: str):
        if name == "channel":  # not set yet (e.g. a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.channel, name)

    async def take_group(self, timeout_s: float) -> PromptGroup | None:
        return await self.channel.take_group(timeout_s)

    async def put_group(self, result: GroupResult) -> None:
        await self.channel.put_group(result)
        self.log.append(result.uid)
