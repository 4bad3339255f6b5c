"""Config sections owned by the rollers: ``rollout`` (sampling) and ``rollers`` (the pool)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from common.env import AUTO_THREADS, check_num_threads, check_ray_resources
from rollers.engine import check_sampling

ENGINES = ("torch", "sglang")
SGLANG_LAUNCH = ("sglang", "torch")


@dataclass
class RolloutConfig:
    """Sampling. Lengths in tokens.

    ``n``: samples per prompt (``rollout.n``); ``top_k`` -1 disables it (at most the model's vocabulary:
    ``check_model``); ``seed`` is the base of the per-sample seeds (sampling is independent of batch
    composition). A response ends with ``finish_reason=length`` at ``max_response_length`` tokens, or
    earlier where prompt + response reach the model's context length.
    ``reward``: auto (the reward ``data.task`` names, resolved by the controller:
    ``controller.tasks.resolve_reward``) | reasoning_gym | tiny_repeat | math_verify | ``module:function``
    (``rollers.rewards.build_reward_fn``), sync or ``async def``; ``reward_timeout_s`` bounds one reward call
    (seconds; a sample whose call exceeds it fails its group) and ``reward_max_concurrency`` is how many reward
    calls one roller runs at once (single-turn and environments' alike, ``rollers.environments.AsyncReward``);
    ``max_resubmits``: how many times one sample may be aborted (pause in
    ``abort`` mode) and resubmitted with its partial output before it is marked failed.

    ``forced_response_lengths``: for throughput benchmarks (``bench/modes_bench.py``'s long-tail workload):
    a list of ``[weight, min_tokens, max_tokens]`` buckets (integers; weights relative). When set, every
    sampled response ignores EOS (and the stop tokens) and decodes exactly L tokens, L drawn per sample from
    the mixture (a bucket by weight, then uniform in ``[min_tokens, max_tokens]``) with a generator seeded
    by (``seed``, uid, sample index), so the same prompt and sample get the same length in every schedule,
    roller and run (``rollers.roller.forced_response_length``). Rewards score the text as usual. Empty (the
    default): responses end at EOS or ``max_response_length``. With an ``environment`` each model turn is
    forced instead, its length drawn per (uid, sample index, turn number) (``bench/agentic_bench.py``).

    Multi-turn (``rollers.agent_loop``): ``environment`` names a registered environment
    (``rollers.environments.ENVIRONMENTS``, or ``module:name``); empty (the default) = single-turn. A
    trajectory has at most ``max_turns`` model turns, and ``max_response_length`` bounds all its tokens (model
    and environment); ``env_timeout_s`` bounds each environment call and tool call (seconds); ``env_kwargs``:
    options of the environment (the keys its spec declares, ``rollers.environments.EnvironmentSpec.options``).
    """

    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_length: int = 32
    seed: int = 0
    reward: str = "auto"
    reward_timeout_s: float = 30.0
    reward_max_concurrency: int = 8
    max_resubmits: int = 16
    forced_response_lengths: list[list[int]] = field(default_factory=list)
    environment: str = ""
    max_turns: int = 4
    env_timeout_s: float = 30.0
    env_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self._check_environment()
        if not self.reward:
            raise ValueError("rollout.reward must be auto | reasoning_gym | tiny_repeat | math_verify | module:function")
        if self.reward_timeout_s <= 0:
            raise ValueError(f"rollout.reward_timeout_s must be > 0 (seconds), got {self.reward_timeout_s}")
        if self.reward_max_concurrency < 1:
            raise ValueError(f"rollout.reward_max_concurrency must be >= 1, got {self.reward_max_concurrency}")
        if self.max_resubmits < 0:
            raise ValueError(f"rollout.max_resubmits must be >= 0, got {self.max_resubmits}")
        if self.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {self.n}")
        check_sampling(self.temperature, self.top_p, self.top_k, prefix="rollout.")
        if self.max_response_length < 1:
            raise ValueError(f"rollout.max_response_length must be >= 1, got {self.max_response_length}")
        self._check_forced_lengths()

    def _check_environment(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"rollout.max_turns must be >= 1, got {self.max_turns}")
        if self.env_timeout_s <= 0:
            raise ValueError(f"rollout.env_timeout_s must be > 0 (seconds), got {self.env_timeout_s}")
        if not isinstance(self.env_kwargs, dict):
            raise ValueError(f"rollout.env_kwargs must be a mapping of option -> value, got {self.env_kwargs!r}")
        if self.env_kwargs and not self.environment:
            raise ValueError(f"rollout.env_kwargs={self.env_kwargs!r} configure an environment; set rollout.environment")
        if self.environment:
            from rollers.environments import ENVIRONMENTS

            # ValueError naming rollout.environment and the registered ones, or a rollout.env_kwargs key
            ENVIRONMENTS.get(self.environment).resolve_options(self.env_kwargs)

    def _check_forced_lengths(self) -> None:
        for bucket in self.forced_response_lengths:
            ok = len(bucket) == 3 and all(isinstance(v, int) for v in bucket)
            if ok:
                weight, low, high = bucket
                ok = weight >= 1 and 1 <= low <= high <= self.max_response_length
            if not ok:
                raise ValueError(
                    f"rollout.forced_response_lengths={self.forced_response_lengths}: each bucket must be "
                    f"[weight >= 1, min_tokens >= 1, max_tokens] with min_tokens <= max_tokens <= "
                    f"rollout.max_response_length={self.max_response_length}; got {bucket}")

    def check_model(self, vocab_size: int) -> None:
        """The checks that need the model: ``rollout.top_k`` at most ``vocab_size`` (the model's vocabulary).
        Raises ValueError naming the key; run at start, before any pool (``controller.job.check_config``)."""
        if self.top_k > vocab_size:
            raise ValueError(f"rollout.top_k={self.top_k} exceeds the model's vocabulary of {vocab_size} tokens; "
                             f"accepted: -1 (off) or 1 .. {vocab_size}")


@dataclass
class RollersConfig:
    """The roller pool. ``engine``: torch (in-process) | sglang (HTTP client of an SGLang server).

    ``max_batch_slots``: concurrent sequences in the torch engine's continuous batch;
    ``num_threads``: torch threads per roller process, ``auto`` (chosen per mode by the controller,
    ``controller.resources.plan_threads``) or an integer; ``sglang_url``: connect to this server instead of
    launching one (sglang engine only). When launching (``rollers.sglang_launcher``):
    ``sglang_launch`` sglang (``python -m sglang.launch_server``, needs SGLang and a GPU) | torch (our
    torch engine behind SGLang's API, ``python -m rollers.sglang_server``); ``sglang_mem_fraction``:
    SGLang's ``--mem-fraction-static``; ``sglang_colocated``: the trainer shares the GPU (adds
    ``--enable-memory-saver``); ``sglang_startup_timeout_s``: wait for ``/health``;
    ``sglang_request_timeout_s``: limit of one ``/generate``; ``sglang_max_retries``: ``/flush_cache``
    retries (exponential backoff) while requests drain during a weight update.
    ``on_failed_group``: what the controller does with a group whose reward or generation failed —
    ``fail`` (stop the run with that error) | ``skip`` (count it and train on: in sync and one-step-off the
    step trains its other groups; in fully-async a fresh prompt takes its place, and the run fails once
    ``controller.schedules.MIN_FAILED_IN_A_ROW`` groups, or two steps' worth, fail in a row).
    ``resources``: Ray custom resources each roller asks for (name -> amount, e.g. ``{hflow_roller: 1}``),
    so rollers are placed only on the nodes started with them (``common.env.check_ray_resources``).

    Elastic pool (``controller.pool``): ``health_timeout_s``: a roller that does not answer a health check
    or a pool call within this many seconds, or a weight update within it after the sender gave up, is
    taken out of rotation, its groups re-issued, and replaced; ``max_replicas``: the most rollers a
    scale request (``hflow-async scale``) may ask for; ``max_restarts``: replacements of lost rollers
    over the run (past it the pool shrinks; the run fails only when no roller is left);
    ``autoscale``: resize on RL signals within ``min_replicas`` .. ``max_replicas``, at most one change per
    ``autoscale_period_s`` (also the window the signals are averaged over): add a roller when the trainer
    waited for data at least ``autoscale_wait_share`` of the window while prompts waited for a roller;
    remove one when admission sat at its staleness cap with no prompt waiting most of the window
    (``controller.pool_keeper.Autoscaler``);
    ``fault_injection``: ``ROLLER:FAULT:TRIGGER=N[:SECONDS]`` specs that kill, hang or slow a roller on
    purpose (``rollers.faults``).
    """

    num_replicas: int = 1
    engine: str = "torch"
    num_threads: int | str = AUTO_THREADS
    max_batch_slots: int = 16
    sglang_url: str = ""
    sglang_launch: str = "sglang"
    sglang_mem_fraction: float = 0.7
    sglang_colocated: bool = False
    sglang_startup_timeout_s: float = 600.0
    sglang_request_timeout_s: float = 600.0
    sglang_max_retries: int = 8
    on_failed_group: str = "fail"
    resources: dict[str, float] = field(default_factory=dict)
    health_timeout_s: float = 60.0
    max_replicas: int = 16
    min_replicas: int = 1
    autoscale: bool = False
    autoscale_wait_share: float = 0.3
    autoscale_period_s: float = 30.0
    max_restarts: int = 3
    fault_injection: list[str] = field(default_factory=list)

    def __post_init__(self):
        from rollers.faults import FaultSpec

        check_ray_resources("rollers.resources", self.resources)
        for spec in self.fault_injection:
            FaultSpec.parse(spec)  # ValueError naming rollers.fault_injection and the accepted form
        if not math.isfinite(self.health_timeout_s) or self.health_timeout_s <= 0:
            raise ValueError(f"rollers.health_timeout_s must be a finite number of seconds > 0, "
                             f"got {self.health_timeout_s}")
        if not 1 <= self.min_replicas <= self.num_replicas:
            raise ValueError(f"rollers.min_replicas={self.min_replicas} must be in 1 .. rollers.num_replicas="
                             f"{self.num_replicas}")
        if not 0 < self.autoscale_wait_share <= 1:
            raise ValueError(f"rollers.autoscale_wait_share must be in (0, 1], got {self.autoscale_wait_share}")
        if not math.isfinite(self.autoscale_period_s) or self.autoscale_period_s <= 0:
            raise ValueError(f"rollers.autoscale_period_s must be a finite number of seconds > 0, "
                             f"got {self.autoscale_period_s}")
        if self.max_replicas < self.num_replicas:
            raise ValueError(f"rollers.max_replicas={self.max_replicas} is below rollers.num_replicas="
                             f"{self.num_replicas}")
        if self.max_restarts < 0:
            raise ValueError(f"rollers.max_restarts must be >= 0, got {self.max_restarts}")
        if self.on_failed_group not in ("fail", "skip"):
            raise ValueError(f"rollers.on_failed_group={self.on_failed_group!r} is not one of ['fail', 'skip']")
        if self.num_replicas < 1:
            raise ValueError(f"rollers.num_replicas must be >= 1, got {self.num_replicas}")
        if self.engine not in ENGINES:
            raise ValueError(f"rollers.engine={self.engine!r} is not one of {list(ENGINES)}")
        check_num_threads("rollers.num_threads", self.num_threads)
        if self.max_batch_slots < 1:
            raise ValueError(f"rollers.max_batch_slots must be >= 1, got {self.max_batch_slots}")
        if self.sglang_launch not in SGLANG_LAUNCH:
            raise ValueError(f"rollers.sglang_launch={self.sglang_launch!r} is not one of {list(SGLANG_LAUNCH)}")
        if not 0 < self.sglang_mem_fraction <= 1:
            raise ValueError(f"rollers.sglang_mem_fraction must be in (0, 1], got {self.sglang_mem_fraction}")
        for key in ("sglang_startup_timeout_s", "sglang_request_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"rollers.{key} must be > 0 seconds, got {getattr(self, key)}")
        if self.sglang_max_retries < 0:
            raise ValueError(f"rollers.sglang_max_retries must be >= 0, got {self.sglang_max_retries}")
        if self.sglang_url and not self.sglang_url.startswith(("http://", "https://")):
            raise ValueError(f"rollers.sglang_url={self.sglang_url!r} must start with http:// or https://")
