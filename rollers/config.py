"""Config sections owned by the rollers: ``rollout`` (sampling) and ``rollers`` (the pool)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.env import AUTO_THREADS, check_num_threads, check_ray_resources
from common.settings import check_settings, setting
from rollers.engine import check_sampling

ENGINES = ("torch", "sglang")
SGLANG_LAUNCH = ("sglang", "torch")
ON_FAILED_GROUP = ("fail", "skip")


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

    n: int = setting(4, ge=1, doc="samples generated per prompt (the GRPO group size)")
    temperature: float = setting(1.0, doc="sampling temperature (> 0)")
    top_p: float = setting(1.0, doc="nucleus sampling threshold in (0, 1]; 1 = off")
    top_k: int = setting(-1, doc="sample among the k most likely tokens; -1 = off")
    max_response_length: int = setting(
        32, ge=1, doc="longest response in tokens; a longer one is cut (finish_reason=length)")
    seed: int = setting(
        0, doc="base of the per-sample seeds (responses do not depend on batching or schedule)")
    reward: str = setting(
        "auto", doc="auto (data.task's reward) | reasoning_gym | tiny_repeat | math_verify | module:function")
    reward_timeout_s: float = setting(
        30.0, gt=0, doc="seconds one reward call may take before its group is marked failed")
    reward_max_concurrency: int = setting(8, ge=1, doc="reward calls one roller runs at once")
    max_resubmits: int = setting(
        16, ge=0, doc="times one sample may be paused (abort mode) and resumed before it fails")
    forced_response_lengths: list[list[int]] = setting(
        factory=list, doc="benchmarks: [[weight, min, max], ...] forced lengths, EOS ignored; [] = off")
    environment: str = setting(
        "", doc="multi-turn: a registered environment (calculator | module:name); empty = single-turn")
    max_turns: int = setting(4, ge=1, doc="multi-turn: most model turns in one trajectory")
    env_timeout_s: float = setting(
        30.0, gt=0, doc="multi-turn: limit of one environment or tool call (seconds)")
    env_kwargs: dict[str, Any] = setting(
        factory=dict, doc="multi-turn: options of the environment (the keys it declares, e.g. gem's env_id)")

    def __post_init__(self):
        check_settings(self, "rollout")
        self._check_environment()
        if not self.reward:
            raise ValueError("rollout.reward must be auto | reasoning_gym | tiny_repeat | math_verify | module:function")
        check_sampling(self.temperature, self.top_p, self.top_k, prefix="rollout.")
        self._check_forced_lengths()

    def _check_environment(self) -> None:
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

    num_replicas: int = setting(1, ge=1, doc="roller processes generating in parallel")
    engine: str = setting(
        "torch", choices=ENGINES,
        doc="generation engine: torch (in-process) or sglang (client of an SGLang server)")
    num_threads: int | str = setting(AUTO_THREADS, doc="torch threads per roller process")
    max_batch_slots: int = setting(
        16, ge=1, doc="sequences decoded at once by the torch engine (continuous batching)")
    sglang_url: str = setting("", doc="an SGLang server to use instead of launching one (sglang engine only)")
    sglang_launch: str = setting(
        "sglang", choices=SGLANG_LAUNCH,
        doc="what a launched server runs: sglang (needs a GPU) or torch (our engine, SGLang's API)")
    sglang_mem_fraction: float = setting(
        0.7, gt=0, le=1, doc="SGLang's --mem-fraction-static for a launched server")
    sglang_colocated: bool = setting(
        False, doc="the trainer shares the launched server's GPU (adds --enable-memory-saver)")
    sglang_startup_timeout_s: float = setting(
        600.0, gt=0, doc="seconds to wait for a launched server's /health")
    sglang_request_timeout_s: float = setting(600.0, gt=0, doc="seconds one /generate request may take")
    sglang_max_retries: int = setting(
        8, ge=0, doc="/flush_cache retries (exponential backoff) during a weight update")
    on_failed_group: str = setting(
        "fail", choices=ON_FAILED_GROUP,
        doc="a failed group: fail stops the run; skip trains on (fully-async "
            "admits a fresh prompt instead)")
    resources: dict[str, float] = setting(
        factory=dict,
        doc="Ray custom resources each roller asks for, e.g. {hflow_roller: 1}: "
            "places the pool")
    health_timeout_s: float = setting(
        60.0, gt=0,
        doc="seconds a roller may leave a health check or weight update "
            "unanswered; then it is replaced")
    max_replicas: int = setting(16, doc="the most rollers a scale request (hflow-async scale) may ask for")
    min_replicas: int = setting(1, ge=1, doc="the fewest rollers the autoscaler keeps")
    autoscale: bool = setting(
        False, doc="resize the pool on RL signals (trainer starved: add; staleness cap: remove)")
    autoscale_wait_share: float = setting(
        0.3, gt=0, le=1, doc="autoscale: share of time the trainer waits for data that adds a roller")
    autoscale_period_s: float = setting(
        30.0, gt=0, doc="autoscale: seconds between decisions (the window its signals average)")
    max_restarts: int = setting(
        3, ge=0, doc="replacements of lost rollers over the run; past it the pool shrinks")
    fault_injection: list[str] = setting(
        factory=list,
        doc="tests: ROLLER:FAULT:TRIGGER=N[:SECONDS] (kill|hang|slow, "
            "group|weight_sync); [] = off")

    def __post_init__(self):
        from rollers.faults import FaultSpec

        check_settings(self, "rollers")
        check_ray_resources("rollers.resources", self.resources)
        for spec in self.fault_injection:
            FaultSpec.parse(spec)  # ValueError naming rollers.fault_injection and the accepted form
        if self.min_replicas > self.num_replicas:
            raise ValueError(f"rollers.min_replicas={self.min_replicas} must be in 1 .. rollers.num_replicas="
                             f"{self.num_replicas}")
        if self.max_replicas < self.num_replicas:
            raise ValueError(f"rollers.max_replicas={self.max_replicas} is below rollers.num_replicas="
                             f"{self.num_replicas}")
        check_num_threads("rollers.num_threads", self.num_threads)
        if self.sglang_url and not self.sglang_url.startswith(("http://", "https://")):
            raise ValueError(f"rollers.sglang_url={self.sglang_url!r} must start with http:// or https://")
