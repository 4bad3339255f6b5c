"""Advantage estimators: GAE, GRPO, Dr.GRPO, RLOO, REINFORCE++ (and -baseline), ReMax, GRPO pass@k, OPO, GPG.

Every estimator takes ``(batch, response_len)`` tensors — ``token_level_rewards`` (the reward on the last
valid token, plus any per-token KL penalty), ``response_mask`` — and returns ``(advantages, returns)`` of
the same shape, zero on padding. Group-relative estimators group samples by ``uid``, a sequence of
hashable prompt-group ids of length ``batch`` (list, tuple, numpy array or 1-D tensor) — **never by
position**, so shuffling a batch or dropping samples of other groups does not change a sample's
advantage. Group statistics are computed in float64, so a group of identical rewards gets exactly 0.

A sample's *score* is the sum of its ``token_level_rewards`` over valid tokens.

Groups of one sample (every group estimator): the baseline is the sample itself, so its advantage is
exactly 0 (no relative information; never NaN). verl instead uses a baseline of 0 there (README,
"Algorithms").

Registry: each estimator is an :class:`AdvantageEstimator` plug-in in ``ADV_ESTIMATORS`` (the names of
``algorithm.adv_estimator``), carrying its wiring: ``needs_critic`` (the trainer builds a critic),
``input_fields`` (batch fields it reads besides the rewards and mask), ``roller_extras`` (per-sample
fields the rollers must add) and ``group_local`` (a sample's advantage depends only on its own ``uid`` group:
the trainer then computes it on each rank's own rows, ``trainers/advantage_stage.py``). Add one with
``@register_adv_estimator("name", input_fields=(...))`` in any module; a module outside the package is selected as ``algorithm.adv_estimator=module:name``
(``common/registry.py``). :func:`compute_advantages` dispatches.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common import schema
from common.registry import Registry
from trainers.metrics import masked_sum, masked_whiten

__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageEstimator",
    "register_adv_estimator",
    "compute_advantages",
    "group_index",
    "gae_advantages",
    "grpo_advantages",
    "drgrpo_advantages",
    "rloo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "grpo_passk_advantages",
    "opo_advantages",
    "gpg_advantages",
    "discounted_returns",
]

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator:
    """An advantage estimator plug-in: the function and what a run must wire around it.

    ``fn(token_level_rewards, response_mask, <input_fields...>, *, <hyper-parameters>)`` returns
    ``(advantages, returns)``, both ``(batch, response_len)``; hyper-parameters it declares among
    ``gamma``, ``lam``, ``norm_adv_by_std``, ``epsilon`` are passed from ``algorithm.*``.
    ``needs_critic``: the trainer builds a critic and computes ``values`` (include ``values`` in
    ``input_fields``). ``input_fields``: sample-schema fields the estimator reads (``uid``, ``values``,
    ``remax_baseline``...), required non-None. ``roller_extras``: per-sample fields the rollers must put
    (and the trainer fetch) for it, e.g. ReMax's ``remax_baseline``. ``group_local``: a sample's advantage
    depends only on the samples of its own ``uid`` group (no batch-wide statistic such as whitening or a
    batch count), so a trainer rank holding whole groups computes it on its own rows without gathering
    the batch; False (the safe default) makes every rank gather the global batch.
    """

    name: str
    fn: AdvantageFn
    needs_critic: bool = False
    input_fields: tuple[str, ...] = ()
    roller_extras: tuple[str, ...] = ()
    group_local: bool = False


ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "algorithm.adv_estimator")


def register_adv_estimator(name: str, *, needs_critic: bool = False, input_fields: tuple[str, ...] = (),
                           roller_extras: tuple[str, ...] = (),
                           group_local: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering ``fn`` as the :class:`AdvantageEstimator` ``name`` (returns ``fn`` unchanged;
    the keywords are its fields). Raises ValueError on a duplicate name or an input field the function
    does not take."""

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        params = inspect.signature(fn).parameters
        missing = [f for f in input_fields if f not in params]
        if missing:
            raise ValueError(f"advantage estimator {name!r} declares input_fields {missing} it does not take")
        ADV_ESTIMATORS.register(name, AdvantageEstimator(name, fn, needs_critic, tuple(input_fields),
                                                         tuple(roller_extras), group_local))
        return fn

    return wrap


# ---------------------------------------------------------------------------------------------------------
# helpers


