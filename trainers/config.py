"""Config sections owned by the trainers: ``trainer`` (the pool and optimisation) and ``algorithm``."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from common.env import AUTO_THREADS, LOOPBACK, check_num_threads, check_ray_resources
from common.net import check_bind_host
from trainers.advantages import ADV_ESTIMATORS
from trainers.kl import KL_ESTIMATORS
from trainers.losses import LOSS_AGG_MODES
from trainers.policy_losses import POLICY_LOSSES, PolicyLossParams

logger = logging.getLogger(__name__)
_LOSS = PolicyLossParams()  # the defaults of the policy-loss knobs

STALE_CORRECTIONS = ("none", "decoupled", "tis")
STALE_POLICIES = ("drop", "keep")
KL_CTRL_TYPES = ("fixed", "adaptive")
LR_SCHEDULES = ("constant", "cosine")
TRAINER_DEVICES = ("auto", "cpu", "cuda")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r} is not one of {list(choices)}")


@dataclass
class TrainerConfig:
    """The trainer pool and optimisation.

    ``ppo_mini_batch_size`` is in prompts (× ``rollout.n`` samples inside); ``ppo_micro_batch_size`` is
    in samples; ``ppo_max_token_len_per_gpu`` (verl's dynamic batch size; 0 = off) caps a micro-batch at that
    many tokens as its forward sees them (samples × (longest prompt + longest response) after the length sort
    and padding trim, ``trainers.batching.micro_batch_plan``) besides the ``ppo_micro_batch_size`` samples;
    ``prefix_grouper``: every trainer forward computes a prompt once for all its samples in a micro-batch
    instead of once per sample (PrefixGrouper, Liu et al. 2025: a shared-prefix attention mask; same
    log-probs, values and gradients; ``trainers.batching.shared_prompt_layout``; the budget above then counts
    rows × the widest row; a micro-batch whose shared row would pass 2048 tokens,
    ``trainers.batching.SHARED_ROW_MAX_TOKENS``, takes one row per sample), false = one row per sample always;
    ``save_every`` in trainer steps (0 = never: no job checkpoint at all, neither on a stop
    signal nor at the end); ``keep_checkpoints``: how many job checkpoints are kept, the latest (0 = all);
    ``max_restarts``: times a job restarts its trainer group from the latest job checkpoint after losing a
    trainer rank, the rollers kept running (``controller.trainer_restart``; 0: the job fails, naming the
    rank); ``val_every``: validate every N steps (0 = only before the
    first step and after the last; the controller runs it, ``controller.validation``); ``num_threads``
    torch threads per rank: ``auto`` (chosen per mode by the controller, ``controller.resources.plan_threads``)
    or an integer.
    ``critic_lr``: the critic's learning rate (GAE only). ``device``: auto (cuda when the Ray cluster has a
    GPU per rank, else cpu) | cpu (gloo) | cuda (nccl, one GPU per rank). ``num_cpus_per_rank``: Ray
    logical CPUs per rank actor (fractional allowed). ``timeout_s``: bound on every collective and on
    every call the driver waits for. ``resources``: Ray custom resources each rank asks for (name ->
    amount, e.g. ``{hflow_trainer: 1}``), so ranks are placed only on the nodes started with them
    (``common.env.check_ray_resources``). ``host``: where rank 0 serves the ranks' process-group rendezvous
    when the ranks span Ray nodes (all on one node: always loopback): one IPv4 address of rank 0's node, or
    ``node`` for rank 0's Ray node address (``trainers.group.rendezvous_host``); the loopback default
    refuses ranks on several nodes with an error naming this key.
    """

    num_ranks: int = 1
    total_steps: int = 10
    ppo_mini_batch_size: int = 4
    ppo_micro_batch_size: int = 8
    ppo_max_token_len_per_gpu: int = 0
    prefix_grouper: bool = True
    ppo_epochs: int = 1
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    save_every: int = 0
    keep_checkpoints: int = 0
    max_restarts: int = 0
    val_every: int = 0
    num_threads: int | str = AUTO_THREADS
    use_reference: bool = False
    critic_lr: float = 1e-5
    device: str = "auto"
    num_cpus_per_rank: float = 1.0
    timeout_s: float = 1800.0
    resources: dict[str, float] = field(default_factory=dict)
    host: str = LOOPBACK

    def __post_init__(self):
        check_ray_resources("trainer.resources", self.resources)
        check_bind_host("trainer.host", self.host)
        check_num_threads("trainer.num_threads", self.num_threads)
        for key in ("num_ranks", "total_steps", "ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_epochs"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("lr", "critic_lr", "num_cpus_per_rank", "timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"trainer.{key} must be > 0, got {getattr(self, key)}")
        _check_choice("trainer.device", self.device, TRAINER_DEVICES)
        if self.max_grad_norm <= 0:
            raise ValueError(f"trainer.max_grad_norm must be > 0, got {self.max_grad_norm}")
        for key in ("ppo_max_token_len_per_gpu", "warmup_steps", "save_every", "keep_checkpoints", "max_restarts", "val_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"trainer.{key} must be >= 0, got {getattr(self, key)}")
        _check_choice("trainer.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"trainer.betas must both be in [0, 1) (Adam's moment decay rates), got {self.betas}")


@dataclass
class AlgorithmConfig:
    """Advantage estimator, losses, KL, and the staleness knobs of the asynchronous schedules.

    Staleness (defined in ``controller/admission.py``): ``max_staleness`` bounds trainer version − a sample's
    ``min_weight_version``; ``stale_policy`` says what happens to a group that still exceeds it;
    ``require_batches`` is how many train batches the fully-async trainer takes per update;
    ``trigger_sync_steps`` pushes weights every that many updates (needs
    ``max_staleness >= trigger_sync_steps - 1``). ``stale_correction``: none | decoupled (proximal
    log-probs) | tis (truncated importance sampling on ``rollout_log_probs``, capped at ``tis_cap``).

    ``old_log_probs`` (``trainers/rollout_corr.py``): recomputed by the trainer with one extra forward
    before the update (the default), except when they provably equal the first training forward's (every
    sample generated with the trainer's current weights, one epoch of one mini-batch, no KL-in-reward):
    that forward is then skipped automatically. ``bypass_mode=true`` (verl's name) takes the rollers'
    ``rollout_log_probs`` as ``old_log_probs`` instead: no extra forward, the PPO ratio is anchored at the
    behaviour policy (so no ``stale_correction`` is needed, and none is accepted with it). ``null`` (the
    default) is resolved per mode by :func:`trainers.rollout_corr.resolve_bypass_mode` when the config tree
    is built: true where trained samples can come from older weights, false in ``sync``.

    Plug-in names (README "Algorithms"; each validated against its registry, ``module:name`` for a plug-in
    module of your own, ``common/registry.py``): ``adv_estimator`` (``trainers/advantages.py``),
    ``policy_loss`` (``trainers/policy_losses.py``; default ``vanilla`` = clipped PPO with
    ``clip_ratio_low/high`` and dual clip ``dual_clip_c``), ``loss_agg_mode`` (``trainers/losses.py``),
    ``kl_estimator`` / ``kl_in_reward_estimator`` (``trainers/kl.py``). Knobs of single policy losses:
    ``sapo_tau_pos``/``sapo_tau_neg`` (sapo gate temperatures), ``clip_cov_ratio``/``clip_cov_lb``/
    ``clip_cov_ub`` (clip_cov: fraction of tokens detached and the covariance window),
    ``kl_cov_ratio``/``kl_cov_coef`` (kl_cov: fraction of tokens penalised and the penalty),
    ``dppo_ratio_cap`` (dppo_tv/dppo_kl: truncation of the importance ratio); setting one the chosen loss
    does not read is an error.

    KL (see ``trainers/kl.py``): ``kl_estimator`` for KL-as-loss, ``kl_in_reward_estimator`` for
    KL-in-reward, whose coefficient starts at ``kl_in_reward_coef`` and is ``kl_ctrl_type`` fixed or
    adaptive (towards ``kl_target`` nats per token over ``kl_horizon`` samples, Ziegler et al. 2019).
    ``cliprange_value``: critic value clipping. DAPO (``trainers/dapo.py``, Yu et al. 2025):
    ``dynamic_sampling`` drops every group whose samples' rewards (the rollers' ``reward`` tags, before
    overlong shaping, like verl's ``filter_groups.metric=acc``) all agree and admits the next prompt of the
    data stream in its place, up to ``max_refill_rounds`` replacements per slot of the batch; a slot whose
    rounds run out trains its last group as it is (reported as padded; verl stops with an error instead).
    Run by the controller's schedules (``controller/schedules.py``, stage ``refill``); replacements use
    extra prompts, so the data must hold more than ``trainer.total_steps`` batches (``data.epochs``).
    ``overlong_buffer_len`` tokens (0 = off, at most ``rollout.max_response_length``) of soft overlong
    punishment (eq. 13) scaled by ``overlong_penalty_factor``, added by the trainer to the last valid token's
    score before the advantages (``overlong/*`` metrics).
    """

    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    loss_agg_mode: str = "token-mean"
    policy_loss: str = "vanilla"
    # The policy losses' knobs; their defaults live in PolicyLossParams (one place).
    clip_ratio_low: float = _LOSS.clip_ratio_low
    clip_ratio_high: float = _LOSS.clip_ratio_high
    dual_clip_c: float = _LOSS.dual_clip_c
    sapo_tau_pos: float = _LOSS.sapo_tau_pos
    sapo_tau_neg: float = _LOSS.sapo_tau_neg
    clip_cov_ratio: float = _LOSS.clip_cov_ratio
    clip_cov_lb: float = _LOSS.clip_cov_lb
    clip_cov_ub: float = _LOSS.clip_cov_ub
    kl_cov_ratio: float = _LOSS.kl_cov_ratio
    kl_cov_coef: float = _LOSS.kl_cov_coef
    dppo_ratio_cap: float = _LOSS.dppo_ratio_cap
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_estimator: str = "low_var_kl"
    use_kl_in_reward: bool = False
    kl_in_reward_coef: float = 0.001
    kl_in_reward_estimator: str = "k1"
    kl_ctrl_type: str = "fixed"
    kl_target: float = 0.1
    kl_horizon: int = 10000
    cliprange_value: float = 0.5
    dynamic_sampling: bool = False
    max_refill_rounds: int = 10
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    stale_correction: str = "none"
    tis_cap: float = 2.0
    bypass_mode: bool | None = None  # None: per mode (trainers.rollout_corr.resolve_bypass_mode)
    max_staleness: int = 1
    stale_policy: str = "drop"
    require_batches: int = 1
    trigger_sync_steps: int = 1

    def __post_init__(self):
        ADV_ESTIMATORS.get(self.adv_estimator)
        LOSS_AGG_MODES.get(self.loss_agg_mode)
        KL_ESTIMATORS.get(self.kl_estimator)
        KL_ESTIMATORS.get(self.kl_in_reward_estimator, key="algorithm.kl_in_reward_estimator")
        self._check_policy_loss()
        _check_choice("algorithm.kl_ctrl_type", self.kl_ctrl_type, KL_CTRL_TYPES)
        self._check_algorithm_numbers()
        _check_choice("algorithm.stale_correction", self.stale_correction, STALE_CORRECTIONS)
        _check_choice("algorithm.stale_policy", self.stale_policy, STALE_POLICIES)
        if not 0 <= self.clip_ratio_low < 1 or self.clip_ratio_high < 0:
            raise ValueError(
                f"algorithm.clip_ratio_low must be in [0, 1) (the ratio's lower bound is 1 - clip_ratio_low) and "
                f"clip_ratio_high >= 0, got {self.clip_ratio_low}/{self.clip_ratio_high}"
            )
        if self.dual_clip_c != 0 and self.dual_clip_c <= 1:
            raise ValueError(f"algorithm.dual_clip_c must be 0 (off) or > 1, got {self.dual_clip_c}")
        if self.max_staleness < 0:
            raise ValueError(f"algorithm.max_staleness must be >= 0, got {self.max_staleness}")
        for key in ("require_batches", "trigger_sync_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"algorithm.{key} must be >= 1, got {getattr(self, key)}")
        if self.max_staleness < self.trigger_sync_steps - 1:
            raise ValueError(
                f"algorithm.trigger_sync_steps={self.trigger_sync_steps} needs "
                f"algorithm.max_staleness >= {self.trigger_sync_steps - 1}, got {self.max_staleness}"
            )
        if self.tis_cap <= 0:
            raise ValueError(f"algorithm.tis_cap must be > 0, got {self.tis_cap}")
        if self.bypass_mode and self.stale_correction != "none":
            raise ValueError(
                f"algorithm.bypass_mode=true takes rollout_log_probs as old_log_probs, so "
                f"algorithm.stale_correction={self.stale_correction!r} would weigh every token by "
                "pi_rollout / pi_rollout = 1; set stale_correction=none (bypass_mode already anchors the "
                "ratio at the rollout policy) or bypass_mode=false")

    def _check_algorithm_numbers(self) -> None:
        """KL controller, value clipping and DAPO knobs (the staleness knobs are checked above)."""
        for key in ("kl_loss_coef", "kl_in_reward_coef", "entropy_coeff", "overlong_penalty_factor"):
            if getattr(self, key) < 0:
                raise ValueError(f"algorithm.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("kl_target", "cliprange_value"):
            if getattr(self, key) <= 0:
                raise ValueError(f"algorithm.{key} must be > 0, got {getattr(self, key)}")
        for key in ("kl_horizon", "max_refill_rounds"):
            if getattr(self, key) < 1:
                raise ValueError(f"algorithm.{key} must be >= 1, got {getattr(self, key)}")
        if self.overlong_buffer_len < 0:
            raise ValueError(
                f"algorithm.overlong_buffer_len must be >= 0 (0 = no overlong shaping), got {self.overlong_buffer_len}"
            )
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError(f"algorithm.gamma and algorithm.lam must be in [0, 1], got {self.gamma}, {self.lam}")

    def _check_policy_loss(self) -> None:
        """``policy_loss`` is registered, its knobs are in range, and no knob is set that it does not read."""
        loss = POLICY_LOSSES.get(self.policy_loss)
        for key in ("sapo_tau_pos", "sapo_tau_neg", "kl_cov_coef", "dppo_ratio_cap"):
            value = getattr(self, key)
            if not value >= 0 or (value == 0 and key != "kl_cov_coef"):
                raise ValueError(f"algorithm.{key} must be {'>= 0' if key == 'kl_cov_coef' else '> 0'}, got {value}")
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"algorithm.{key} must be in (0, 1] (a fraction of tokens), got {getattr(self, key)}")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"algorithm.clip_cov_lb={self.clip_cov_lb} must be < algorithm.clip_cov_ub="
                             f"{self.clip_cov_ub}")
        for f in dataclasses.fields(PolicyLossParams):
            if getattr(self, f.name) != getattr(_LOSS, f.name) and f.name not in loss.reads:
                users = [n for n in POLICY_LOSSES if f.name in POLICY_LOSSES.get(n).reads]
                raise ValueError(f"algorithm.{f.name}={getattr(self, f.name)} is not used by algorithm.policy_loss="
                                 f"{self.policy_loss!r} (it reads {list(loss.reads)}); it is used by {users}")
        if loss.loss_agg_mode is not None and loss.loss_agg_mode != self.loss_agg_mode:
            logger.warning("algorithm.policy_loss=%s aggregates the policy loss with %s (its objective); "
                           "algorithm.loss_agg_mode=%s applies to the entropy, KL and value losses",
                           self.policy_loss, loss.loss_agg_mode, self.loss_agg_mode)
