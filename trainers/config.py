"""Config sections owned by the trainers: ``trainer`` (the pool and optimisation) and ``algorithm``."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from common.env import AUTO_THREADS, LOOPBACK, check_num_threads, check_ray_resources
from common.net import check_bind_host
from common.settings import check_settings, setting
from trainers.advantages import ADV_ESTIMATORS
from trainers.kl import KL_ESTIMATORS
from trainers.losses import LOSS_AGG_MODES
from trainers.policy_losses import POLICY_LOSSES, PolicyLossConfig, PolicyLossParams, VanillaConfig

logger = logging.getLogger(__name__)
_SHARED = PolicyLossParams()  # the defaults of the settings policy losses share

# Flat spellings from before each policy loss owned its settings (``algorithm.policy_loss: {name: ...}``):
# refused, naming the key that replaced each, never read.
MOVED_KEYS = {
    "algorithm.dual_clip_c": "algorithm.policy_loss.dual_clip_c (with algorithm.policy_loss.name=vanilla)",
    "algorithm.sapo_tau_pos": "algorithm.policy_loss.tau_pos (with algorithm.policy_loss.name=sapo)",
    "algorithm.sapo_tau_neg": "algorithm.policy_loss.tau_neg (with algorithm.policy_loss.name=sapo)",
    "algorithm.clip_cov_ratio": "algorithm.policy_loss.ratio (with algorithm.policy_loss.name=clip_cov)",
    "algorithm.clip_cov_lb": "algorithm.policy_loss.lb (with algorithm.policy_loss.name=clip_cov)",
    "algorithm.clip_cov_ub": "algorithm.policy_loss.ub (with algorithm.policy_loss.name=clip_cov)",
    "algorithm.kl_cov_ratio": "algorithm.policy_loss.ratio (with algorithm.policy_loss.name=kl_cov)",
    "algorithm.kl_cov_coef": "algorithm.policy_loss.coef (with algorithm.policy_loss.name=kl_cov)",
    "algorithm.dppo_ratio_cap": "algorithm.policy_loss.ratio_cap (with algorithm.policy_loss.name=dppo_tv or dppo_kl)",
}

STALE_CORRECTIONS = ("none", "decoupled", "tis")
STALE_POLICIES = ("drop", "keep")
KL_CTRL_TYPES = ("fixed", "adaptive")
LR_SCHEDULES = ("constant", "cosine")
TRAINER_DEVICES = ("auto", "cpu", "cuda")


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

    num_ranks: int = setting(1, ge=1, doc="FSDP2 trainer processes (data parallel)")
    total_steps: int = setting(10, ge=1, doc="trainer steps (updates) the run makes, then it stops")
    ppo_mini_batch_size: int = setting(
        4, ge=1, doc="prompts per optimizer step (x rollout.n samples); <= data.train_batch_size")
    ppo_micro_batch_size: int = setting(
        8, ge=1, doc="samples per forward/backward pass (gradient accumulation inside a mini-batch)")
    ppo_max_token_len_per_gpu: int = setting(
        0, ge=0, doc="tokens per pass per rank (samples x longest), 0 = off: verl's dynamic batch size")
    prefix_grouper: bool = setting(
        True, doc="forward each prompt once for all its samples (shared-prefix mask, same results)")
    ppo_epochs: int = setting(1, ge=1, doc="passes over each step's batch")
    lr: float = setting(1e-5, gt=0, doc="policy learning rate (AdamW)")
    weight_decay: float = setting(0.0, ge=0, doc="AdamW weight decay")
    betas: tuple[float, float] = setting((0.9, 0.999), doc="AdamW betas")
    lr_schedule: str = setting(
        "constant", choices=LR_SCHEDULES, doc="learning-rate schedule after trainer.warmup_steps")
    warmup_steps: int = setting(0, ge=0, doc="linear learning-rate warm-up, in trainer steps")
    max_grad_norm: float = setting(1.0, gt=0, doc="gradient clipping by global norm")
    save_every: int = setting(
        0, ge=0,
        doc="job checkpoint (for --resume RUN_DIR) every N steps, at a stop and at the end; 0 = never")
    keep_checkpoints: int = setting(0, ge=0, doc="job checkpoints kept (the latest); 0 = all")
    max_restarts: int = setting(
        0, ge=0, doc="restarts of the trainer group alone from the latest job checkpoint; 0 = fail")
    val_every: int = setting(
        0, ge=0,
        doc="validate every N trainer steps (also before the first and after the "
            "last); 0 = only those two")
    num_threads: int | str = setting(
        AUTO_THREADS,
        doc="torch threads per trainer rank (the most: fully-async core lending "
            "yields decoding rollers' cores)")
    use_reference: bool = setting(
        False, doc="keep a frozen reference policy (needed by KL loss or KL in reward)")
    critic_lr: float = setting(1e-5, gt=0, doc="the critic's learning rate (adv_estimator=gae only)")
    device: str = setting(
        "auto", choices=TRAINER_DEVICES, doc="where ranks run; auto: cuda when each rank has a GPU")
    num_cpus_per_rank: float = setting(1.0, gt=0, doc="Ray logical CPUs reserved per trainer rank")
    timeout_s: float = setting(
        1800.0, gt=0, doc="bound in seconds on every collective and every call the controller waits for")
    resources: dict[str, float] = setting(
        factory=dict, doc="Ray custom resources each trainer rank asks for, e.g. {hflow_trainer: 1}")
    host: str = setting(
        LOOPBACK,
        doc="rendezvous address when ranks span Ray nodes: IPv4 of rank 0's node | "
            "node (its Ray address)")

    def __post_init__(self):
        check_settings(self, "trainer")
        check_ray_resources("trainer.resources", self.resources)
        check_bind_host("trainer.host", self.host)
        check_num_threads("trainer.num_threads", self.num_threads)
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"trainer.betas must both be in [0, 1) (Adam's moment decay rates), got {self.betas}")


@dataclass
class AlgorithmConfig:
    """Advantage estimator, losses, KL, and the staleness knobs of the asynchronous schedules.

    Staleness (defined in ``controller/ledger.py``): ``max_staleness`` bounds trainer version − a sample's
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
    ``loss_agg_mode`` (``trainers/losses.py``), ``kl_estimator`` / ``kl_in_reward_estimator``
    (``trainers/kl.py``), and the policy loss, ``policy_loss.name`` (``trainers/policy_losses.py``; default
    ``vanilla`` = clipped PPO with dual clip ``policy_loss.dual_clip_c``).

    A policy loss owns its settings: they sit beside its name, ``algorithm.policy_loss: {name: sapo, tau_pos:
    1.0, tau_neg: 1.05}`` (``algorithm.policy_loss.name=sapo algorithm.policy_loss.tau_pos=1.0`` on the command
    line), declared by the config class it registered (``POLICY_LOSSES.config(name)``); a key the chosen loss
    does not declare is an unknown key. The rule for what stays here: a setting is shared at ``algorithm.*``
    when several unrelated losses read it as the same thing — ``clip_ratio_low/high``, the bound on how far
    one update may move a token down/up (a ratio bound for vanilla, gspo, cispo and clip_cov; the same bound
    measured on the log-ratio by geo_mean and on the probability or binary KL by dppo_tv/dppo_kl), read by
    every loss in ``PolicyLossParams``; setting one the chosen loss does not read is an error. A setting one
    loss reads, or one family sharing a config class (``dppo_tv``/``dppo_kl``: ``ratio_cap``), belongs to
    that loss's config. The flat spellings of before (``algorithm.sapo_tau_pos``, a string
    ``algorithm.policy_loss=sapo``, ...) are refused with the new key (``MOVED_KEYS``).

    KL (see ``trainers/kl.py``): ``kl_estimator`` for KL-as-loss, ``kl_in_reward_estimator`` for
    KL-in-reward, whose coefficient starts at ``kl_in_reward_coef`` and is ``kl_ctrl_type`` fixed or
    adaptive (towards ``kl_target`` nats per token over ``kl_horizon`` samples, Ziegler et al. 2019).
    ``cliprange_value``: critic value clipping. DAPO (``trainers/dapo.py``, Yu et al. 2025):
    ``dynamic_sampling`` drops every group whose samples' rewards (the rollers' ``reward`` tags, before
    overlong shaping, like verl's ``filter_groups.metric=acc``) all agree and admits the next prompt of the
    data stream in its place, up to ``max_refill_rounds`` replacements per slot of the batch; a slot whose
    rounds run out trains its last group as it is (reported as padded; verl stops with an error instead).
    Run by the controller's schedules (``controller/stages.py``, stage ``refill``); replacements use
    extra prompts, so the data must hold more than ``trainer.total_steps`` batches (``data.epochs``).
    ``overlong_buffer_len`` tokens (0 = off, at most ``rollout.max_response_length``) of soft overlong
    punishment (eq. 13) scaled by ``overlong_penalty_factor``, added by the trainer to the last valid token's
    score before the advantages (``overlong/*`` metrics).
    """

    adv_estimator: str = setting(
        "grpo", doc="advantage estimator: grpo | rloo | gae | ... (README, Algorithms) | module:name")
    norm_adv_by_std: bool = setting(True, doc="GRPO: divide advantages by the group's reward std")
    gamma: float = setting(1.0, ge=0, le=1, doc="discount factor (GAE, REINFORCE++)")
    lam: float = setting(1.0, ge=0, le=1, doc="GAE lambda")
    loss_agg_mode: str = setting(
        "token-mean", doc="how token losses average: token-mean | seq-mean-token-mean | ... or module:name")
    policy_loss: PolicyLossConfig = field(default_factory=VanillaConfig)  # its name and its own settings
    clip_ratio_low: float = setting(
        0.2, ge=0, lt=1, doc="policy losses' clip: how far a token may move down (PPO: ratio >= 1 - clip_ratio_low)")
    clip_ratio_high: float = setting(
        0.2, ge=0,
        doc="policy losses' clip: how far a token may move up (PPO: ratio <= 1 + clip_ratio_high; DAPO clip-higher)")
    entropy_coeff: float = setting(0.0, ge=0, doc="weight of the entropy bonus; 0 = off")
    use_kl_loss: bool = setting(
        False, doc="add a KL(policy || reference) term to the loss (needs trainer.use_reference)")
    kl_loss_coef: float = setting(0.001, ge=0, doc="weight of the KL loss")
    kl_estimator: str = setting(
        "low_var_kl", doc="KL estimator of the KL loss: k1 | k2 | k3 | low_var_kl | mse | ... or module:name")
    use_kl_in_reward: bool = setting(
        False, doc="subtract a KL penalty from the reward (needs trainer.use_reference)")
    kl_in_reward_coef: float = setting(0.001, ge=0, doc="starting coefficient of the KL-in-reward penalty")
    kl_in_reward_estimator: str = setting("k1", doc="KL estimator of the KL-in-reward penalty")
    kl_ctrl_type: str = setting(
        "fixed", choices=KL_CTRL_TYPES, doc="KL-in-reward coefficient: fixed, or adaptive towards kl_target")
    kl_target: float = setting(0.1, gt=0, doc="adaptive KL target, nats per token")
    kl_horizon: int = setting(10000, ge=1, doc="adaptive KL horizon, in samples")
    cliprange_value: float = setting(0.5, gt=0, doc="critic value clipping (GAE only)")
    dynamic_sampling: bool = setting(
        False, doc="DAPO: replace each group whose rewards all agree by a fresh prompt")
    max_refill_rounds: int = setting(
        10, ge=1, doc="DAPO: replacements per batch slot before a zero-variance group is trained as is")
    overlong_buffer_len: int = setting(
        0, ge=0, doc="DAPO soft overlong penalty over the last N tokens before the limit; 0 = off")
    overlong_penalty_factor: float = setting(1.0, ge=0, doc="DAPO: the overlong penalty at the length limit")
    stale_correction: str = setting(
        "none", choices=STALE_CORRECTIONS, doc="off-policy correction of stale samples")
    tis_cap: float = setting(2.0, gt=0, doc="tis: cap of the truncated importance weight")
    bypass_mode: bool | None = setting(
        None,
        doc="old_log_probs: true rollers', false trainer's; null (default) true if "
            "samples can be stale, no correction")
    max_staleness: int = setting(
        1, ge=0, doc="fully-async: most versions a trained sample may lag the trainer (admission bound)")
    stale_policy: str = setting(
        "drop", choices=STALE_POLICIES,
        doc="fully-async: a group staler than max_staleness is dropped (its prompt re-issued) or kept")
    require_batches: int = setting(
        1, ge=1, doc="fully-async: train batches (of data.train_batch_size prompts) per update")
    trigger_sync_steps: int = setting(
        1, ge=1, doc="fully-async: push weights every N updates (needs max_staleness >= N - 1)")

    def __post_init__(self):
        check_settings(self, "algorithm")
        ADV_ESTIMATORS.get(self.adv_estimator)
        LOSS_AGG_MODES.get(self.loss_agg_mode)
        KL_ESTIMATORS.get(self.kl_estimator)
        KL_ESTIMATORS.get(self.kl_in_reward_estimator, key="algorithm.kl_in_reward_estimator")
        self._check_policy_loss()
        if self.max_staleness < self.trigger_sync_steps - 1:
            raise ValueError(
                f"algorithm.trigger_sync_steps={self.trigger_sync_steps} needs "
                f"algorithm.max_staleness >= {self.trigger_sync_steps - 1}, got {self.max_staleness}"
            )
        if self.bypass_mode and self.stale_correction != "none":
            raise ValueError(
                f"algorithm.bypass_mode=true takes rollout_log_probs as old_log_probs, so "
                f"algorithm.stale_correction={self.stale_correction!r} would weigh every token by "
                "pi_rollout / pi_rollout = 1; set stale_correction=none (bypass_mode already anchors the "
                "ratio at the rollout policy) or bypass_mode=false")

    def _check_policy_loss(self) -> None:
        """``policy_loss`` is a registered loss's config node, and no shared setting is changed that the loss
        does not read (it would be ignored)."""
        if not isinstance(self.policy_loss, PolicyLossConfig):
            raise ValueError(f"algorithm.policy_loss={self.policy_loss!r} is now spelled "
                             f"algorithm.policy_loss.name={self.policy_loss} (a policy loss's own settings sit "
                             "beside its name, e.g. algorithm.policy_loss.tau_pos)")
        name = self.policy_loss.name
        loss, config = POLICY_LOSSES.get(name), POLICY_LOSSES.config(name)
        if type(self.policy_loss) is not config:
            raise ValueError(f"algorithm.policy_loss holds a {type(self.policy_loss).__name__}; policy loss "
                             f"{name!r} takes a {config.__name__} (POLICY_LOSSES.config({name!r}))")
        for f in dataclasses.fields(PolicyLossParams):
            if getattr(self, f.name) != getattr(_SHARED, f.name) and f.name not in loss.reads:
                users = [n for n in POLICY_LOSSES if f.name in POLICY_LOSSES.get(n).reads]
                raise ValueError(f"algorithm.{f.name}={getattr(self, f.name)} is not used by algorithm.policy_loss."
                                 f"name={name!r} (it reads {list(loss.reads)}); it is used by {users}")
        if loss.loss_agg_mode is not None and loss.loss_agg_mode != self.loss_agg_mode:
            logger.warning("algorithm.policy_loss.name=%s aggregates the policy loss with %s (its objective); "
                           "algorithm.loss_agg_mode=%s applies to the entropy, KL and value losses",
                           name, loss.loss_agg_mode, self.loss_agg_mode)
