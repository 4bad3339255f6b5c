"""KL between the policy and the reference model: per-token estimators, KL-in-reward with a fixed or
adaptive coefficient, and KL-as-loss.

Estimators (Schulman 2020, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html), for a
token ``x`` sampled from the policy ``pi`` and ``log_r = log pi_ref(x) - log pi(x)``:

================  ===============================  ==================  ====================================
name              value                            E_pi[value]         expected gradient as a loss
================  ===============================  ==================  ====================================
``k1`` / ``kl``   ``-log_r``                       KL(pi || pi_ref)    **0** — E_pi[grad log pi] = 0: k1 as a
                                                                       loss only adds noise, no KL pull
``abs``           ``|log_r|``                      >= KL, not a KL     E[sign(-log_r) grad log pi]
``k2`` / ``mse``  ``0.5 * log_r**2``               not a KL (biased)   grad KL(pi || pi_ref), the *reverse* KL
``k3_unclamped``  ``exp(log_r) - 1 - log_r``       KL(pi || pi_ref)    grad KL(pi_ref || pi), the *forward* KL
``low_var_kl`` /  k3 with ``log_r`` clamped to     ≈ k3                ≈ k3 (0 where a clamp is active)
``k3``            ±20 and the value to <= 10
``<name>+``       the value of ``<name>``          as ``<name>``       k2's: grad KL(pi || pi_ref)
================  ===============================  ==================  ====================================

``k3`` is verl's name for the clamped ``low_var_kl`` (the two are one estimator); ``k3_unclamped`` is
Schulman's k3 as written. The straight-through ``+`` variants (``k1+``, ``kl+``, ``abs+``, ``k3+``,
``low_var_kl+``, ``k3_unclamped+``; verl PR 2953) report the base estimator's value but backpropagate
k2's gradient: ``k2 - sg(k2) + sg(k)``.

"Expected gradient as a loss" is ``E_{x~pi}[grad_theta k(x)]`` with the samples held fixed (the
pathwise gradient a trainer gets from backpropagating the estimator; no score-function term):
k2 gives ``E[log(pi/pi_ref) grad log pi] = grad KL(pi||pi_ref)``; k3 gives
``E[(1 - pi_ref/pi) grad log pi] = -sum pi_ref grad log pi = grad KL(pi_ref||pi)``. All estimators are 0
with zero gradient where ``pi == pi_ref``, except ``abs``, whose gradient there is ``±grad log pi`` (the
sign of a rounding error).

Registry: each estimator is a :class:`KLEstimator` plug-in in ``KL_ESTIMATORS``, the names of
``algorithm.kl_estimator`` and ``algorithm.kl_in_reward_estimator`` (``module:name`` from outside,
``common/registry.py``).

KL-in-reward subtracts ``kl_coef * k(x)`` from every valid token's score (Ziegler et al. 2019, "Fine-Tuning
Language Models from Human Preferences", eq. 2); the coefficient is fixed or adapted towards a target KL
(ibid., sec. 2.2). KL-as-loss adds ``kl_loss_coef * aggregate(k)`` to the policy loss (GRPO, Shao et al.
2024, eq. 4, which uses k3). All tensors are ``(batch, response_len)``, natural-log per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.registry import Registry
from trainers.losses import aggregate_loss
from trainers.metrics import masked_mean, masked_sum

__all__ = [
    "KL_ESTIMATORS",
    "KLEstimator",
    "register_kl_estimator",
    "kl_penalty",
    "kl_loss",
    "apply_kl_in_reward",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
]

_LOW_VAR_LOG_CLAMP = 20.0
_LOW_VAR_VALUE_CLAMP = 10.0

KLFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class KLEstimator:
    """A per-token KL estimator plug-in: ``fn(log_ratio) -> k`` with ``log_ratio = log pi - log pi_ref``
    (any shape, same shape out)."""

    name: str
    fn: KLFn


KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", "algorithm.kl_estimator")


def register_kl_estimator(*names: str) -> Callable[[KLFn], KLFn]:
    """Decorator registering ``fn`` under each of ``names`` (aliases); raises ValueError on a duplicate."""

    def wrap(fn: KLFn) -> KLFn:
        for name in names:
            KL_ESTIMATORS.register(name, KLEstimator(name, fn))
        return fn

    return wrap


@register_kl_estimator("k1", "kl")
def _k1(log_ratio: torch.Tensor) -> torch.Tensor:  # log_ratio = log pi - log pi_ref
    return log_ratio


@register_kl_estimator("abs")
def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


@register_kl_estimator("k2", "mse")
def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


@register_kl_estimator("k3_unclamped")
def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    log_r = -log_ratio
    return torch.exp(log_r) - 1.0 - log_r


@register_kl_estimator("low_var_kl", "k3")
def _low_var_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    return _k3(log_ratio.clamp(-_LOW_VAR_LOG_CLAMP, _LOW_VAR_LOG_CLAMP)).clamp(max=_LOW_VAR_VALUE_CLAMP)


def _straight_through(value_fn: KLFn) -> KLFn:
    """``value_fn``'s value with k2's gradient (verl's ``+`` suffix)."""

    def fn(log_ratio: torch.Tensor) -> torch.Tensor:
        k2 = _k2(log_ratio)
        return k2 - k2.detach() + value_fn(log_ratio).detach()

    return fn


for _name in ("k1", "kl", "abs", "k3_unclamped", "low_var_kl", "k3"):
    register_kl_estimator(f"{_name}+")(_straight_through(KL_ESTIMATORS.get(_name).fn))


def kl_penalty(log_probs: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate ``(batch, response_len)`` (or any common shape) of ``pi`` against ``pi_ref``.

    ``log_probs``: log pi of the sampled tokens (differentiable when used as a loss); ``ref_log_prob``:
    log pi_ref of the same tokens (treated as a constant). ``estimator``: a name of ``KL_ESTIMATORS`` (or
    ``module:name``) — see the module table for each one's value and gradient. Padding is not masked here:
    mask or aggregate the result. Raises ValueError for an unknown estimator or a shape mismatch.
    """
    plugin = KL_ESTIMATORS.get(estimator)
    if log_probs.shape != ref_log_prob.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and ref_log_prob {tuple(ref_log_prob.shape)} differ")
    return plugin.fn(log_probs - ref_log_prob.detach())


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    estimator: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_num_tokens: int | float | torch.Tensor | None = None,
    global_num_seqs: int | float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-as-loss: :func:`kl_penalty` aggregated with :func:`trainers.losses.aggregate_loss` (same
    ``loss_agg_mode`` / global counts as the policy loss, so it too is split-invariant). The caller adds
    ``kl_loss_coef * loss``. Returns ``(loss, {"kl_loss": float, "num_tokens": float})``.

    Padding is selected away before the estimator, so log-probs of padded positions never matter.
    """
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    kl = kl_penalty(torch.where(mask, log_probs, zero), torch.where(mask, ref_log_prob, zero), estimator)
    loss = aggregate_loss(kl, response_mask, loss_agg_mode, global_num_tokens=global_num_tokens,
                          global_num_seqs=global_num_seqs, norm_length=norm_length)
    return loss, {"kl_loss": loss.detach().item(), "num_tokens": float(mask.sum().item())}


def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """``token_level_rewards = token_level_scores - kl_coef * k(x)`` on valid tokens (Ziegler et al. 2019,
    eq. 2); padding keeps its score (normally 0).

    ``log_probs``: the behaviour-side log-probs (``old_log_probs``); ``ref_log_prob``: the reference's. All
    ``(batch, response_len)``. Returns ``(token_level_rewards, metrics)`` with ``kl_in_reward/kl`` — the
    mean over sequences (with a valid token) of each sequence's per-token mean KL, the quantity the
    adaptive controller tracks (verl's convention; Ziegler et al. track the per-response sum) — and
    ``kl_in_reward/coef``. No gradient. Raises ValueError on shape mismatch or ``kl_coef < 0``.
    """
    if token_level_scores.shape != response_mask.shape:
        raise ValueError(
            f"token_level_scores {tuple(token_level_scores.shape)} and response_mask "
            f"{tuple(response_mask.shape)} differ"
        )
    if kl_coef < 0:
        raise ValueError(f"algorithm.kl_in_reward_coef must be >= 0, got {kl_coef}")
    with torch.no_grad():
        mask = response_mask.bool()
        kl = torch.where(mask, kl_penalty(log_probs, ref_log_prob, estimator), torch.zeros_like(log_probs))
        rewards = token_level_scores - kl_coef * kl.to(token_level_scores.dtype)
        seq_valid = mask.any(dim=-1)
        per_seq = masked_sum(kl, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)
        current_kl = masked_mean(per_seq, seq_valid).item()
    return rewards, {"kl_in_reward/kl": current_kl, "kl_in_reward/coef": float(kl_coef)}


class FixedKLController:
    """A constant KL-in-reward coefficient ``value``. ``update`` is a no-op (kept for a uniform interface)."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"algorithm.kl_in_reward_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, sec. 2.2; lm-human-preferences ``AdaptiveKLController``).

    After each step with measured KL ``current_kl`` over ``n_steps`` samples:
    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.
    ``target_kl`` is in the units of ``apply_kl_in_reward``'s ``kl_in_reward/kl`` (nats per token).
    ``state_dict``/``load_state_dict`` carry ``value`` through checkpoints.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"algorithm.kl_in_reward_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"algorithm.kl_target must be > 0, got {target_kl}")
        if horizon < 1:
            raise ValueError(f"algorithm.kl_horizon must be >= 1, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt ``value`` and return it. ``n_steps``: samples (or steps) the measurement covers, >= 0."""
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def make_kl_controller(algorithm) -> FixedKLController | AdaptiveKLController:
    """The KL-in-reward controller an ``AlgorithmConfig`` asks for (``kl_ctrl_type``: fixed | adaptive,
    starting at ``kl_in_reward_coef``; adaptive uses ``kl_target`` and ``kl_horizon``)."""
    if algorithm.kl_ctrl_type == "fixed":
        return FixedKLController(algorithm.kl_in_reward_coef)
    if algorithm.kl_ctrl_type == "adaptive":
        return AdaptiveKLController(algorithm.kl_in_reward_coef, algorithm.kl_target, algorithm.kl_horizon)
    raise ValueError(f"algorithm.kl_ctrl_type={algorithm.kl_ctrl_type!r} is not one of ['fixed', 'adaptive']")
