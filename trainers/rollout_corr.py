"""Where a step's ``old_log_probs`` come from, and the rollout-vs-trainer log-prob mismatch metrics.

Three sources, chosen per step by the trainer (``TrainerWorker.train_step``):

* **recompute** (the default): one extra forward of the policy before the update, as verl and TRL do.
* **current** (skipped forward, automatic): when ``old_log_probs`` provably equal the log-probs of the
  first training forward, the loss takes those, detached, as ``old_log_probs`` and the extra forward is
  skipped. That holds when every sample was generated with exactly the weights the trainer holds (every
  sample's ``min_weight_version`` and ``max_weight_version`` equal the trainer's ``weight_version``:
  ``sync``, or ``fully-async`` at staleness 0), the step makes one optimizer step (``trainer.ppo_epochs``
  = 1 and one mini-batch), and nothing reads ``old_log_probs`` before the update (no
  ``algorithm.use_kl_in_reward``): :func:`can_skip_old_forward`. The PPO ratio is then exactly 1 in value
  and its gradient is the policy-gradient term's, as with recomputed log-probs up to float rounding.
* **rollout** (``algorithm.bypass_mode=true``, verl's ``algorithm.rollout_correction.bypass_mode``): the
  rollers' ``rollout_log_probs`` are ``old_log_probs`` (the PPO anchor is the behaviour policy; Liu, Li et
  al. 2025, "When Speed Kills Stability"), no extra forward in any mode.

``bypass_mode`` left unset (``null``) is chosen per mode (:func:`resolve_bypass_mode`): **rollout** where
trained samples can come from older weights (``one-step-off``; ``fully-async`` with ``max_staleness >= 1``)
and no ``stale_correction`` is asked for. There the recomputed anchor would be the trainer's current weights,
which with ``stale_correction=none`` corrects nothing for the lag, costs one forward per step (~25% of an
update here, bench/README.md), and clips nothing on the first mini-batch; the behaviour policy is PPO's own
anchor for data from an older policy (Schulman et al. 2017) and verl's choice for one-step-off. **recompute**
in ``sync`` and ``fully-async`` at staleness 0 (exact, and skipped anyway when on-policy with one mini-batch)
and wherever a ``stale_correction`` needs the trainer's log-probs.

Mismatch metrics, whenever a batch has ``rollout_log_probs`` and the trainer has log-probs of the same
samples under its weights before the update (recomputed ``old_log_probs``, else the first mini-batch's
training forward): ``rollout_corr/kl`` = mean over response tokens of ``rollout - trainer`` (k1 estimate of
KL(pi_rollout || pi_trainer), samples drawn from the rollout), ``rollout_corr/k3_kl`` = mean of
``r - 1 - log r`` with ``r = pi_trainer / pi_rollout`` (Schulman 2020, "Approximating KL divergence"),
``rollout_corr/max_abs_diff`` = max ``|trainer - rollout|``, ``rollout_corr/num_tokens``. The names follow
verl's ``compute_offpolicy_metrics``. With stale samples they include the policy lag as well as the
engine mismatch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common import schema
from trainers import collectives
from trainers.config import AlgorithmConfig

_MAX_LOG_RATIO = 20.0  # as trainers.losses: exp of a log-ratio beyond this would overflow float32


def is_on_policy(tags: Iterable[Mapping], weight_version: int) -> bool:
    """True when every sample tag's ``min_weight_version`` and ``max_weight_version`` equal
    ``weight_version`` (the whole response came from exactly these weights). Raises KeyError naming the
    tag when a sample lacks one."""
    return all(int(t[schema.MIN_WEIGHT_VERSION]) == weight_version == int(t[schema.MAX_WEIGHT_VERSION])
               for t in tags)


def resolve_bypass_mode(can_be_stale: bool, algorithm: AlgorithmConfig) -> bool:
    """``algorithm.bypass_mode`` when the user set it; when unset (``None``), true for a schedule whose
    trained samples ``can_be_stale`` (the schedule's declaration: ``one-step-off``; ``fully-async`` with
    ``max_staleness >= 1``) with ``stale_correction == "none"``, false otherwise (see the module docstring)."""
    if algorithm.bypass_mode is not None:
        return algorithm.bypass_mode
    return can_be_stale and algorithm.stale_correction == "none"


def can_skip_old_forward(algorithm: AlgorithmConfig, *, ppo_epochs: int, num_mini_batches: int,
                         on_policy: bool) -> bool:
    """Whether ``old_log_probs`` equal the first training forward's log-probs (see the module docstring):
    not ``bypass_mode`` (no forward to skip), ``on_policy``, one epoch of one mini-batch, and no
    ``use_kl_in_reward`` (which reads them before the update)."""
    return (not algorithm.bypass_mode and on_policy and ppo_epochs == 1 and num_mini_batches == 1
            and not algorithm.use_kl_in_reward)


@dataclass
class MismatchSums:
    """This rank's sums of the mismatch metrics; :meth:`finish` reduces them over ranks."""

    k1_sum: float = 0.0
    k3_sum: float = 0.0
    max_abs_diff: float = 0.0
    num_tokens: float = 0.0

    def add(self, trainer_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
            response_mask: torch.Tensor) -> None:
        """Add the valid tokens of one (micro-)batch; tensors ``(batch, response_len)``, log-probs in nats.
        Raises ValueError on a shape mismatch."""
        if trainer_log_probs.shape != rollout_log_probs.shape or trainer_log_probs.shape != response_mask.shape:
            raise ValueError(f"trainer log-probs {tuple(trainer_log_probs.shape)}, rollout log-probs "
                             f"{tuple(rollout_log_probs.shape)} and response_mask {tuple(response_mask.shape)} "
                             "must have the same shape")
        mask = response_mask.bool()
        trainer = trainer_log_probs.detach().double()[mask]
        rollout = rollout_log_probs.detach().to(trainer.device).double()[mask.to(trainer.device)]
        if trainer.numel() == 0:
            return
        log_ratio = (trainer - rollout).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        self.k1_sum += float((-log_ratio).sum())
        self.k3_sum += float((torch.exp(log_ratio) - 1.0 - log_ratio).sum())
        self.max_abs_diff = max(self.max_abs_diff, float((trainer - rollout).abs().max()))
        self.num_tokens += trainer.numel()

    def finish(self) -> dict[str, float]:
        """``rollout_corr/*`` over every rank's tokens (0 each with no token). Collective."""
        k1, k3, count = collectives.all_reduce([self.k1_sum, self.k3_sum, self.num_tokens])
        high = collectives.all_reduce([self.max_abs_diff], dist.ReduceOp.MAX)[0]
        return {"rollout_corr/kl": k1 / max(count, 1.0), "rollout_corr/k3_kl": k3 / max(count, 1.0),
                "rollout_corr/max_abs_diff": high, "rollout_corr/num_tokens": count}
