"""Policy, value and entropy losses, and the loss aggregation modes.

All per-token tensors are ``(batch, response_len)``; log-probs are natural-log per token. Losses are
scalars to *minimise*.

Aggregation and gradient accumulation. Every mode divides a **sum over the micro-batch** by a count of
the **whole mini-batch** (``global_num_tokens`` / ``global_num_seqs``: summed by the worker over all
micro-batches and data-parallel ranks, see :func:`trainers.metrics.count_tokens_and_seqs`). Summing the
micro-batch losses (gradient accumulation) therefore gives exactly the mini-batch loss, whatever the
split. Under data parallelism the per-rank losses must be *summed*, not averaged: FSDP2 averages
gradients over ranks by default, so the worker multiplies the loss by the world size (or sets the
gradient divide factor to 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.registry import Registry
from trainers.metrics import count_tokens_and_seqs, masked_mean, masked_sum
from trainers.policy_losses import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossConfig,
    PolicyLossInputs,
    PolicyLossParams,
)

__all__ = [
    "LOSS_AGG_MODES",
    "LossAggMode",
    "register_loss_agg_mode",
    "aggregate_loss",
    "policy_loss",
    "value_loss",
    "entropy_from_logits",
    "log_probs_from_logits",
]

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps ratios finite when log-probs of a token diverge

AggFn = Callable[[torch.Tensor, torch.Tensor, float, float, "int | None"], torch.Tensor]


@dataclass(frozen=True)
class LossAggMode:
    """A loss-aggregation plug-in: ``fn(loss_mat, mask, num_tokens, num_seqs, norm_length) -> scalar`` sums
    over this micro-batch and divides by counts of the whole mini-batch (see :func:`aggregate_loss`);
    ``needs_norm_length``: the mode divides by ``norm_length`` (``rollout.max_response_length``)."""

    name: str
    fn: AggFn
    needs_norm_length: bool = False


LOSS_AGG_MODES: Registry[LossAggMode] = Registry("loss aggregation mode", "algorithm.loss_agg_mode")


def register_loss_agg_mode(name: str, *, needs_norm_length: bool = False) -> Callable[[AggFn], AggFn]:
    """Decorator registering ``fn`` as the :class:`LossAggMode` ``name``; raises ValueError on a duplicate."""

    def wrap(fn: AggFn) -> AggFn:
        LOSS_AGG_MODES.register(name, LossAggMode(name, fn, needs_norm_length))
        return fn

    return wrap


@register_loss_agg_mode("token-mean")
def _token_mean(loss_mat, mask, num_tokens, num_seqs, norm_length):
    return masked_sum(loss_mat, mask) / num_tokens


@register_loss_agg_mode("token-sum")
def _token_sum(loss_mat, mask, num_tokens, num_seqs, norm_length):
    return masked_sum(loss_mat, mask)


@register_loss_agg_mode("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, num_tokens, num_seqs, norm_length):
    return masked_sum(loss_mat, mask) / num_seqs


@register_loss_agg_mode("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, num_tokens, num_seqs, norm_length):
    per_seq = masked_mean(loss_mat, mask, dim=-1)  # 0 for a fully masked sequence
    return per_seq.sum() / num_seqs


@register_loss_agg_mode("seq-mean-token-sum-norm", needs_norm_length=True)
def _seq_mean_token_sum_norm(loss_mat, mask, num_tokens, num_seqs, norm_length):
    return masked_sum(loss_mat, mask) / (num_seqs * norm_length)


def aggregate_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: int | float | torch.Tensor | None = None,
    global_num_seqs: int | float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``(batch, response_len)`` to a scalar over the valid tokens of ``response_mask``.

    With ``N`` = ``global_num_tokens`` (valid tokens of the mini-batch), ``S`` = ``global_num_seqs``
    (sequences of the mini-batch with at least one valid token), ``l_it`` the loss of token t of
    sequence i and ``T_i`` its valid-token count, summing over this micro-batch only:

    * ``token-mean``: ``sum_it l_it / N`` (PPO/DAPO token-level; DAPO, Yu et al. 2025, eq. 12);
    * ``token-sum``: ``sum_it l_it`` — no normalisation (the loss scales with the tokens of the mini-batch;
      lower the learning rate accordingly);
    * ``seq-mean-token-sum``: ``sum_i (sum_t l_it) / S``;
    * ``seq-mean-token-mean``: ``sum_i (sum_t l_it / T_i) / S`` (the original GRPO objective);
    * ``seq-mean-token-sum-norm``: ``sum_it l_it / (S * norm_length)`` (Dr.GRPO, Liu et al. 2025, eq. 3 —
      a constant length in place of each ``T_i``). ``norm_length`` is required for this mode and must be
      the same constant for the whole run — pass ``rollout.max_response_length``.

    ``mode`` is a name of ``LOSS_AGG_MODES`` (or ``module:name`` of a plug-in). ``N`` and ``S`` default to this micro-batch's own counts (correct only when the micro-batch is the whole
    mini-batch). A count of 0 is replaced by 1, so an all-masked batch gives exactly 0 with zero gradient;
    padding is selected away (``torch.where``), so NaN/inf there never reaches the value or the gradient.

    Raises ValueError for an unknown ``mode``, a shape mismatch, a negative count or a missing/invalid
    ``norm_length``.
    """
    agg = LOSS_AGG_MODES.get(mode)
    if loss_mat.dim() != 2 or loss_mat.shape != response_mask.shape:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and response_mask {tuple(response_mask.shape)} must be the same "
            "(batch, response_len) shape"
        )
    if agg.needs_norm_length and (norm_length is None or norm_length <= 0):
        raise ValueError(
            f"loss_agg_mode {mode!r} needs norm_length > 0 (rollout.max_response_length), got {norm_length}"
        )
    if global_num_tokens is None or global_num_seqs is None:
        local_tokens, local_seqs = count_tokens_and_seqs(response_mask)
        global_num_tokens = local_tokens if global_num_tokens is None else global_num_tokens
        global_num_seqs = local_seqs if global_num_seqs is None else global_num_seqs
    counts = []
    for name, value in (("global_num_tokens", global_num_tokens), ("global_num_seqs", global_num_seqs)):
        value = float(value.item() if isinstance(value, torch.Tensor) else value)
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        counts.append(max(value, 1.0))
    return agg.fn(loss_mat, response_mask, counts[0], counts[1], norm_length)