def _check_inputs(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be (batch, response_len), got shape {tuple(token_level_rewards.shape)}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask has shape {tuple(response_mask.shape)} but token_level_rewards has "
            f"{tuple(token_level_rewards.shape)}"
        )
    if not token_level_rewards.is_floating_point():
        raise TypeError(f"token_level_rewards must be floating point, got {token_level_rewards.dtype}")


def group_index(uid: Sequence[Any] | torch.Tensor, batch: int) -> tuple[torch.Tensor, int]:
    """Map ``uid`` (length ``batch``) to dense group ids ``(batch,)`` int64 in order of first appearance,
    and the number of groups. Raises ValueError if the length differs from ``batch``, TypeError if an id
    is unhashable."""
    if isinstance(uid, torch.Tensor):
        if uid.dim() != 1:
            raise ValueError(f"uid must be 1-D, got a tensor of shape {tuple(uid.shape)}")
        uid = uid.tolist()
    ids = list(uid)
    if len(ids) != batch:
        raise ValueError(f"uid has {len(ids)} entries but the batch has {batch} samples")
    dense: dict[Any, int] = {}
    try:
        index = [dense.setdefault(u, len(dense)) for u in ids]
    except TypeError as exc:
        raise TypeError(f"every uid must be hashable: {exc}") from exc
    return torch.tensor(index, dtype=torch.int64), len(dense)


