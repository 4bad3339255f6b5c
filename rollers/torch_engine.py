"""The built-in torch generation engine: continuous batching over a fixed number of slots.

One background asyncio task (owned by the engine, cancelled and joined by ``shutdown``) runs the
schedule below; requests are submitted from any coroutine on the same event loop. Each step runs
synchronously between two ``await`` points, so ``pause``/``load_weights``/``flush_cache`` always see
the engine between steps, never inside one.

::

    submit ──> waiting (FIFO) ──admit while slots are free──> running (slots 0 .. batch-1)
                                   │ prefill newcomers (one batched forward; identical prompts once)
                                   ▼
               every step: one decode forward over ALL running slots ──> sample ──> stop? leave at once

Sequences keep their keys/values at their absolute positions in a per-slot cache
(``rollers.kv_cache.SlotKVCache``), so positions and masks of a sequence never depend on the slot's
history or its neighbours (``rollers.slot_forward`` builds the forwards); greedy output equals Hugging Face
``generate`` token for token.

Decoding a small model on CPU is bound by reading the weights, so one forward for every running slot
per step is what makes it fast; slots freed by short requests are refilled at the next step. For the same
reason the model's linear layers multiply decode steps' few rows by prepacked weights
(``rollers.packed_linear``: each weight read once per step instead of about twice).

**Prefix reuse** (``rollers.slot_prefixes``, what SGLang's radix cache gives multi-turn rollouts): a
finished request leaves its keys/values in its slot, which is free again; a newcomer that continues it takes
that slot and prefills only its new tokens. A weight load or ``flush_cache`` drops every prefix.

Requests are checked against the model when submitted (``check_request``: token and stop ids inside the
vocabulary, ``top_k`` at most the vocabulary, a prompt shorter than ``max_seq_len``); a response that
reaches ``max_seq_len`` ends with ``finish_reason="length"``, like one that reaches ``max_new_tokens``.
A request that fails while decoding (its row cannot be sampled) fails alone with ``RequestError``; only a
failed forward, which no request parameter can cause, fails every request and the engine (``health``).

Limits: the model's attention must go through transformers' ``Cache.update`` with a 4-D additive mask
(Llama, Qwen2/3, Mistral, Gemma-style attention). The per-slot mask is full causal, so a model with a
sliding window gets ``max_seq_len`` capped at the window (where both agree) with a warning; chunked,
linear or recurrent layers (``config.layer_types``) are refused at construction with ValueError. Newcomers
admitted together are right-padded to the longest of them, so one very long prompt makes that prefill forward
wider for the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import torch

from rollers.engine import (
    PAUSE_MODES,
    Engine,
    EngineError,
    GenerationOutput,
    GenerationRequest,
    RequestError,
)
from rollers.kv_cache import SlotKVCache
from rollers.model_limits import (
    attention_window,
    check_request_fits,
    collect_eos_ids,
    position_limit,
    staged_weights,
)
from rollers.packed_linear import pack_linears
from rollers.sampling import RowSampling, sample_rows
from rollers.slot_forward import SlotForward
from rollers.slot_prefixes import SlotPrefixes

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Sequence:
    """Engine-side state of one request. ``kv_len``: positions of ``tokens`` held in its slot's cache;
    ``max_new_tokens``: the request's own, capped at the room the context length leaves."""

    request: GenerationRequest
    output: GenerationOutput
    sampling: RowSampling
    stop_ids: frozenset[int]
    done: asyncio.Future
    max_new_tokens: int
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    kv_len: int = 0

    def tokens(self) -> list[int]:
        return [*self.request.input_ids, *self.output.output_ids]


def own_weights(model: torch.nn.Module) -> None:
    """Move every CPU parameter of ``model`` into memory of this process's own (a copy; the ``Parameter``
    objects stay, so ties and references hold).

    Why: Hugging Face loads safetensors weights as a private mapping of the file. The engine overwrites its
    weights at every update, and the first ``load_weights`` then copies each page on write, reading it back
    from the file wherever the kernel has dropped it from the page cache meanwhile: a roller's first weight
    sync of SmolLM2-135M took ~1.9 s more than the next ones for that. The copy costs ~0.25 s at start-up.
    """
    with torch.no_grad():
        for param in model.parameters():
            if param.device.type == "cpu":
                param.data = param.data.clone()


