"""SGLang's native HTTP API as typed records: request bodies, response parsing, weight-update payloads.

Shared by ``rollers.sglang_server`` (our torch engine behind SGLang's endpoints) and
``rollers.sglang_engine`` (the client), so both sides spell every field the same way. Field names are
SGLang's (``sglang/srt/managers/io_struct.py``: ``GenerateReqInput``, ``PauseGenerationReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``, ...; sampling:
``sglang/srt/sampling/sampling_params.py``: ``SamplingParams``); ``tests/rollers/test_sglang_fields.py``
checks them against the real 0.5.x wheel.

Conventions at the boundary:

* ``weight_version`` is an ``int`` in our engines and a string in SGLang (``meta_info.weight_version``,
  ``/get_model_info``, request fields): ``str(v)`` going out, ``parse_weight_version`` coming in.
* ``meta_info.output_token_logprobs`` is a list of ``[logprob, token_id, text]`` (text ``None`` unless
  ``return_text_in_logprobs``); ``meta_info.weight_versions`` is SGLang's list of spans
  ``{version, start, end}`` over the output tokens (newer servers); ``meta_info.finish_reason`` is
  ``None`` while running or ``{"type": "stop" | "length" | "abort", ...}``.
* Streaming (``stream: true``) answers Server-Sent Events ``data: {...}`` lines and a final
  ``data: [DONE]``; by default each event carries the cumulative output (SGLang's default; its
  ``--incremental-streaming-output`` sends deltas, which ``parse_generate_output`` also accepts).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from checkpointengine.broadcast import WeightUpdateGroup
from common.dtypes import dtype_from_name, dtype_name
from rollers.engine import GenerationOutput, GenerationRequest, SamplingParams

logger = logging.getLogger(__name__)

# Fields of SGLang's GenerateReqInput / SamplingParams this project's server accepts (a subset of SGLang's).
GENERATE_FIELDS = (
    "rid", "input_ids", "sampling_params", "return_logprob", "stream", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "log_metrics",
)
SAMPLING_FIELDS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "sampling_seed", "stop_token_ids", "ignore_eos",
    "n", "min_new_tokens", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
)
# Fields our server accepts on the other endpoints (SGLang's names; BaseReq's ``rid`` included).
PAUSE_FIELDS = ("rid", "mode")
CONTINUE_FIELDS = ("rid", "torch_empty_cache")
BEGIN_UPDATE_FIELDS = ("rid", "selector")
END_UPDATE_FIELDS = ("rid",)
INIT_GROUP_FIELDS = ("rid", "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
DESTROY_GROUP_FIELDS = ("rid", "group_name")
UPDATE_DISTRIBUTED_FIELDS = (
    "rid", "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
    "load_format", "selector", "torch_empty_cache",
)
UPDATE_DISK_FIELDS = (
    "rid", "model_path", "load_format", "abort_all_requests", "weight_version", "torch_empty_cache",
    "flush_cache", "recapture_cuda_graph",
)  # torch_empty_cache / recapture_cuda_graph: CUDA-only, no effect here
SGLANG_DEFAULT_WEIGHT_VERSION = "default"  # what SGLang reports when launched without --weight-version
DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name
FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for one flat uint8 broadcast per call
FINISH_TYPES = ("stop", "length", "abort")


class SGLangAPIError(ValueError):
    """A request or response does not follow SGLang's HTTP API (the message names the field). Not the weight
    plane's ``checkpointengine.protocol.ProtocolError`` (a malformed weight-sync control message)."""


# ------------------------------------------------------------------------------------------- requests


def sampling_to_sglang(sampling: SamplingParams) -> dict[str, Any]:
    """SGLang ``sampling_params`` for ``sampling`` (``top_k`` -1 and ``temperature`` 0 mean the same)."""
    body: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "ignore_eos": sampling.ignore_eos,
    }
    if sampling.seed is not None:
        body["sampling_seed"] = sampling.seed
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    return body


def generate_body(request: GenerationRequest, stream: bool) -> dict[str, Any]:
    """The ``/generate`` JSON body for one request; log-probs of output tokens are always asked for."""
    return {
        "rid": request.request_id,
        "input_ids": list(request.input_ids),
        "sampling_params": sampling_to_sglang(request.sampling),
        "return_logprob": True,
        "stream": stream,
    }