def _group_mean_std(
    scores: torch.Tensor, uid: Sequence[Any] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std and group size ``(batch,)`` float64 of ``scores (batch,)``.

    Size-1 groups get std 0. Float64 with a two-pass variance: identical scores give exactly 0 deviations.
    """
    index, num_groups = group_index(uid, scores.shape[0])
    index = index.to(scores.device)
    s = scores.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=s.device).index_add_(0, index, torch.ones_like(s))
    mean = torch.zeros_like(count).index_add_(0, index, s) / count
    dev = s - mean[index]
    sq = torch.zeros_like(count).index_add_(0, index, dev * dev)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
    return mean[index], var.sqrt()[index], count[index]


def _scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def _broadcast(seq_values: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(batch,)`` → ``(batch, response_len)`` on valid tokens, 0 on padding."""
    out = seq_values.to(dtype).unsqueeze(-1).expand(response_mask.shape)
    return torch.where(response_mask.bool(), out, torch.zeros((), dtype=dtype, device=out.device))


def _outcome(adv: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample advantages ``(batch,)`` on every valid token, as ``(advantages, returns)`` (equal)."""
    advantages = _broadcast(adv, response_mask, dtype)
    return advantages, advantages.clone()


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0):
    """``G_t = r_t + gamma * G_{t+1}`` over valid tokens (padding neither adds reward nor breaks the chain);
    0 on padding. ``(batch, response_len)`` in and out."""
    _check_inputs(token_level_rewards, response_mask)
    valid = response_mask.bool()
    rewards = torch.where(valid, token_level_rewards, torch.zeros_like(token_level_rewards))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(valid, returns, torch.zeros_like(returns))


# ---------------------------------------------------------------------------------------------------------
# estimators


@register_adv_estimator("gae", needs_critic=True, input_fields=(schema.VALUES,))
def gae_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", eq. 16).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``, with
    ``V_{T} = 0`` after the last valid token; masked positions are skipped (they carry the next valid
    value and advantage through). ``returns = A + V`` (the critic's target, before whitening).
    ``norm_adv_by_std``: whiten the advantages over the valid tokens of the batch (PPO practice).

    ``values``: critic values ``(batch, response_len)``. Returns ``(advantages, returns)``, both
    ``(batch, response_len)``, 0 on padding. Raises ValueError on shape mismatch.
    """
    _check_inputs(token_level_rewards, response_mask)
    if values is None or values.shape != token_level_rewards.shape:
        shape = None if values is None else tuple(values.shape)
        raise ValueError(f"gae needs values of shape {tuple(token_level_rewards.shape)}, got {shape}")
    valid = response_mask.bool()
    rewards = token_level_rewards.detach()
    values = values.detach().to(rewards.dtype)
    next_value = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        last_gae = torch.where(valid[:, t], gae, last_gae)
        advantages[:, t] = last_gae
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    returns = torch.where(valid, advantages + values, zero)
    advantages = torch.where(valid, advantages, zero)
    if norm_adv_by_std:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_adv_estimator("grpo", input_fields=(schema.UID,), group_local=True)
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    uid: Sequence[Any] | torch.Tensor,
    *,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2):
    ``A_i = (s_i - mean(s_group)) / (std(s_group) + epsilon)`` on every valid token, where ``s`` is the
    sample's score and the std is Bessel-corrected (``torch.std``). With ``norm_adv_by_std=False`` the
    division is skipped (= Dr.GRPO). A size-1 group gets 0. ``returns`` equal ``advantages``.

    Shapes: ``(batch, response_len)`` in and out; ``uid`` length ``batch``.
    """
    _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards.detach(), response_mask)
    mean, std, _ = _group_mean_std(scores, uid)
    adv = scores.to(torch.float64) - mean
    if norm_adv_by_std:
        adv = adv / (std + epsilon)
    return _outcome(adv, response_mask, token_level_rewards.dtype)


@register_adv_estimator("drgrpo", input_fields=(schema.UID,), group_local=True)
def drgrpo_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", eq. 3):
    ``A_i = s_i - mean(s_group)`` — GRPO without the std division (the question-difficulty bias). Pair
    it with ``loss_agg_mode="seq-mean-token-sum-norm"`` to also remove the length bias."""
    return grpo_advantages(token_level_rewards, response_mask, uid, norm_adv_by_std=False)


@register_adv_estimator("rloo", input_fields=(schema.UID,), group_local=True)
def rloo_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics", eq. 6; Kool et al. 2019):
    ``A_i = s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean(s_group))`` for a group of ``n`` samples; a
    size-1 group gets 0. ``returns`` equal ``advantages``. Shapes as in :func:`grpo_advantages`."""
    _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards.detach(), response_mask).to(torch.float64)
    mean, _, count = _group_mean_std(scores, uid)
    adv = torch.where(count > 1, (scores - mean) * count / (count - 1).clamp(min=1), torch.zeros_like(scores))
    return _outcome(adv, response_mask, token_level_rewards.dtype)


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs", eq. 4-5):
    token returns ``G_t = r_t + gamma * G_{t+1}`` (per-token KL penalties in the rewards included), then
    advantages = ``G`` whitened over all valid tokens of the **batch** (global normalisation: unlike the
    group estimators, a sample's advantage depends on the rest of the batch). Returns ``(advantages, G)``.
    """
    returns = discounted_returns(token_level_rewards.detach(), response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@register_adv_estimator("reinforce_plus_plus_baseline", input_fields=(schema.UID,))
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    uid: Sequence[Any] | torch.Tensor,
    *,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, sec. 3.2): subtract the group mean score (by ``uid``), broadcast to
    the valid tokens, then whiten over the valid tokens of the batch. ``returns`` equal ``advantages``."""
    _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards.detach(), response_mask)
    mean, _, _ = _group_mean_std(scores, uid)
    centered = _broadcast(scores.to(torch.float64) - mean, response_mask, torch.float64)
    advantages = masked_whiten(centered, response_mask, epsilon=epsilon).to(token_level_rewards.dtype)
    return advantages, advantages.clone()


@register_adv_estimator("remax", input_fields=(schema.REMAX_BASELINE,), roller_extras=(schema.REMAX_BASELINE,),
                        group_local=True)  # per sample: return-to-go minus its own baseline
def remax_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, remax_baseline: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient RL Method for LLMs", Alg. 1):
    ``A_t = G_t - b``, with ``G_t`` the undiscounted return-to-go and ``b`` the reward of the greedy
    response to the same prompt (``remax_baseline``, ``(batch,)``, produced by the rollers).
    Returns ``(advantages, G)``."""
    _check_inputs(token_level_rewards, response_mask)
    batch = token_level_rewards.shape[0]
    if remax_baseline is None or tuple(remax_baseline.shape) != (batch,):
        shape = None if remax_baseline is None else tuple(remax_baseline.shape)
        raise ValueError(f"remax needs remax_baseline of shape ({batch},), got {shape}")
    returns = discounted_returns(token_level_rewards.detach(), response_mask, 1.0)
    baseline = remax_baseline.detach().to(returns.dtype).unsqueeze(-1)
    advantages = torch.where(response_mask.bool(), returns - baseline, torch.zeros_like(returns))
    return advantages, returns


