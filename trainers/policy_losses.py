"""Policy-loss plug-ins: the per-token surrogate of ``algorithm.policy_loss`` (verl's ``loss_mode`` names).

A :class:`PolicyLoss` turns one micro-batch's :class:`PolicyLossInputs` into :class:`PolicyLossTerms` —
the per-token loss ``(batch, response_len)`` to *minimise* and the masks its clip metrics count.
:func:`trainers.losses.policy_loss` does the rest for every plug-in alike: it picks the log-probs the
ratio is taken against (``stale_correction``), multiplies by the importance weight, aggregates with the
plug-in's ``loss_agg_mode`` (or ``algorithm.loss_agg_mode`` when the plug-in has none) and reports
metrics. Add one with ``@register_policy_loss("name", config=MyConfig)`` in any module (``module:name`` from
outside, ``common/registry.py``); ``MyConfig``, a :class:`PolicyLossConfig` subclass, declares the loss's own
settings, which the config tree nests under ``algorithm.policy_loss`` beside ``name``. The clip ratios, shared
by the losses that bound a token's move, stay at ``algorithm.clip_ratio_low/high`` (:class:`PolicyLossParams`). Each built-in cites its paper; README "Algorithms" lists them and every
deliberate difference from verl.

Notation: ``r = exp(log_ratio)`` the token ratio pi_theta / pi_base (log-ratio clamped to ±20, 0 on
padding), ``A`` the (detached) advantages, ``eps_low`` / ``eps_high`` = ``clip_ratio_low`` /
``clip_ratio_high``, ``sg`` stop-gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch

from common.registry import Registry
from common.settings import check_settings, setting
from trainers.metrics import masked_mean, masked_sum

__all__ = [
    "POLICY_LOSSES",
    "ClipCovConfig",
    "DppoConfig",
    "KlCovConfig",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "PolicyLossParams",
    "PolicyLossTerms",
    "SapoConfig",
    "VanillaConfig",
    "register_policy_loss",
]

POLICY_LOSS_KEY = "algorithm.policy_loss"


@dataclass
class PolicyLossConfig:
    """The ``algorithm.policy_loss`` node: ``name`` chooses the loss; a loss with settings of its own declares
    them in a subclass (``@register_policy_loss(name, config=MyConfig)``), nested beside ``name``
    (``algorithm.policy_loss.tau_pos``). A subclass with cross-field checks calls ``super().__post_init__()``.
    Build one for a name with ``POLICY_LOSSES.config(name)(name=name, ...)``."""

    name: str = setting("vanilla", doc="policy loss: vanilla (PPO) | gspo | sapo | ... (README, Algorithms) | "
                                       "module:name")

    def __post_init__(self):
        check_settings(self, POLICY_LOSS_KEY)

    def settings(self) -> dict:
        """This loss's own settings (every field but ``name``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name"}


@dataclass
class VanillaConfig(PolicyLossConfig):
    """``vanilla``: dual-clip PPO's bound on negative-advantage tokens (Ye et al. 2020, eq. 5)."""

    dual_clip_c: float = setting(0.0, doc="dual-clip PPO constant for negative advantages; 0 = off, else > 1")

    def __post_init__(self):
        super().__post_init__()
        if self.dual_clip_c != 0 and not self.dual_clip_c > 1:
            raise ValueError(f"{POLICY_LOSS_KEY}.dual_clip_c must be 0 (off) or > 1, got {self.dual_clip_c}")


@dataclass
class SapoConfig(PolicyLossConfig):
    """``sapo``: the gate temperatures."""

    tau_pos: float = setting(1.0, gt=0, doc="sapo: gate temperature for positive advantages")
    tau_neg: float = setting(1.05, gt=0, doc="sapo: gate temperature for negative advantages")