def _typed(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    # bool is an int subclass in Python; JSON true is never a valid integer/float here.
    if isinstance(value, bool) and kind is not bool:
        raise SGLangAPIError(f"{where} must be {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise SGLangAPIError(f"{where} must be {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", bool: "a boolean", str: "a string",
                        list: "a list", dict: "an object"}.get(k, k.__name__) for k in kinds)


def _check_keys(body: dict, accepted: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(body) - set(accepted))
    if unknown:
        raise SGLangAPIError(
            f"{where}: unknown or unsupported field(s) {unknown}; this server accepts {list(accepted)}"
        )


def body_flag(body: dict, key: str, default: bool) -> bool:
    """``body[key]`` as a bool (absent or null: ``default``). Raises SGLangAPIError for another type (a
    string ``"false"`` must not read as true)."""
    value = body.get(key)
    return default if value is None else _typed(value, bool, key)


def body_group_name(body: dict) -> str:
    """``body["group_name"]`` (default ``DEFAULT_GROUP_NAME``). Raises SGLangAPIError unless a non-empty string."""
    name = body.get("group_name", DEFAULT_GROUP_NAME)
    if not isinstance(name, str) or not name:
        raise SGLangAPIError(f"group_name must be a non-empty string, got {name!r}")
    return name


def sampling_from_sglang(params: Any) -> SamplingParams:
    """Parse SGLang ``sampling_params`` into ``SamplingParams``. Raises SGLangAPIError naming the field."""
    params = {} if params is None else _typed(params, dict, "sampling_params")
    _check_keys(params, SAMPLING_FIELDS, "sampling_params")
    p = {k: v for k, v in params.items() if v is not None}  # SGLang treats null as "use the default"
    max_new_tokens = _typed(p.get("max_new_tokens", 128), int, "sampling_params.max_new_tokens")
    if max_new_tokens < 1:
        raise SGLangAPIError(f"sampling_params.max_new_tokens must be >= 1 here, got {max_new_tokens}")
    if _typed(p.get("n", 1), int, "sampling_params.n") != 1:
        raise SGLangAPIError(f"sampling_params.n must be 1 on this server (send n requests), got {p['n']}")
    if _typed(p.get("min_new_tokens", 0), int, "sampling_params.min_new_tokens") != 0:
        raise SGLangAPIError(f"sampling_params.min_new_tokens is not supported here, got {p['min_new_tokens']}")
    for key in ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        _typed(p.get(key, True), bool, f"sampling_params.{key}")  # text-only options: no effect on tokens
    stops = _typed(p.get("stop_token_ids", []), list, "sampling_params.stop_token_ids")
    for tok in stops:
        _typed(tok, int, "sampling_params.stop_token_ids[]")
    seed = p.get("sampling_seed")
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=float(_typed(p.get("temperature", 1.0), (int, float), "sampling_params.temperature")),
            top_p=float(_typed(p.get("top_p", 1.0), (int, float), "sampling_params.top_p")),
            top_k=_typed(p.get("top_k", -1), int, "sampling_params.top_k"),
            seed=None if seed is None else _typed(seed, int, "sampling_params.sampling_seed"),
            stop_token_ids=tuple(stops),
            ignore_eos=_typed(p.get("ignore_eos", False), bool, "sampling_params.ignore_eos"),
        )
    except ValueError as exc:
        if isinstance(exc, SGLangAPIError):
            raise
        raise SGLangAPIError(f"sampling_params: {exc}") from exc


@dataclass(frozen=True)
class ParsedGenerate:
    """A validated ``/generate`` body: the engine request plus the answer options."""

    request: GenerationRequest
    stream: bool
    return_logprob: bool
    return_text_in_logprobs: bool