class TorchEngine(Engine):
    """Continuous-batching generation on any Hugging Face causal LM (CPU fp32, or one GPU).

    ``model``: the causal LM, already on its device (it is put in eval mode, its CPU parameters get memory of
    their own (:func:`own_weights`), and its ``nn.Linear`` layers become ``rollers.packed_linear.PackedLinear``
    sharing their parameters: prepacked weights for decode steps on CPU; generation runs under ``torch.no_grad``,
    never ``inference_mode``, so its parameters stay usable for training code, where those layers are plain
    ``nn.Linear``).
    ``tokenizer_or_eos_ids``: a tokenizer or EOS id(s), added to the model's own EOS ids.
    ``max_batch_slots``: sequences decoded together. ``max_seq_len``: prompt + response limit in tokens
    (default: the model's ``max_position_embeddings``). ``weight_version``: version of the initial
    weights. ``seed``: seeds the per-request generators of requests without ``SamplingParams.seed``.
    ``busy_flag``: a ``common.core_lending.BusyFlag``, set while requests are in flight and unpaused (the
    trainer takes this process's cores otherwise); closed at shutdown. Raises ValueError for bad sizes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer_or_eos_ids,
        *,
        max_batch_slots: int = 16,
        max_seq_len: int | None = None,
        weight_version: int = 0,
        seed: int = 0,
        initial_kv_capacity: int = 128,
        busy_flag=None,
    ):
        if max_batch_slots < 1:
            raise ValueError(f"max_batch_slots must be >= 1, got {max_batch_slots}")
        window = attention_window(model.config)
        self._model = model.eval()
        own_weights(model)
        pack_linears(model)
        self._device = next(model.parameters()).device
        self._eos_ids = collect_eos_ids(model, tokenizer_or_eos_ids)
        self._vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._max_seq_len = int(max_seq_len or position_limit(model.config))
        if window is not None and self._max_seq_len > window:
            logger.warning("max_seq_len %d capped at the model's sliding window (%d tokens)", self._max_seq_len, window)
            self._max_seq_len = window
        if self._max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self._max_seq_len}")
        self._num_slots = max_batch_slots
        self._cache = SlotKVCache(max_batch_slots, min(initial_kv_capacity, self._max_seq_len), self._max_seq_len)
        self._weight_version = weight_version
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._running: list[_Sequence] = []
        self._waiting: deque[_Sequence] = deque()
        self._by_id: dict[str, _Sequence] = {}
        self._paused, self._pause_mode = False, None
        self._closed = False
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._started_at = time.perf_counter()
        self._busy_s = 0.0
        self._num_tokens_generated = 0
        self._forwards = SlotForward(model, self._cache, self._device)
        self._prefixes = SlotPrefixes(self._cache, max_batch_slots)
        self._busy_flag = busy_flag

    # ------------------------------------------------------------------------------ public API

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def vocab_size(self) -> int:
        """Rows of the model's output embedding: token ids are in ``[0, vocab_size)``."""
        return self._vocab_size

    @property
    def max_seq_len(self) -> int:
        """The prompt + response limit in tokens (the context length this engine serves)."""
        return self._max_seq_len

    @property
    def eos_ids(self) -> frozenset[int]:
        """The token ids that end a request (unless ``ignore_eos``)."""
        return self._eos_ids

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        """Run ``request`` to completion; cancelling the caller aborts the request. Raises ValueError for a
        request the engine cannot hold (``check_request``), RequestError (a ValueError) for one that failed
        while decoding, EngineError when the engine is shut down or failed."""
        seq = self._submit(request)
        try:
            return await seq.done
        except asyncio.CancelledError:
            self._drop(seq)
            raise

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Yield snapshots of the growing output (several tokens may arrive between two snapshots); the
        last has ``finish_reason`` set. Closing the iterator early aborts the request."""
        seq = self._submit(request)
        try:
            while True:
                await seq.changed.wait()
                seq.changed.clear()
                if seq.done.done() and seq.done.exception() is not None:
                    raise seq.done.exception()
                snapshot = _snapshot(seq.output)
                yield snapshot
                if snapshot.finish_reason is not None:
                    return
        finally:
            if not seq.done.done():
                self._drop(seq)

    async def pause(self, mode: str = "retract") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {list(PAUSE_MODES)}")
        self._check_usable()
        self._paused, self._pause_mode = True, mode
        if mode == "abort":
            for seq in [*self._running, *self._waiting]:
                self._finish(seq, "abort")
            self._running.clear()
            self._waiting.clear()
        elif mode == "retract":
            for seq in reversed(self._running):
                seq.kv_len = 0
                self._waiting.appendleft(seq)
            self._running.clear()

    async def resume(self) -> None:
        self._check_usable()
        self._paused, self._pause_mode = False, None
        self._wakeup.set()

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        """Copy ``named_tensors`` into the parameters (dtype/device cast) and commit ``weight_version``.

        Names are the model's ``state_dict`` keys; either name of a tied pair (``lm_head.weight`` /
        ``model.embed_tokens.weight``) updates the shared tensor. Every tensor is checked before any is
        copied. Raises EngineError unless paused, KeyError for an unknown name, ValueError for a shape
        mismatch or a ``weight_version`` that does not increase. The cached prefixes of finished requests
        (the module docstring) are dropped, their keys/values being the old weights', except under an
        ``in_place`` pause, which keeps every key/value as it is: the running requests' and these alike.
        """
        self._check_usable()
        if not self._paused:
            raise EngineError("load_weights needs a paused engine: call pause() first")
        if weight_version <= self._weight_version:
            raise ValueError(
                f"weight_version must increase: got {weight_version}, engine has {self._weight_version}"
            )
        staged = staged_weights(self._model, named_tensors)
        with torch.no_grad():
            for target, tensor in staged:
                target.copy_(tensor)
        self._weight_version = weight_version
        if self._pause_mode != "in_place":
            self._prefixes.clear()

    async def flush_cache(self) -> None:
        """Free the KV cache. Raises EngineError while any request holds KV: decoding, or kept by an
        ``in_place`` pause. Queued requests and those kept by a ``retract`` pause hold none (they are
        prefilled again on admission), so the pause(retract) → load_weights → flush → resume cycle works."""
        self._check_usable()
        if self._running:
            raise EngineError(f"flush_cache while {len(self._running)} requests hold KV cache (running or "
                              "paused in place)")
        self._cache.clear()
        self._prefixes.clear()

    async def health(self) -> bool:
        return not self._closed and self._error is None and not (self._task is not None and self._task.done())

    async def shutdown(self) -> None:
        """Abort every request, cancel and join the decode task. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for seq in [*self._running, *self._waiting]:
            self._finish(seq, "abort")
        self._running.clear()
        self._waiting.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._cache.clear()
        self._prefixes.clear()
        if self._busy_flag is not None:
            self._busy_flag.close()

    def stats(self) -> dict[str, float]:
        """Counters: ``num_tokens_generated``, ``tokens_per_s`` (over busy time), ``busy_s``, ``uptime_s``,
        ``busy_ratio``, ``num_running``, ``num_waiting``, ``num_requests_in_flight``, ``num_forwards``,
        ``num_prefill_tokens`` (token positions the prefill forwards computed, padding included; identical
        prompts admitted together count once), ``num_reused_tokens`` (prompt positions taken from a finished
        request's slot instead, see the module docstring), ``num_cached_prefixes`` (free slots holding one),
        ``weight_version``, ``kv_capacity_tokens`` (per slot)."""
        uptime = time.perf_counter() - self._started_at
        return {
            "num_tokens_generated": self._num_tokens_generated,
            "tokens_per_s": self._num_tokens_generated / self._busy_s if self._busy_s else 0.0,
            "busy_s": self._busy_s,
            "uptime_s": uptime,
            "busy_ratio": self._busy_s / uptime if uptime else 0.0,
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "num_requests_in_flight": len(self._running) + len(self._waiting),
            "num_forwards": self._forwards.num_forwards,
            "num_prefill_tokens": self._forwards.num_prefill_tokens,
            "num_reused_tokens": self._forwards.num_reused_tokens,
            "num_cached_prefixes": self._prefixes.num_cached,
            "weight_version": self._weight_version,
            "kv_capacity_tokens": self._cache.capacity,
        }

    # ------------------------------------------------------------------------------ requests

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineError("the engine is shut down")
        if self._error is not None:
            raise EngineError(f"the engine failed: {self._error!r}")

    def _submit(self, request: GenerationRequest) -> _Sequence:
        self._check_usable()
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        self.check_request(request)
        sampling = request.sampling
        seed = sampling.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng).item())
        generator = torch.Generator(device=self._device).manual_seed(seed)
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self._eos_ids)
        seq = _Sequence(
            request=request,
            output=GenerationOutput(request_id=request.request_id, prompt_tokens=len(request.input_ids)),
            sampling=RowSampling(sampling.temperature, sampling.top_p, sampling.top_k, generator),
            stop_ids=stop_ids,
            done=asyncio.get_running_loop().create_future(),
            max_new_tokens=min(sampling.max_new_tokens, self._max_seq_len - len(request.input_ids)),
        )
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        self._ensure_task()
        self._wakeup.set()
        return seq

    def check_request(self, request: GenerationRequest) -> None:
        """Raise ValueError naming the field unless ``request`` fits this model: token ids and stop ids in
        ``[0, vocab_size)``, ``top_k`` at most ``vocab_size``, and a prompt shorter than ``max_seq_len`` (at
        least one token of room). ``max_new_tokens`` beyond the room is not an error: the response ends
        with ``finish_reason="length"`` when prompt + response reach ``max_seq_len``."""
        check_request_fits(request, self._vocab_size, self._max_seq_len)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        seq.output.finish_reason = reason
        self._by_id.pop(seq.request.request_id, None)
        if not seq.done.done():
            seq.done.set_result(seq.output)
        seq.changed.set()

    def _reject(self, seq: _Sequence, exc: Exception) -> None:
        """Fail one request (it is no longer running or waiting) with ``RequestError``."""
        self._by_id.pop(seq.request.request_id, None)
        if not seq.done.done():
            seq.done.set_exception(RequestError(f"request {seq.request.request_id!r} failed: {exc}"))
        seq.changed.set()

    def _drop(self, seq: _Sequence) -> None:
        """Abort one request whose caller went away (cancelled ``generate``, closed ``stream``)."""
        if seq in self._waiting:
            self._waiting.remove(seq)
        elif seq in self._running:
            self._release([self._running.index(seq)])
        self._finish(seq, "abort")

    def _release(self, indices: list[int]) -> None:
        """Remove running slots ``indices``; the last running slot moves into each hole (KV included) and the
        removed sequence's keys/values stay, as a reusable prefix, in the slot it frees."""
        for i in sorted(indices, reverse=True):
            last = len(self._running) - 1
            leaving = self._running[i]
            if i != last:
                moved = self._running[last]
                self._cache.swap(i, last, max(leaving.kv_len, moved.kv_len))
                self._running[i] = moved
            self._running.pop()
            if leaving.kv_len > 0:
                self._prefixes.keep(last, tuple(leaving.tokens()[: leaving.kv_len]))

    # ------------------------------------------------------------------------------ decode loop

    def _ensure_task(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="torch-engine-decode")

    async def _loop(self) -> None:
        while True:
            if self._paused or not (self._running or self._waiting):
                if self._busy_flag is not None:
                    self._busy_flag.set(False)
                self._wakeup.clear()
                await self._wakeup.wait()
                # One more turn of the loop before a step: callbacks the waker's own completion scheduled run
                # first. A weight update's reply to the controller is one: it would otherwise wait behind the
                # re-prefill its resume() starts (its Ray future completes in a callback after this task's wakeup).
                await asyncio.sleep(0)
                continue
            if self._busy_flag is not None:
                self._busy_flag.set(True)
            started = time.perf_counter()
            try:
                with torch.no_grad():
                    self._step()
            except Exception as exc:  # a failed forward (not a request's doing) fails every request
                logger.exception("torch engine step failed")
                self._fail(exc)
                return
            self._busy_s += time.perf_counter() - started
            await asyncio.sleep(0)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        for seq in self._by_id.values():  # every unfinished request, wherever the step left it
            if not seq.done.done():
                seq.done.set_exception(EngineError(f"engine step failed: {exc!r}"))
            seq.changed.set()
        self._by_id.clear()
        self._running.clear()
        self._waiting.clear()
        self._prefixes.clear()

    def _step(self) -> None:
        self._admit()
        if self._running:
            self._decode()

    def _admit(self) -> None:
        """Prefill waiting sequences into free slots and sample their next token.

        Newcomers with identical token ids (the ``rollout.n`` samples of one prompt group) are prefilled
        once: one right-padded forward over the distinct ones, whose keys/values are then copied into the
        duplicates' slots; every sequence samples its first token from the shared logits with its own
        generator, exactly as if it had been prefilled alone.
        """
        num_new = min(self._num_slots - len(self._running), len(self._waiting))
        if num_new <= 0:
            return
        distinct: dict[tuple[int, ...], int] = {}  # token ids -> row of the prefill forward
        firsts, duplicates, source = [], [], []
        for seq in (self._waiting.popleft() for _ in range(num_new)):
            key = tuple(seq.tokens())
            if key in distinct:
                duplicates.append(seq)
                source.append(distinct[key])
            else:
                distinct[key] = len(firsts)
                firsts.append(seq)
        # Slots: the first sequence of each distinct prompt (prefilled), then the duplicates (copied).
        admitted, rows = firsts + duplicates, [*range(len(firsts)), *source]  # rows: prefill row of each
        first = len(self._running)
        keys = list(distinct)
        logits = self._forwards.prefill(first, keys, self._prefixes.place(first, keys, num_new))
        lengths = [len(key) for key in keys]
        if duplicates:
            self._cache.copy_rows([first + row for row in source], list(range(first + len(firsts), first + num_new)),
                                  max(lengths[row] for row in source))
            logits = logits[torch.tensor(rows, device=self._device)]
        self._running.extend(admitted)
        for seq, row in zip(admitted, rows, strict=True):
            seq.kv_len = lengths[row]
        self._append_tokens(first, logits)

    def _decode(self) -> None:
        """One forward over every running slot: feed each slot's last token at its own position."""
        logits = self._forwards.decode([seq.output.output_ids[-1] for seq in self._running],
                                       [seq.kv_len for seq in self._running])
        for seq in self._running:
            seq.kv_len += 1
        self._append_tokens(0, logits)

    def _append_tokens(self, first: int, logits: torch.Tensor) -> None:
        """Sample one token for running slots ``first ..`` from ``logits`` (rows, vocab); finish stopped ones.
        A row that cannot be sampled fails its own request (``RequestError``); the others go on."""
        seqs = self._running[first:]
        sampled, errors = sample_rows(logits, [seq.sampling for seq in seqs])
        finished: list[tuple[int, str | Exception]] = [(first + i, exc) for i, exc in errors.items()]
        for offset, (token, log_prob) in sampled.items():
            seq = seqs[offset]
            out = seq.output
            out.output_ids.append(token)
            out.output_log_probs.append(log_prob)
            out.weight_versions.append(self._weight_version)
            self._num_tokens_generated += 1
            seq.changed.set()
            if token in seq.stop_ids:
                finished.append((first + offset, "stop"))
            elif len(out.output_ids) >= seq.max_new_tokens:
                finished.append((first + offset, "length"))
        done = [(self._running[i], reason) for i, reason in finished]
        self._release([i for i, _ in finished])
        for seq, reason in done:
            if isinstance(reason, Exception):
                self._reject(seq, reason)
            else:
                self._finish(seq, reason)


def _snapshot(output: GenerationOutput) -> GenerationOutput:
    return GenerationOutput(
        request_id=output.request_id,
        output_ids=list(output.output_ids),
        output_log_probs=list(output.output_log_probs),
        weight_versions=list(output.weight_versions),
        finish_reason=output.finish_reason,
        prompt_tokens=output.prompt_tokens,
    )