@register_adv_estimator("grpo_passk", input_fields=(schema.UID,), group_local=True)
def grpo_passk_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    uid: Sequence[Any] | torch.Tensor,
    *,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantages (Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using
    Reinforcement Learning", arXiv:2503.19595; verl ``grpo_passk``): in each group only the best sample gets
    a non-zero advantage, ``s_max - s_second_max`` (divided by ``std(s_group) + epsilon``, Bessel-corrected,
    when ``norm_adv_by_std``); the others get 0. Ties at the top give 0 to everyone. A size-1 group gets 0
    (verl raises). ``returns`` equal ``advantages``. Shapes as in :func:`grpo_advantages`."""
    _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards.detach(), response_mask).to(torch.float64)
    index, num_groups = group_index(uid, scores.shape[0])
    _, std, _ = _group_mean_std(scores, uid)
    adv = torch.zeros_like(scores)
    for g in range(num_groups):
        members = (index == g).nonzero().flatten().to(scores.device)
        if members.numel() < 2:
            continue
        top = torch.topk(scores[members], 2)
        best = members[top.indices[0]]
        gap = top.values[0] - top.values[1]
        adv[best] = gap / (std[best] + epsilon) if norm_adv_by_std else gap
    return _outcome(adv, response_mask, token_level_rewards.dtype)


@register_adv_estimator("opo", input_fields=(schema.UID,), group_local=True)
def opo_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585): the
    length-weighted group baseline ``b = sum_j L_j s_j / sum_j L_j`` (``L_j`` = valid tokens of sample j),
    ``A_i = s_i - b``. A size-1 group gets 0. ``returns`` equal ``advantages``. Shapes as in
    :func:`grpo_advantages`."""
    _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards.detach(), response_mask).to(torch.float64)
    lengths = response_mask.to(torch.float64).sum(dim=-1)
    index, num_groups = group_index(uid, scores.shape[0])
    index = index.to(scores.device)
    weighted = torch.zeros(num_groups, dtype=torch.float64, device=scores.device).index_add_(0, index, lengths * scores)
    total = torch.zeros_like(weighted).index_add_(0, index, lengths)
    count = torch.zeros_like(weighted).index_add_(0, index, torch.ones_like(scores))
    baseline = (weighted / total.clamp(min=1))[index]
    adv = torch.where(count[index] > 1, scores - baseline, torch.zeros_like(scores))
    return _outcome(adv, response_mask, token_level_rewards.dtype)


@register_adv_estimator("gpg", input_fields=(schema.UID,))
def gpg_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning",
    arXiv:2504.02546, with verl's ``F_norm = 1``): ``A_i = alpha * (s_i - mean(s_group))`` with the
    batch correction ``alpha = B / M``, ``B`` the samples of the batch and ``M`` those with a non-zero score
    (verl's count; at least 1). Batch-level like REINFORCE++: computed on the whole global batch. A
    size-1 group gets 0. Pair with ``algorithm.policy_loss.name=gpg``. Shapes as in :func:`grpo_advantages`."""
    _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards.detach(), response_mask).to(torch.float64)
    mean, _, count = _group_mean_std(scores, uid)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores).item()), 1)
    adv = torch.where(count > 1, alpha * (scores - mean), torch.zeros_like(scores))
    return _outcome(adv, response_mask, token_level_rewards.dtype)


# ---------------------------------------------------------------------------------------------------------
# dispatch


def compute_advantages(
    estimator: str | AdvantageEstimator,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    **inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``estimator`` (a plug-in, or a name / ``module:name`` of ``ADV_ESTIMATORS``, i.e.
    ``algorithm.adv_estimator``) and return ``(advantages, returns)``, both ``(batch, response_len)``, 0 on
    padding, no gradient.

    ``inputs``: batch fields by schema name (``uid``, ``values``, ``remax_baseline``, ...); the estimator
    receives those in its ``input_fields`` (others are ignored) and the hyper-parameters its function
    declares: ``gamma`` (gae, reinforce_plus_plus), ``lam`` (gae), ``norm_adv_by_std`` (grpo, grpo_passk:
    divide by the group std; gae: whiten over the batch), ``epsilon`` (std floors). Raises ValueError for
    an unknown estimator or a missing (None) input field.
    """
    plugin = estimator if isinstance(estimator, AdvantageEstimator) else ADV_ESTIMATORS.get(estimator)
    for name in plugin.input_fields:
        if inputs.get(name) is None:
            raise ValueError(f"advantage estimator {plugin.name!r} needs {name}, got None")
    hyper = {"gamma": gamma, "lam": lam, "norm_adv_by_std": norm_adv_by_std, "epsilon": epsilon}
    params = inspect.signature(plugin.fn).parameters
    kwargs = {name: inputs[name] for name in plugin.input_fields}
    kwargs.update({name: value for name, value in hyper.items() if name in params})
    with torch.no_grad():
        return plugin.fn(token_level_rewards, response_mask, **kwargs)