def parse_generate_body(body: Any, vocab_size: int, default_rid: str,
                        max_input_len: int | None = None) -> ParsedGenerate:
    """Validate a ``/generate`` body (a single request of token ids). Raises SGLangAPIError naming the field.

    ``input_ids``: non-empty list of ints in ``[0, vocab_size)``, shorter than ``max_input_len`` when
    given (the context length: checked before any id); batches (a list of lists) and ``text`` are rejected
    (this server does not tokenize); ``logprob_start_len`` only ``-1`` (output tokens) and
    ``top_logprobs_num`` only 0 are supported.
    """
    body = _typed(body, dict, "request body")
    _check_keys(body, GENERATE_FIELDS, "/generate")
    input_ids = _typed(body.get("input_ids"), list, "input_ids")
    if not input_ids:
        raise SGLangAPIError("input_ids is empty")
    if max_input_len is not None and len(input_ids) >= max_input_len:
        raise SGLangAPIError(f"input_ids: {len(input_ids)} tokens leave no room for a response within the "
                            f"context length of {max_input_len} tokens")
    for tok in input_ids:
        if isinstance(tok, list):
            raise SGLangAPIError("input_ids: batch requests (a list of lists) are not supported here")
        if not 0 <= _typed(tok, int, "input_ids[]") < vocab_size:
            raise SGLangAPIError(f"input_ids: token id {tok} is outside the vocabulary [0, {vocab_size})")
    if body.get("logprob_start_len") not in (None, -1):
        raise SGLangAPIError(f"logprob_start_len must be -1 (output tokens only), got {body['logprob_start_len']!r}")
    if body.get("top_logprobs_num") not in (None, 0):
        raise SGLangAPIError(f"top_logprobs_num must be 0, got {body['top_logprobs_num']!r}")
    rid = body.get("rid")
    rid = default_rid if rid is None else _typed(rid, str, "rid")
    flags = {key: body_flag(body, key, False)
             for key in ("stream", "return_logprob", "return_text_in_logprobs", "log_metrics")}
    sampling = sampling_from_sglang(body.get("sampling_params"))
    return ParsedGenerate(
        request=GenerationRequest(request_id=rid, input_ids=tuple(input_ids), sampling=sampling),
        stream=flags["stream"],
        return_logprob=flags["return_logprob"],
        return_text_in_logprobs=flags["return_text_in_logprobs"],
    )


# ------------------------------------------------------------------------------------------ responses


def weight_version_spans(weight_versions: list[int]) -> list[dict[str, Any]]:
    """SGLang's ``meta_info.weight_versions``: runs of equal weight versions as ``{version, start, end}``."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(weight_versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def finish_reason_to_sglang(out: GenerationOutput) -> dict[str, Any] | None:
    if out.finish_reason is None:
        return None
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.output_ids[-1] if out.output_ids else None}
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    if out.finish_reason == "abort":
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    raise AssertionError(f"engine returned finish_reason {out.finish_reason!r}")


def output_to_sglang(
    out: GenerationOutput, current_version: int, return_logprob: bool, texts: list[str | None] | None = None,
    e2e_latency_s: float | None = None,
) -> dict[str, Any]:
    """The ``/generate`` answer (or one cumulative stream event) for ``out``.

    ``meta_info.weight_version`` is the version of the last output token (``current_version`` before
    the first token); ``texts`` (one per output token) fill the third item of each logprob triple.
    """
    last = out.weight_versions[-1] if out.weight_versions else current_version
    meta: dict[str, Any] = {
        "id": out.request_id,
        "finish_reason": finish_reason_to_sglang(out),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": str(last),
        "weight_versions": weight_version_spans(out.weight_versions),
    }
    if e2e_latency_s is not None:
        meta["e2e_latency"] = e2e_latency_s
    if return_logprob:
        texts = texts or [None] * len(out.output_ids)
        meta["output_token_logprobs"] = [
            [lp, tok, text] for lp, tok, text in zip(out.output_log_probs, out.output_ids, texts, strict=True)
        ]
    return {"output_ids": list(out.output_ids), "meta_info": meta}


def parse_weight_version(value: Any, where: str = "weight_version") -> int:
    """SGLang's string weight version as our int. SGLang's launch default ``"default"`` reads as 0 (with a
    warning: launch with ``--weight-version 0`` to avoid it). Raises SGLangAPIError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if value == SGLANG_DEFAULT_WEIGHT_VERSION:
        logger.warning("%s is SGLang's %r; reading it as 0", where, SGLANG_DEFAULT_WEIGHT_VERSION)
        return 0
    try:
        return int(_typed(value, str, where))
    except ValueError as exc:
        raise SGLangAPIError(f"{where} must be an integer string, got {value!r}") from exc


