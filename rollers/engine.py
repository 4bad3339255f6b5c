"""The generation-engine interface shared by the torch engine and the SGLang client.

An engine takes requests of prompt token ids plus sampling parameters and returns the sampled tokens,
their log-probabilities and the weight version that produced each token. It can be paused (for a
weight update), loaded with new weights, flushed and resumed. Pause modes follow SGLang's
``/pause_generation``:

* ``abort``: in-flight requests finish now with ``finish_reason="abort"`` and the tokens generated so
  far (the caller may resubmit prompt + partial output to continue: partial rollout);
* ``retract``: in-flight requests are kept, their KV cache dropped and recomputed on resume (under the
  new weights, if an update happened meanwhile);
* ``in_place``: in-flight requests are kept with their KV cache as it is, and an update neither flushes nor
  drops cached prefixes: tokens sampled after it attend to keys/values of the old weights (their log-probs
  are still those they were sampled with), and nothing is recomputed (``retract`` re-prefills every
  in-flight request and, in the torch engine, every cached turn of an agent loop's trajectories).
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import torch

PAUSE_MODES = ("abort", "retract", "in_place")


SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


def check_sampling(temperature: float, top_p: float, top_k: int, prefix: str = "") -> None:
    """Raise ValueError (naming ``prefix`` + the key) unless temperature is finite and >= 0, top_p is in
    (0, 1] and top_k is -1 (off) or >= 1. A NaN or infinite value is refused, never read as greedy."""
    if not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{prefix}temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not (_is_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"{prefix}top_p must be a number in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or top_k == 0 or top_k < -1:
        raise ValueError(f"{prefix}top_k must be an integer, -1 (off) or >= 1, got {top_k!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for one request. ``temperature`` 0 = greedy; ``top_k`` -1 = off; ``seed`` makes the
    request's samples independent of what else is batched with it (``None`` = engine's own RNG);
    ``stop_token_ids`` are added to the model's EOS ids; ``ignore_eos`` decodes to ``max_new_tokens``."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        check_sampling(self.temperature, self.top_p, self.top_k)
        if self.seed is not None and not (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {list(self.stop_token_ids)[:8]}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt. ``input_ids``: prompt token ids (no padding)."""

    request_id: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams

    def __post_init__(self):
        if not self.input_ids:
            raise ValueError(f"request {self.request_id!r}: input_ids is empty")
        if not all(_is_int(t) for t in self.input_ids):
            raise ValueError(f"request {self.request_id!r}: input_ids must be integers")


@dataclass
class GenerationOutput:
    """The result (or, when streaming, the progress so far) of one request.

    ``output_ids`` (response_len,), ``output_log_probs`` natural-log probability of each sampled token
    under the sampling distribution (logits / temperature; raw logits when greedy),
    ``weight_versions`` the weight version that produced each token, ``finish_reason`` one of
    ``stop`` | ``length`` | ``abort`` (``None`` while running).
    """

    request_id: str
    output_ids: list[int] = field(default_factory=list)
    output_log_probs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0

    @property
    def min_weight_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    @property
    def max_weight_version(self) -> int | None:
        return max(self.weight_versions) if self.weight_versions else None


class EngineError(RuntimeError):
    """An engine failed a request or an operation (the message says which)."""


class RequestError(ValueError):
    """One request failed inside the engine (e.g. it could not be sampled); the engine keeps serving.
    A ValueError, like a request refused at submission: callers fail that request alone."""


class Engine(abc.ABC):
    """Async generation engine. All methods are coroutines and safe to call concurrently."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The committed weight version the engine is generating with."""

    @property
    def max_seq_len(self) -> int | None:
        """The prompt + response limit in tokens (the model's context length), None when unknown."""
        return None

    def check_request(self, request: GenerationRequest) -> None:  # noqa: B027 - a no-op by default, not abstract
        """Raise ValueError (naming the field) if this engine cannot serve ``request``: what only the model
        knows (vocabulary, context length). The default checks nothing; ``generate``/``stream`` check too."""

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        """Run ``request`` to completion (or abort) and return its output."""

    @abc.abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Yield the growing output of ``request``; the last item has ``finish_reason`` set."""

    @abc.abstractmethod
    async def pause(self, mode: str = "retract") -> None:
        """Stop decoding; ``mode`` in ``PAUSE_MODES`` says what happens to in-flight requests.
        Raises ValueError for another mode."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue decoding (kept requests continue; new requests are admitted again)."""

    @abc.abstractmethod
    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        """Copy named tensors (engine parameter names) into the model and commit ``weight_version``.

        Must be called while paused. Raises KeyError naming an unknown tensor, ValueError on a
        shape mismatch or a version that does not increase; on error the old weights/version stay."""

    @abc.abstractmethod
    async def flush_cache(self) -> None:
        """Drop cached prefixes. Raises EngineError while requests are running."""

    async def flush_cache_with_retry(self) -> None:
        """``flush_cache`` once requests an ``abort`` pause ended have drained: engines whose abort is
        asynchronous retry while refused (SGLang: ``SGLangEngine``). The default is one attempt (an engine
        whose abort ends its requests before ``pause`` returns). Raises EngineError when still refused."""
        await self.flush_cache()

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the engine can serve requests."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Release resources; cancel and join background tasks. Idempotent."""
