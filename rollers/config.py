"""Config sections owned by the rollers: ``rollout`` (sampling) and ``rollers`` (the pool)."""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("torch", "sglang")


@dataclass
class RolloutConfig:
    """Sampling. Lengths in tokens.

    ``n``: samples per prompt (``rollout.n``); ``top_k`` -1 disables it; ``seed`` is the base of the
    per-sample seeds (sampling is independent of batch composition).
    """

    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_length: int = 32
    seed: int = 0

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_response_length < 1:
            raise ValueError(f"rollout.max_response_length must be >= 1, got {self.max_response_length}")


@dataclass
class RollersConfig:
    """The roller pool. ``engine``: torch (in-process) | sglang (HTTP client of an SGLang server).

    ``max_batch_slots``: concurrent sequences in the torch engine's continuous batch;
    ``num_threads``: torch threads per roller process; ``sglang_url``: connect to this server instead of
    launching one (sglang engine only).
    """

    num_replicas: int = 1
    engine: str = "torch"
    num_threads: int = 1
    max_batch_slots: int = 16
    sglang_url: str = ""

    def __post_init__(self):
        if self.num_replicas < 1:
            raise ValueError(f"rollers.num_replicas must be >= 1, got {self.num_replicas}")
        if self.engine not in ENGINES:
            raise ValueError(f"rollers.engine={self.engine!r} is not one of {list(ENGINES)}")
        if self.num_threads < 1:
            raise ValueError(f"rollers.num_threads must be >= 1, got {self.num_threads}")
        if self.max_batch_slots < 1:
            raise ValueError(f"rollers.max_batch_slots must be >= 1, got {self.max_batch_slots}")