def _meta_versions(meta: dict, num_tokens: int, start: int, previous: list[int]) -> list[int]:
    """Per-token weight versions of the output: from spans when the server sends them, else the event's
    ``weight_version`` for the tokens new in this event (``start`` onwards)."""
    if "weight_versions" in meta:
        weight_versions = [0] * num_tokens
        for span in _typed(meta["weight_versions"], list, "meta_info.weight_versions"):
            v = parse_weight_version(span["version"], "meta_info.weight_versions[].version")
            for i in range(int(span["start"]), min(int(span["end"]), num_tokens)):
                weight_versions[i] = v
        return weight_versions
    weight_version = parse_weight_version(meta["weight_version"], "meta_info.weight_version")
    return previous[:start] + [weight_version] * (num_tokens - start)


def parse_generate_output(payload: Any, request_id: str, previous: GenerationOutput | None) -> GenerationOutput:
    """A ``GenerationOutput`` from one ``/generate`` answer or stream event.

    ``previous``: the output so far of the same request when streaming (``None`` otherwise). Accepts both
    cumulative events (SGLang's default) and deltas (``--incremental-streaming-output``), told apart by
    ``meta_info.completion_tokens``. Raises SGLangAPIError for a malformed answer.
    """
    payload = _typed(payload, dict, "/generate answer")
    if "error" in payload:
        raise SGLangAPIError(f"/generate answered an error: {payload['error']}")
    try:
        ids = [int(t) for t in _typed(payload["output_ids"], list, "output_ids")]
        meta = _typed(payload["meta_info"], dict, "meta_info")
        total = int(meta["completion_tokens"])
        logprob_items = [float(item[0]) for item in meta["output_token_logprobs"]]
        finish = meta["finish_reason"]
        prompt_tokens = int(meta["prompt_tokens"])
    except (KeyError, TypeError, IndexError) as exc:
        raise SGLangAPIError(f"/generate answer lacks or mistypes a field ({exc!r}): {str(payload)[:300]}") from exc
    prev = previous or GenerationOutput(request_id=request_id)
    if len(ids) == total:  # cumulative
        start, output_ids, log_probs = len(prev.output_ids), ids, logprob_items
    elif len(prev.output_ids) + len(ids) == total:  # incremental delta
        start = len(prev.output_ids)
        output_ids, log_probs = prev.output_ids + ids, prev.output_log_probs + logprob_items
    else:
        raise SGLangAPIError(
            f"/generate answer has {len(ids)} output_ids, {len(prev.output_ids)} seen before, but "
            f"meta_info.completion_tokens={total}"
        )
    if len(log_probs) != len(output_ids):
        raise SGLangAPIError(f"{len(log_probs)} output_token_logprobs for {len(output_ids)} output_ids")
    reason = None
    if finish is not None:
        reason = _typed(finish, dict, "meta_info.finish_reason").get("type")
        if reason not in FINISH_TYPES:
            raise SGLangAPIError(f"meta_info.finish_reason.type must be one of {FINISH_TYPES}, got {reason!r}")
    return GenerationOutput(
        request_id=request_id,
        output_ids=output_ids,
        output_log_probs=log_probs,
        weight_versions=_meta_versions(meta, len(output_ids), min(start, len(output_ids)), prev.weight_versions),
        finish_reason=reason,
        prompt_tokens=prompt_tokens,
    )


# ------------------------------------------------------------------------------- weight-update groups


def dtype_from_sglang(name: Any) -> torch.dtype:
    """``"bfloat16"`` (SGLang's spelling; ``"torch.bfloat16"`` also accepted) as a torch dtype."""
    try:
        return dtype_from_name(_typed(name, str, "dtypes[]"))
    except ValueError as exc:
        raise SGLangAPIError(f"dtypes: {name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16'): "
                             f"{exc}") from None