@dataclass
class ClipCovConfig(PolicyLossConfig):
    """``clip_cov``: the share of tokens detached and the covariance window they are drawn from."""

    ratio: float = setting(2e-4, gt=0, le=1, doc="clip_cov: fraction of tokens whose gradient is detached")
    lb: float = setting(1.0, doc="clip_cov: lower bound of the covariance window")
    ub: float = setting(5.0, doc="clip_cov: upper bound of the covariance window")

    def __post_init__(self):
        super().__post_init__()
        if not self.lb < self.ub:
            raise ValueError(f"{POLICY_LOSS_KEY}.lb={self.lb} must be < {POLICY_LOSS_KEY}.ub={self.ub}")


@dataclass
class KlCovConfig(PolicyLossConfig):
    """``kl_cov``: the share of tokens penalised and the penalty."""

    ratio: float = setting(2e-4, gt=0, le=1, doc="kl_cov: fraction of tokens penalised")
    coef: float = setting(0.1, ge=0, doc="kl_cov: coefficient of the penalty")


@dataclass
class DppoConfig(PolicyLossConfig):
    """``dppo_tv`` / ``dppo_kl``: the truncation of the importance ratio."""

    ratio_cap: float = setting(20.0, gt=0, doc="dppo_tv / dppo_kl: truncation of the importance ratio")


