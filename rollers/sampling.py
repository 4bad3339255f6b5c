"""Token sampling for the torch engine: temperature, top-k, top-p, per-request generators, log-probs.

Each row of a batch is sampled with its own ``torch.Generator`` and one uniform draw per token (inverse
CDF over the filtered, sorted distribution), so a request's samples depend only on its own seed and
logits, never on which other requests share the batch.

Log-probs follow the sample schema (``common/schema.py``): ``log_softmax(logits / T)`` of the sampled token over the
full vocabulary (top-k/top-p only restrict which tokens can be drawn; they do not renormalise the
reported log-prob), raw ``log_softmax(logits)`` when greedy (``T == 0``, or below ``GREEDY_BELOW``), in fp32.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowSampling:
    """Sampling settings of one batch row (from its request's ``SamplingParams``)."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator


GREEDY_BELOW = 1e-6  # a temperature below this samples greedily (SGLang's _SAMPLING_EPS): logits / T overflow


class SamplingError(ValueError):
    """Rows that cannot be sampled: ``errors`` maps row index to the reason. Raised before any row's
    generator is drawn from, so the caller can drop those rows and sample the rest unchanged."""

    def __init__(self, errors: dict[int, str]):
        super().__init__("; ".join(f"row {i}: {e}" for i, e in errors.items()))
        self.errors = errors


def row_error(row: RowSampling) -> str | None:
    """Why ``row``'s settings cannot be sampled (None when they can): temperature must be finite and
    >= 0, top_p in (0, 1], top_k -1 or >= 1 (a top_k beyond the vocabulary keeps every token)."""
    if not (math.isfinite(row.temperature) and row.temperature >= 0):
        return f"temperature must be a finite number >= 0, got {row.temperature!r}"
    if not 0 < row.top_p <= 1:
        return f"top_p must be in (0, 1], got {row.top_p!r}"
    if row.top_k == 0 or row.top_k < -1:
        return f"top_k must be -1 (off) or >= 1, got {row.top_k!r}"
    return None


def sample_tokens(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[list[int], list[float]]:
    """Sample one token per row.

    ``logits`` (batch, vocab) any float dtype; ``rows`` one ``RowSampling`` per batch row. Returns the
    sampled token ids and their natural-log probabilities (see the module docstring), as Python lists.
    Top-p is nucleus sampling (Holtzman et al. 2020): the smallest prefix of the probability-sorted
    vocabulary whose mass reaches ``top_p`` (always at least one token). A temperature below
    ``GREEDY_BELOW`` is greedy. Raises ValueError when the batch size and ``rows`` disagree,
    SamplingError (before drawing anything) for rows whose settings ``row_error`` refuses.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} sampling rows")
    errors = {i: e for i, r in enumerate(rows) if (e := row_error(r)) is not None}
    if errors:
        raise SamplingError(errors)
    logits = logits.float()
    sampled = [i for i, r in enumerate(rows) if r.temperature >= GREEDY_BELOW]
    temps = torch.ones(len(rows), device=logits.device)
    temps[sampled] = torch.tensor([rows[i].temperature for i in sampled], device=logits.device)
    log_probs = torch.log_softmax(logits / temps[:, None], dim=-1)
    if len(sampled) == len(rows):  # no greedy row: draw every row without copying the batch
        tokens = _draw(log_probs, rows)
    else:
        tokens = torch.argmax(logits, dim=-1)
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            tokens[idx] = _draw(log_probs[idx], [rows[i] for i in sampled])
    token_log_probs = log_probs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), token_log_probs.tolist()


def sample_rows(logits: torch.Tensor, rows: list[RowSampling]
                ) -> tuple[dict[int, tuple[int, float]], dict[int, Exception]]:
    """``sample_tokens`` that never raises for a row: ``({row: (token, log_prob)}, {row: error})``.

    Rows ``row_error`` refuses are dropped before anything is drawn, so the others sample exactly as
    they would have; any other error is narrowed down by sampling the rows one at a time (a row then
    drawn twice skips one uniform of its stream, logged). ``logits`` (batch, vocab).
    """
    keep, errors = list(range(len(rows))), {}
    try:
        try:
            tokens, log_probs = sample_tokens(logits, rows)
        except SamplingError as exc:
            errors = {i: ValueError(message) for i, message in exc.errors.items()}
            keep = [i for i in keep if i not in errors]
            tokens, log_probs = sample_tokens(logits[keep], [rows[i] for i in keep]) if keep else ([], [])
        return dict(zip(keep, zip(tokens, log_probs, strict=True), strict=True)), errors
    except Exception:  # noqa: BLE001 - isolate the row(s) that fail; the others go on
        logger.exception("sampling a batch of %d rows failed; sampling them one at a time", len(keep))
    sampled = {}
    for i in keep:
        try:
            (token,), (log_prob,) = sample_tokens(logits[i : i + 1], [rows[i]])
            sampled[i] = (token, log_prob)
        except Exception as exc:  # noqa: BLE001 - reported for this row only
            errors[i] = exc
    return sampled, errors


def _draw(log_probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Inverse-CDF draw of one token per row from top-k/top-p filtered ``log_probs`` (batch, vocab).

    A row without top-k/top-p walks its CDF in token-id order (no sort); a row with them walks the
    probability-sorted vocabulary (a ``topk`` when only top-k is set, a full sort when top-p is). The
    choice is made per row, so a row's token never depends on its neighbours' settings.
    """
    probs = log_probs.exp()
    uniforms = torch.cat([torch.rand(1, generator=r.generator, device=r.generator.device) for r in rows])
    uniforms = uniforms.to(probs.device)
    tokens = torch.empty(len(rows), dtype=torch.long, device=probs.device)
    plain = [i for i, r in enumerate(rows) if r.top_k < 0 and r.top_p >= 1.0]
    filtered = [i for i, r in enumerate(rows) if not (r.top_k < 0 and r.top_p >= 1.0)]
    if len(plain) == len(rows):
        return _inverse_cdf(probs, uniforms)
    if plain:
        idx = torch.tensor(plain, device=probs.device)
        tokens[idx] = _inverse_cdf(probs[idx], uniforms[idx])
    if filtered:
        idx = torch.tensor(filtered, device=probs.device)
        tokens[idx] = _filtered_draw(probs[idx], uniforms[idx], [rows[i] for i in filtered])
    return tokens


def _filtered_draw(probs: torch.Tensor, uniforms: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Top-k/top-p draw over the probability-sorted vocabulary; ``probs`` (batch, vocab)."""
    vocab = probs.shape[1]
    if all(r.top_p >= 1.0 for r in rows):  # top-k only (every row has one): a partial sort is enough
        probs, order = torch.topk(probs, min(max(r.top_k for r in rows), vocab), dim=-1)
    else:
        probs, order = torch.sort(probs, dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=probs.device)
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=probs.device)
    top_p = torch.tensor([r.top_p for r in rows], device=probs.device)
    keep = (ranks[None, :] < top_k[:, None]) & (torch.cumsum(probs, dim=-1) - probs < top_p[:, None])
    keep[:, 0] = True  # the most likely token is always allowed
    return order.gather(1, _inverse_cdf(probs * keep, uniforms)[:, None])[:, 0]


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Column index per row where the running sum of ``weights`` (batch, n) first exceeds
    ``uniform * total``; never a zero-weight column."""
    cdf = torch.cumsum(weights, dim=-1)
    targets = uniforms * cdf[:, -1]
    pick = torch.searchsorted(cdf, targets[:, None], right=True)[:, 0]
    # A uniform rounding onto the total would pick past the end (or, were the cdf not exact, into trailing
    # zeros): step those rows back to their last positive weight. Elsewhere weights[pick] > 0 (the cdf
    # rises there), so only rows picking past the end or a zero weight need the full-row search.
    inside = pick.clamp(max=weights.shape[1] - 1)
    suspect = ((pick != inside) | (weights.gather(1, inside[:, None])[:, 0] <= 0)).nonzero()[:, 0]
    if suspect.numel():
        rows = weights[suspect]
        last_positive = rows.shape[1] - 1 - torch.argmax((rows.flip(-1) > 0).to(torch.int8), dim=-1)
        pick[suspect] = torch.minimum(pick[suspect], last_positive)
    return pick