def dtype_to_sglang(dtype: torch.dtype) -> str:
    return dtype_name(dtype)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an ``/update_weights_from_distributed`` call: name, dtype, shape (SGLang's lists)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def parse_tensor_specs(names: Any, dtypes: Any, shapes: Any) -> list[TensorSpec]:
    """Zip SGLang's ``names``/``dtypes``/``shapes`` lists. Raises SGLangAPIError on mismatch or bad items."""
    names, dtypes, shapes = (_typed(v, list, k) for v, k in ((names, "names"), (dtypes, "dtypes"), (shapes, "shapes")))
    if not len(names) == len(dtypes) == len(shapes) or not names:
        raise SGLangAPIError(
            f"names, dtypes and shapes must be non-empty lists of one length, got {len(names)}, "
            f"{len(dtypes)}, {len(shapes)}"
        )
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dims = tuple(_typed(d, int, f"shapes[] of {name!r}") for d in _typed(shape, list, f"shape of {name!r}"))
        if any(d < 0 for d in dims):
            raise SGLangAPIError(f"shape of {name!r} has a negative dimension: {list(dims)}")
        specs.append(TensorSpec(_typed(name, str, "names[]"), dtype_from_sglang(dtype), dims))
    return specs


def _bucket_layout(specs: list[TensorSpec]) -> list[tuple[int, int]]:
    """Byte ranges of each tensor in SGLang's ``flattened_bucket`` (packed back to back, in order)."""
    ranges, offset = [], 0
    for spec in specs:
        if offset % spec.dtype.itemsize:
            raise SGLangAPIError(f"flattened bucket: {spec.name!r} would start unaligned at byte {offset}")
        size = math.prod(spec.shape) * spec.dtype.itemsize
        ranges.append((offset, offset + size))
        offset += size
    return ranges


def receive_weights(specs: list[TensorSpec], group: WeightUpdateGroup, load_format: str | None
                    ) -> list[tuple[str, torch.Tensor]]:
    """Receive one ``/update_weights_from_distributed`` call's tensors by broadcast from rank 0 of
    ``group`` (joined with ``checkpointengine.broadcast.init_weights_update_group``, SGLang's way).

    ``load_format`` ``None``: one ``broadcast`` per tensor, in order (SGLang's default);
    ``"flattened_bucket"``: one ``broadcast`` of a uint8 buffer holding every tensor back to back.
    Blocking (run it in a thread); raises RuntimeError from torch when a peer fails or times out.
    """
    if load_format == FLATTENED_BUCKET:
        ranges = _bucket_layout(specs)
        flat = torch.empty(ranges[-1][1], dtype=torch.uint8)
        torch.distributed.broadcast(flat, src=0, group=group.process_group)
        return [(s.name, flat[a:b].view(s.dtype).reshape(s.shape)) for s, (a, b) in zip(specs, ranges, strict=True)]
    if load_format is not None:
        raise SGLangAPIError(f"load_format must be null or {FLATTENED_BUCKET!r}, got {load_format!r}")
    received = []
    for spec in specs:
        tensor = torch.empty(spec.shape, dtype=spec.dtype)
        torch.distributed.broadcast(tensor, src=0, group=group.process_group)
        received.append((spec.name, tensor))
    return received


def send_weights(tensors: list[tuple[str, torch.Tensor]], group: WeightUpdateGroup, load_format: str | None
                 ) -> None:
    """The sender (rank 0 of ``group``, ``checkpointengine.broadcast.create_sender_group``) side of
    ``receive_weights``: the same broadcasts with the same layout."""
    if load_format == FLATTENED_BUCKET:
        specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors]
        ranges = _bucket_layout(specs)
        flat = torch.empty(ranges[-1][1], dtype=torch.uint8)
        for (_, tensor), (a, b) in zip(tensors, ranges, strict=True):
            flat[a:b].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
        torch.distributed.broadcast(flat, src=0, group=group.process_group)
        return
    for _, tensor in tensors:
        torch.distributed.broadcast(tensor.detach().contiguous(), src=0, group=group.process_group)