@dataclass(frozen=True)
class PolicyLossParams:
    """The settings several policy losses share, from ``algorithm.*`` (same names, same meaning): the clip
    ratios bounding how far one update may move a token (``AlgorithmConfig``'s docstring: the rule)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    @classmethod
    def from_config(cls, algorithm) -> PolicyLossParams:
        """The fields of an ``AlgorithmConfig`` (or any object with these attributes)."""
        return cls(**{f.name: getattr(algorithm, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class PolicyLossInputs:
    """One micro-batch, all ``(batch, response_len)``: ``log_probs`` (differentiable, 0 on padding),
    ``base_log_probs`` (detached, the ratio's denominator), ``log_ratio`` = ``log_probs - base_log_probs``
    clamped to ±20 (0 on padding), ``advantages`` (detached), ``mask`` (bool, valid tokens)."""

    log_probs: torch.Tensor
    base_log_probs: torch.Tensor
    log_ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class PolicyLossTerms:
    """``loss_mat``: per-token loss ``(batch, response_len)``; ``clipped`` / ``clipped_lower``: bool masks of
    the tokens counted by ``pg_clipfrac`` / ``pg_clipfrac_lower`` (None = no such token)."""

    loss_mat: torch.Tensor
    clipped: torch.Tensor | None = None
    clipped_lower: torch.Tensor | None = None


PolicyLossFn = Callable[[PolicyLossInputs, PolicyLossParams, Any], PolicyLossTerms]


@dataclass(frozen=True)
class PolicyLoss:
    """A policy-loss plug-in: ``fn(inputs, params, config) -> terms`` with the shared ``params`` and its own
    ``config`` (an instance of ``config``, a :class:`PolicyLossConfig` subclass, or the base class for a loss
    without settings); ``loss_agg_mode``: the aggregation its objective defines (e.g. GSPO's per-sequence
    mean), or None to use ``algorithm.loss_agg_mode``; ``reads``: the shared :class:`PolicyLossParams` fields
    it uses (config rejects a non-default value of one it does not read, which would be ignored)."""

    name: str
    fn: PolicyLossFn
    config: type[PolicyLossConfig] = PolicyLossConfig
    loss_agg_mode: str | None = None
    reads: tuple[str, ...] = ()


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", f"{POLICY_LOSS_KEY}.name")


def register_policy_loss(name: str, *, config: type[PolicyLossConfig] = PolicyLossConfig,
                         loss_agg_mode: str | None = None,
                         reads: tuple[str, ...] = ()) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering ``fn`` as the :class:`PolicyLoss` ``name`` with its settings class ``config``;
    raises ValueError on a duplicate, a ``config`` that is not a :class:`PolicyLossConfig` dataclass, or a
    ``reads`` entry that is not a :class:`PolicyLossParams` field."""
    unknown = sorted(set(reads) - {f.name for f in fields(PolicyLossParams)})
    if unknown:
        raise ValueError(f"policy loss {name!r} reads unknown shared parameters {unknown}; its own settings go in "
                         "its config class")
    if not (isinstance(config, type) and issubclass(config, PolicyLossConfig) and is_dataclass(config)):
        raise ValueError(f"policy loss {name!r}: config={config!r} must be a dataclass subclassing PolicyLossConfig")

    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.register(name, PolicyLoss(name, fn, config, loss_agg_mode, tuple(reads)), config=config)
        return fn

    return wrap


_CLIP = ("clip_ratio_low", "clip_ratio_high")


def _clip_terms(adv: torch.Tensor, ratio: torch.Tensor, p: PolicyLossParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and where the clipped term was taken."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over valid tokens ``(batch,)``; 0 for a sequence with none."""
    return masked_sum(values, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)


@register_policy_loss("vanilla", config=VanillaConfig, reads=_CLIP)
def vanilla(x: PolicyLossInputs, p: PolicyLossParams, c: VanillaConfig) -> PolicyLossTerms:
    """Clipped PPO (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7) with DAPO's
    decoupled clip-higher (Yu et al. 2025, eq. 10): ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``;
    ``dual_clip_c > 1`` (0 = off) also bounds negative-advantage tokens by ``-dual_clip_c * A`` (dual-clip
    PPO, Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5)."""
    loss_mat, clipped = _clip_terms(x.advantages, torch.exp(x.log_ratio), p)
    dual_clipped = torch.zeros_like(x.mask)
    if c.dual_clip_c > 0:
        bound = -x.advantages * c.dual_clip_c
        dual_clipped = (x.advantages < 0) & (loss_mat > bound)
        loss_mat = torch.where(dual_clipped, bound, loss_mat)
    return PolicyLossTerms(loss_mat, clipped, dual_clipped)


@register_policy_loss("gspo", loss_agg_mode="seq-mean-token-mean", reads=_CLIP)
def gspo(x: PolicyLossInputs, p: PolicyLossParams, c: PolicyLossConfig) -> PolicyLossTerms:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): the
    sequence ratio ``s_i = exp(mean_t log_ratio_it)`` clipped like PPO, as the token-level GSPO-token form
    ``s_it = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))`` (log clamped at 10, as verl), averaged per
    sequence then over sequences (``seq-mean-token-mean``). Use small ``clip_ratio_low/high`` (the paper:
    3e-4 / 4e-4)."""
    seq_log_ratio = _seq_mean(x.log_ratio.detach(), x.mask).unsqueeze(-1)
    log_s = (x.log_probs - x.log_probs.detach() + seq_log_ratio).clamp(max=10.0)
    loss_mat, clipped = _clip_terms(x.advantages, torch.exp(log_s), p)
    return PolicyLossTerms(loss_mat, clipped)


@register_policy_loss("sapo", config=SapoConfig, loss_agg_mode="seq-mean-token-mean")
def sapo(x: PolicyLossInputs, p: PolicyLossParams, c: SapoConfig) -> PolicyLossTerms:
    """SAPO ("Soft Adaptive Policy Optimization", Qwen team 2025, arXiv:2511.20347): a smooth gate in place
    of the hard clip, ``l = -f(r) A`` with ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``, ``tau = tau_pos``
    where ``A > 0`` else ``tau_neg``; ``f'(1) = 1`` so at ``r = 1`` the gradient equals PPO's.
    Aggregated ``seq-mean-token-mean`` as in verl."""
    tau = torch.where(x.advantages > 0, c.tau_pos, c.tau_neg).to(x.log_ratio.dtype)
    gate = torch.sigmoid(tau * (torch.exp(x.log_ratio) - 1.0)) * (4.0 / tau)
    return PolicyLossTerms(-gate * x.advantages)


@register_policy_loss("cispo", reads=_CLIP)
def cispo(x: PolicyLossInputs, p: PolicyLossParams, c: PolicyLossConfig) -> PolicyLossTerms:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    arXiv:2506.13585): REINFORCE with a clipped, stop-gradient importance weight,
    ``l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta`` — every token keeps a gradient.
    ``pg_clipfrac`` counts tokens whose weight was clipped."""
    ratio = torch.exp(x.log_ratio)
    low, high = 1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high
    weight = ratio.clamp(low, high).detach()
    return PolicyLossTerms(-weight * x.advantages * x.log_probs, (ratio < low) | (ratio > high))