def _clipped_log_ratio(log_probs: torch.Tensor, base_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log_probs - base_log_probs`` on valid tokens, clamped to ±20; exactly 0 on padding."""
    diff = torch.where(mask, log_probs - base_log_probs, torch.zeros((), dtype=log_probs.dtype,
                                                                      device=log_probs.device))
    return diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _check_policy_inputs(log_probs, old_log_probs, advantages, response_mask, **optional) -> None:
    shape = tuple(response_mask.shape)
    if len(shape) != 2:
        raise ValueError(f"response_mask must be (batch, response_len), got shape {shape}")
    tensors = {"log_probs": log_probs, "old_log_probs": old_log_probs, "advantages": advantages, **optional}
    for name, tensor in tensors.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} like response_mask")


def _stale_weights(
    old_log_probs, rollout_log_probs, proximal_log_probs, mask, stale_correction, tis_cap
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-probs the PPO ratio is taken against, and a detached per-token importance weight (or None)."""
    if stale_correction == "none":
        if rollout_log_probs is not None or proximal_log_probs is not None:
            raise ValueError("rollout_log_probs/proximal_log_probs were given but algorithm.stale_correction='none' "
                             "would ignore them; pass None or choose 'decoupled' or 'tis'")
        return old_log_probs, None
    if proximal_log_probs is not None and stale_correction != "decoupled":
        raise ValueError(f"proximal_log_probs is only used by stale_correction='decoupled', got {stale_correction!r}")
    if rollout_log_probs is None:
        raise ValueError(f"algorithm.stale_correction={stale_correction!r} needs rollout_log_probs, got None")
    if stale_correction == "decoupled":
        proximal = old_log_probs if proximal_log_probs is None else proximal_log_probs
        weight = torch.exp(_clipped_log_ratio(proximal.detach(), rollout_log_probs.detach(), mask))
        return proximal, weight
    if stale_correction == "tis":
        weight = torch.exp(_clipped_log_ratio(old_log_probs.detach(), rollout_log_probs.detach(), mask))
        return old_log_probs, weight.clamp(max=tis_cap)
    raise ValueError(f"algorithm.stale_correction={stale_correction!r} is not one of ['none', 'decoupled', 'tis']")


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_mode: str | PolicyLoss = "vanilla",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    config: PolicyLossConfig | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: int | float | torch.Tensor | None = None,
    global_num_seqs: int | float | torch.Tensor | None = None,
    norm_length: int | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    proximal_log_probs: torch.Tensor | None = None,
    stale_correction: str = "none",
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss ``loss_mode`` (``algorithm.policy_loss``, a :class:`~trainers.policy_losses.PolicyLoss`
    or its name) with the staleness corrections; returns ``(loss, metrics)``.

    Per token, with ``r = exp(log_probs - base)`` and ``A`` = ``advantages``, the plug-in gives a loss
    ``l`` (``vanilla``: ``l = -min(r * A, clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high) * A)`` — PPO,
    Schulman et al. 2017, eq. 7, with DAPO's decoupled clip-higher, Yu et al. 2025, eq. 10 — and with
    ``VanillaConfig.dual_clip_c > 1`` (0 = off) the dual clip ``-dual_clip_c * A`` on negative advantages, Ye
    et al. 2020, eq. 5; the others in ``trainers/policy_losses.py``). The plug-in reads the shared
    ``clip_ratio_low/high`` and ``config``, its own settings (``algorithm.policy_loss``: an instance of the
    plug-in's config class; None = its defaults). The per-token loss is then multiplied by a detached importance weight ``w`` and
    aggregated with :func:`aggregate_loss` (the plug-in's own aggregation if it has one, else
    ``loss_agg_mode``; ``global_num_*``, ``norm_length`` as there).

    ``stale_correction`` chooses ``base`` and ``w``:

    * ``none``: ``base = old_log_probs``, ``w = 1``;
    * ``decoupled`` (decoupled PPO, Hilton et al. 2021, "Batch size-invariance for policy optimization",
      eq. 2): ``base`` = the proximal policy (``proximal_log_probs``, default ``old_log_probs``: the
      trainer's log-probs before this update), ``w = pi_prox / pi_behav`` with the behaviour policy
      ``rollout_log_probs`` (not truncated);
    * ``tis``: truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
      You Off-Policy RL Training"): ``base = old_log_probs``, ``w = min(pi_old / pi_rollout, tis_cap)``.

    Log-ratios are clamped to ±20 and padding is excluded before ``exp``, so padded positions stay finite.

    Metrics (floats, over exactly the valid tokens): ``pg_loss``, ``pg_clipfrac`` (tokens the plug-in
    reports clipped — for vanilla, those whose clipped term was taken), ``pg_clipfrac_lower`` (vanilla:
    tokens bounded by the dual clip), ``ppo_kl`` (k3 estimate of KL(pi_base || pi_theta)),
    ``ratio_mean|max|min``, ``is_weight_mean`` (when ``w`` is used), and ``num_tokens`` (this
    micro-batch's valid tokens, the weight for :func:`trainers.metrics.weighted_average`). With no valid
    token, means are 0 and ratio max/min 1.

    Raises ValueError on shape mismatch, an unknown ``loss_mode``, a ``config`` of another loss's class, an
    unknown ``stale_correction``, a correction without ``rollout_log_probs``, or correction inputs the chosen
    correction would ignore.
    """
    _check_policy_inputs(log_probs, old_log_probs, advantages, response_mask,
                         rollout_log_probs=rollout_log_probs, proximal_log_probs=proximal_log_probs)
    plugin = loss_mode if isinstance(loss_mode, PolicyLoss) else POLICY_LOSSES.get(loss_mode)
    params = PolicyLossParams(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high)
    config = plugin.config(name=plugin.name) if config is None else config
    if type(config) is not plugin.config:
        raise ValueError(f"policy loss {plugin.name!r} takes a {plugin.config.__name__} as its config, "
                         f"got a {type(config).__name__}")
    mask = response_mask.bool()
    base, weight = _stale_weights(old_log_probs, rollout_log_probs, proximal_log_probs, mask,
                                  stale_correction, tis_cap)
    log_ratio = _clipped_log_ratio(log_probs, base.detach(), mask)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    inputs = PolicyLossInputs(log_probs=torch.where(mask, log_probs, zero),
                              base_log_probs=torch.where(mask, base.detach(), zero), log_ratio=log_ratio,
                              advantages=advantages.detach(), mask=mask)
    terms = plugin.fn(inputs, params, config)
    loss_mat = terms.loss_mat if weight is None else terms.loss_mat * weight
    loss = aggregate_loss(loss_mat, response_mask, plugin.loss_agg_mode or loss_agg_mode,
                          global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                          norm_length=norm_length)
    none = torch.zeros_like(mask)
    clipped = none if terms.clipped is None else terms.clipped
    clipped_lower = none if terms.clipped_lower is None else terms.clipped_lower
    metrics = _policy_metrics(loss, torch.exp(log_ratio.detach()), log_ratio.detach(), clipped, clipped_lower,
                              weight, mask)
    return loss, metrics


def _policy_metrics(loss, ratio, log_ratio, clipped, dual_clipped, weight, mask) -> dict[str, float]:
    num_tokens = int(mask.sum().item())
    ratios = ratio[mask]
    # k3 of KL(pi_base || pi_theta), samples from pi_base: r - 1 - log r with r = pi_theta / pi_base.
    ppo_kl = ratio - 1.0 - log_ratio
    metrics = {
        "pg_loss": loss.detach().item(),
        "pg_clipfrac": masked_mean(clipped.float(), mask).item(),
        "pg_clipfrac_lower": masked_mean(dual_clipped.float(), mask).item(),
        "ppo_kl": masked_mean(ppo_kl, mask).item(),
        "ratio_mean": masked_mean(ratio, mask).item() if num_tokens else 1.0,
        "ratio_max": ratios.max().item() if num_tokens else 1.0,
        "ratio_min": ratios.min().item() if num_tokens else 1.0,
        "num_tokens": float(num_tokens),
    }
    if weight is not None:
        metrics["is_weight_mean"] = masked_mean(weight, mask).item() if num_tokens else 1.0
    return metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: int | float | torch.Tensor | None = None,
    global_num_seqs: int | float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss (PPO value clipping, as in OpenAI baselines' ppo2 and Ziegler et al. 2019):
    ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` per token, aggregated like
    :func:`aggregate_loss`. ``values`` are the critic's current predictions, ``old_values`` those before
    the update, ``returns`` the targets; all ``(batch, response_len)``. ``cliprange_value`` ``c`` > 0.

    Returns ``(loss, metrics)``: ``vf_loss``, ``vf_clipfrac`` (valid tokens where the clipped term was
    larger), ``vpred_mean``, ``num_tokens``. Raises ValueError on shape mismatch or ``c <= 0``.
    """
    _check_policy_inputs(values, old_values, returns, response_mask)
    if cliprange_value <= 0:
        raise ValueError(f"cliprange_value must be > 0, got {cliprange_value}")
    mask = response_mask.bool()
    old_values = old_values.detach()
    returns = returns.detach()
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode, global_num_tokens=global_num_tokens,
                          global_num_seqs=global_num_seqs, norm_length=norm_length)
    metrics = {
        "vf_loss": loss.detach().item(),
        "vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).item(),
        "vpred_mean": masked_mean(values.detach(), mask).item(),
        "num_tokens": float(mask.sum().item()),
    }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``H = logsumexp(z) - sum(softmax(z) * z)`` (nats) of the categorical over the last dim.

    ``logits``: ``(..., vocab)`` (already divided by the sampling temperature); returns ``(...)`` in the
    logits' dtype, differentiable. For the entropy bonus, aggregate it with :func:`aggregate_loss` and
    subtract ``entropy_coeff`` times it from the loss.
    """
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be (..., vocab) with vocab >= 1, got shape {tuple(logits.shape)}")
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Natural-log probability of ``labels`` under ``softmax(logits)``.

    ``logits``: ``(..., vocab)`` (already divided by the temperature); ``labels``: ``(...)`` int64 token
    ids. Returns ``(...)`` float, differentiable. Raises ValueError on a shape mismatch.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + (vocab,)")
    log_z = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - log_z
