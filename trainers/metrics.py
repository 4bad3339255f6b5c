"""Masked statistics and per-update metric helpers (pure torch, no state).

Every statistic here is taken over the **valid** tokens of ``response_mask`` only — exactly the tokens a
loss uses — so padding never dilutes a mean and a fully masked batch gives finite numbers (never NaN).
All tensors are ``(batch, response_len)`` unless a docstring says otherwise; masks may be bool, int or
float (nonzero = valid).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "masked_stats",
    "count_tokens_and_seqs",
    "weighted_average",
]


def _check_same_shape(x: torch.Tensor, mask: torch.Tensor, name: str = "x") -> None:
    if x.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but response_mask has {tuple(mask.shape)}")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over valid positions. Masked positions are *selected away* (``torch.where``), not
    multiplied by 0, so a NaN/inf in padding neither leaks into the value nor into its gradient.

    ``x``, ``mask``: same shape. ``dim``: reduce one dimension (None = all). Raises ValueError on shape
    mismatch.
    """
    _check_same_shape(x, mask)
    selected = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid positions; 0 (not NaN) where there is no valid position.

    Shapes as in :func:`masked_sum`; the result is a scalar (``dim=None``) or ``x`` reduced along ``dim``.
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all valid positions (a scalar); Bessel-corrected when ``unbiased``.

    Returns 0 when fewer than 2 (unbiased) or 1 (biased) positions are valid.
    """
    mean = masked_mean(x, mask)
    count = mask.bool().sum()
    sq = masked_sum((x - mean) ** 2, mask)
    denom = count - 1 if unbiased else count
    if denom <= 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return sq / denom.to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + epsilon)`` with mean and unbiased var over valid positions; 0 on padding.

    The batch whitening of PPO/GAE advantages and REINFORCE++ (Hu 2025, eq. 5). Computed in float64 so
    a batch of equal values whitens to exactly 0. ``x``, ``mask``: ``(batch, response_len)``.
    """
    x64 = x.to(torch.float64)
    mean = masked_mean(x64, mask)
    var = masked_var(x64, mask)
    out = (x64 - mean) * torch.rsqrt(var + epsilon)
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device)).to(x.dtype)


def masked_stats(x: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, float]:
    """``{prefix}/mean``, ``/max``, ``/min`` of ``x`` over valid positions (0.0 each if none is valid)."""
    _check_same_shape(x, mask, prefix)
    valid = x.detach()[mask.bool()]
    if valid.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    valid = valid.float()
    return {
        f"{prefix}/mean": valid.mean().item(),
        f"{prefix}/max": valid.max().item(),
        f"{prefix}/min": valid.min().item(),
    }


def count_tokens_and_seqs(response_mask: torch.Tensor) -> tuple[int, int]:
    """``(num_tokens, num_seqs)`` of a ``(batch, response_len)`` mask: valid tokens, and sequences with at
    least one valid token.

    These are the counts :func:`trainers.losses.aggregate_loss` divides by. The worker sums them over
    every micro-batch of a mini-batch and every data-parallel rank (an all-reduce) and passes the totals
    as ``global_num_tokens`` / ``global_num_seqs``.
    """
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (batch, response_len), got shape {tuple(response_mask.shape)}")
    valid = response_mask.bool()
    return int(valid.sum().item()), int(valid.any(dim=-1).sum().item())


def weighted_average(values: Iterable[Mapping[str, float]], weight_key: str = "num_tokens") -> dict[str, float]:
    """Combine per-micro-batch metric dicts into one: keys ending ``_max``/``/max`` take the max, ``_min``/
    ``/min`` the min, ``weight_key`` is summed, everything else is averaged weighted by ``weight_key``.

    A dict whose weight is 0 (no valid token) contributes nothing but its max/min entries are skipped as
    well. Raises ValueError if a dict lacks ``weight_key``.
    """
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    minima: dict[str, float] = {}
    total = 0.0
    for i, metrics in enumerate(values):
        if weight_key not in metrics:
            raise ValueError(f"metrics #{i} has no {weight_key!r} entry to weight by: {sorted(metrics)}")
        weight = float(metrics[weight_key])
        total += weight
        if weight == 0:
            continue
        for key, value in metrics.items():
            if key == weight_key:
                continue
            if key.endswith(("_max", "/max")):
                maxima[key] = max(maxima.get(key, value), value)
            elif key.endswith(("_min", "/min")):
                minima[key] = min(minima.get(key, value), value)
            else:
                sums[key] = sums.get(key, 0.0) + weight * float(value)
    out = {key: value / total for key, value in sums.items()} if total > 0 else {}
    out.update(maxima)
    out.update(minima)
    out[weight_key] = total
    return out
