"""DAPO pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"):
dynamic sampling (sec. 3.2) and overlong reward shaping (sec. 3.4, eq. 13).

Clip-higher (sec. 3.1) is ``clip_ratio_high`` of :func:`trainers.losses.policy_loss` and token-level loss
(sec. 3.3) is ``loss_agg_mode="token-mean"`` of :func:`trainers.losses.aggregate_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainers.advantages import group_index

__all__ = [
    "DynamicSamplingResult",
    "filter_zero_variance_groups",
    "overlong_penalty",
    "apply_overlong_penalty",
]


@dataclass(frozen=True)
class DynamicSamplingResult:
    """Outcome of :func:`filter_zero_variance_groups`.

    ``keep_mask``: ``(batch,)`` bool, True for samples of kept groups; ``kept_uids`` / ``dropped_uids``:
    group ids in order of first appearance; ``num_groups_to_refill``: how many more groups the caller must
    generate (``max(0, target_num_groups - len(kept_uids))``, or ``len(dropped_uids)`` without a target).
    """

    keep_mask: torch.Tensor
    kept_uids: list[Any]
    dropped_uids: list[Any]
    num_groups_to_refill: int


def filter_zero_variance_groups(
    uid: Sequence[Any] | torch.Tensor,
    seq_scores: torch.Tensor,
    *,
    target_num_groups: int | None = None,
    atol: float = 0.0,
) -> DynamicSamplingResult:
    """DAPO dynamic sampling (Yu et al. 2025, eq. 11, the constraint ``0 < |{correct}| < G``): drop every
    ``uid`` group whose scores all agree (max − min <= ``atol``) — all-correct and all-wrong groups give
    every sample a zero group-relative advantage and so no gradient. A group of one sample has zero
    variance and is dropped.

    ``uid``: length ``batch``; ``seq_scores``: ``(batch,)`` per-sample scores (e.g. the sum of
    ``token_level_scores`` over valid tokens); ``target_num_groups``: groups the training batch needs
    (``data.train_batch_size``), to report how many to refill. Order-independent: grouping is by ``uid``.
    Raises ValueError on a length mismatch, a negative ``atol`` or ``target_num_groups``.
    """
    if seq_scores.dim() != 1:
        raise ValueError(f"seq_scores must be (batch,), got shape {tuple(seq_scores.shape)}")
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    if target_num_groups is not None and target_num_groups < 0:
        raise ValueError(f"target_num_groups must be >= 0, got {target_num_groups}")
    index, num_groups = group_index(uid, seq_scores.shape[0])
    scores = seq_scores.detach().to(torch.float64).cpu()
    group_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, index, scores, "amax")
    group_min = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, index, scores, "amin")
    keep_group = (group_max - group_min) > atol
    uids = uid.tolist() if isinstance(uid, torch.Tensor) else list(uid)
    first_of_group: dict[int, Any] = {}
    for u, g in zip(uids, index.tolist(), strict=True):
        first_of_group.setdefault(g, u)
    kept = [first_of_group[g] for g in range(num_groups) if keep_group[g]]
    dropped = [first_of_group[g] for g in range(num_groups) if not keep_group[g]]
    refill = len(dropped) if target_num_groups is None else max(0, target_num_groups - len(kept))
    return DynamicSamplingResult(
        keep_mask=keep_group[index].to(seq_scores.device),
        kept_uids=kept,
        dropped_uids=dropped,
        num_groups_to_refill=refill,
    )


def overlong_penalty(
    response_length: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), times ``penalty_factor``:

    with ``L_max`` = ``max_response_length`` and ``L_cache`` = ``overlong_buffer_len`` (both tokens),
    ``0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` inside the buffer;
    ``-1`` beyond ``L_max``.

    ``response_length``: ``(batch,)`` valid response tokens. Returns ``(batch,)`` float32 penalties
    (<= 0). Raises ValueError unless ``0 < overlong_buffer_len <= max_response_length`` and
    ``penalty_factor >= 0``.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"algorithm.overlong_buffer_len must be in (0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_len}"
        )
    if penalty_factor < 0:
        raise ValueError(f"algorithm.overlong_penalty_factor must be >= 0, got {penalty_factor}")
    length = response_length.to(torch.float32)
    expected = float(max_response_length - overlong_buffer_len)
    penalty = ((expected - length) / overlong_buffer_len).clamp(min=-1.0, max=0.0)
    return penalty * penalty_factor


def apply_overlong_penalty(
    token_level_scores: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Add :func:`overlong_penalty` to the score of each response's last valid token (where the outcome
    reward sits). ``token_level_scores``, ``response_mask``: ``(batch, response_len)``; the length of a
    response is its count of valid tokens. Fully masked responses are left unchanged.

    Returns ``(new_token_level_scores, {"overlong/penalty_mean": ..., "overlong/frac_penalised": ...})``.
    """
    if token_level_scores.shape != response_mask.shape or token_level_scores.dim() != 2:
        raise ValueError(
            f"token_level_scores {tuple(token_level_scores.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must be the same (batch, response_len) shape"
        )
    valid = response_mask.bool()
    lengths = valid.sum(dim=-1)
    penalty = overlong_penalty(lengths, max_response_length=max_response_length,
                               overlong_buffer_len=overlong_buffer_len, penalty_factor=penalty_factor)
    # Index of the last valid token: position of the maximum of (t + 1) * valid.
    positions = torch.arange(1, valid.shape[1] + 1, device=valid.device).expand_as(valid)
    last = (positions * valid).argmax(dim=-1)
    has_token = lengths > 0
    out = token_level_scores.clone()
    rows = torch.arange(out.shape[0], device=out.device)[has_token]
    out[rows, last[has_token]] += penalty[has_token].to(out.dtype)
    metrics = {
        "overlong/penalty_mean": penalty.mean().item() if penalty.numel() else 0.0,
        "overlong/frac_penalised": (penalty < 0).float().mean().item() if penalty.numel() else 0.0,
    }
    return out, metrics