@register_policy_loss("gpg")
def gpg(x: PolicyLossInputs, p: PolicyLossParams, c: PolicyLossConfig) -> PolicyLossTerms:
    """GPG's plain policy gradient (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning
    Baseline for Model Reasoning", arXiv:2504.02546): ``l = -A * log pi_theta``, no ratio, no clip. Pair
    with ``algorithm.adv_estimator=gpg``."""
    return PolicyLossTerms(-x.advantages * x.log_probs)


@register_policy_loss("geo_mean", loss_agg_mode="seq-mean-token-mean", reads=_CLIP)
def geo_mean(x: PolicyLossInputs, p: PolicyLossParams, c: PolicyLossConfig) -> PolicyLossTerms:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673): the
    geometric mean of the token ratios, clipped token-wise in log space. With ``d = log_ratio``,
    ``sgn = sign(A)``: ``d' = sgn * min(sgn * d, sgn * clip(d, -eps_low, eps_high))``; per sequence
    ``l_i = -mean_t(A) * exp(mean_t d')`` (sequence-level advantages), the same value on each of its
    tokens, so ``seq-mean-token-mean`` gives the mean over sequences. Note ``eps`` bound the *log* ratio
    (the paper uses 0.4). ``pg_clipfrac`` / ``_lower``: clipped tokens with ``A > 0`` / ``A < 0``."""
    d = x.log_ratio
    sgn = torch.sign(x.advantages)
    d_clip = d.clamp(-p.clip_ratio_low, p.clip_ratio_high)
    d_min = sgn * torch.minimum(sgn * d, sgn * d_clip)
    seq_loss = -_seq_mean(x.advantages, x.mask) * torch.exp(_seq_mean(d_min, x.mask))
    clipped = (d != d_clip) & x.mask
    return PolicyLossTerms(seq_loss.unsqueeze(-1).expand_as(d), clipped & (x.advantages > 0),
                           clipped & (x.advantages < 0))


def _dppo_terms(x: PolicyLossInputs, c: DppoConfig, valid: torch.Tensor) -> PolicyLossTerms:
    """DPPO's loss given its trust-region mask: ``l = -A * sg(min(r, ratio_cap)) * log pi_theta`` on
    tokens inside the region, 0 outside (their gradient is dropped, not clipped)."""
    ratio = torch.exp(x.log_ratio)
    weight = ratio.clamp(max=c.ratio_cap).detach()
    valid = valid.detach()
    loss_mat = torch.where(valid, -x.advantages * weight * x.log_probs, torch.zeros_like(x.log_probs))
    return PolicyLossTerms(loss_mat, ~valid & x.mask, (ratio > c.ratio_cap) & valid)


@register_policy_loss("dppo_tv", config=DppoConfig, reads=_CLIP)
def dppo_tv(x: PolicyLossInputs, p: PolicyLossParams, c: DppoConfig) -> PolicyLossTerms:
    """DPPO-Binary-TV (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv:2602.04879): a token stays in the trust region when its probability moved by at most
    ``clip_ratio_high`` up (``A > 0``: ``p - p_old <= eps_high``) or ``clip_ratio_low`` down (``A <= 0``:
    ``p - p_old >= -eps_low``) — a bound on the binary total-variation divergence instead of the ratio;
    tokens outside lose their gradient. Loss as :func:`_dppo_terms`."""
    delta = torch.exp(x.log_probs.detach()) - torch.exp(x.base_log_probs)
    valid = torch.where(x.advantages > 0, delta <= p.clip_ratio_high, delta >= -p.clip_ratio_low)
    return _dppo_terms(x, c, valid)


@register_policy_loss("dppo_kl", config=DppoConfig, reads=_CLIP)
def dppo_kl(x: PolicyLossInputs, p: PolicyLossParams, c: DppoConfig) -> PolicyLossTerms:
    """DPPO-Binary-KL (Qi et al. 2026, arXiv:2602.04879): as :func:`dppo_tv` with the binary KL
    ``p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))`` (+1e-8 inside the second log) bounded
    by ``clip_ratio_high`` for a probability that rose under ``A > 0``, ``clip_ratio_low`` for one that fell
    under ``A <= 0`` (the paper suggests 0.05)."""
    prob, old = torch.exp(x.log_probs.detach()), torch.exp(x.base_log_probs)
    binary_kl = old * (x.base_log_probs - x.log_probs.detach()) + (1.0 - old) * torch.log(
        (1.0 - old + 1e-8) / (1.0 - prob + 1e-8))
    valid = torch.where(x.advantages > 0, (binary_kl <= p.clip_ratio_high) | (prob <= old),
                        (binary_kl <= p.clip_ratio_low) | (prob >= old))
    return _dppo_terms(x, c, valid)


def _token_covariance(x: PolicyLossInputs) -> torch.Tensor:
    """``(A - mean A) * (log pi - mean log pi)`` per token, means over the valid tokens of the micro-batch."""
    logp = x.log_probs.detach()
    return (x.advantages - masked_mean(x.advantages, x.mask)) * (logp - masked_mean(logp, x.mask))


@register_policy_loss("clip_cov", config=ClipCovConfig, reads=_CLIP)
def clip_cov(x: PolicyLossInputs, p: PolicyLossParams, c: ClipCovConfig) -> PolicyLossTerms:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv:2505.22617, sec. 4): clipped PPO, except that ``max(1, int(ratio * N))``
    tokens (``N`` valid tokens of the micro-batch), drawn at random among the unclipped tokens whose
    covariance lies in ``(lb, ub)``, lose their gradient (loss 0). The draw uses torch's
    global RNG. ``pg_clipfrac`` counts the detached tokens."""
    loss_mat, ppo_clipped = _clip_terms(x.advantages, torch.exp(x.log_ratio), p)
    cov = _token_covariance(x)
    candidates = (x.mask & ~ppo_clipped & (cov > c.lb) & (cov < c.ub)).nonzero()
    num = max(int(c.ratio * int(x.mask.sum().item())), 1)
    chosen = candidates[torch.randperm(len(candidates))[:num].to(candidates.device)]
    detached = torch.zeros_like(x.mask)
    detached[chosen[:, 0], chosen[:, 1]] = True
    return PolicyLossTerms(torch.where(detached, torch.zeros_like(loss_mat), loss_mat), detached)


@register_policy_loss("kl_cov", config=KlCovConfig)
def kl_cov(x: PolicyLossInputs, p: PolicyLossParams, c: KlCovConfig) -> PolicyLossTerms:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, sec. 4): the unclipped surrogate ``-A r`` on every token,
    plus ``coef * |log r|`` on the ``max(1, int(ratio * N))`` valid tokens of the
    micro-batch with the largest covariance. ``pg_clipfrac`` counts
    the penalised tokens."""
    loss_mat = -x.advantages * torch.exp(x.log_ratio)
    num_valid = int(x.mask.sum().item())
    penalised = torch.zeros_like(x.mask)
    if num_valid:
        cov = torch.where(x.mask, _token_covariance(x), torch.full_like(loss_mat, -torch.inf))
        num = max(int(c.ratio * num_valid), 1)
        top = torch.topk(cov.flatten(), num, sorted=True, largest=True).indices
        penalised.view(-1)[top] = True
        loss_mat = torch.where(penalised, loss_mat + c.coef * x.log_ratio.abs(), loss_mat)
    return PolicyLossTerms(loss_mat, penalised)
