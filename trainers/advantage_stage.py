"""The advantage stage of one trainer rank (``TrainerWorker.compute_advantages``): reward shaping, the
advantage estimator, and their metrics, on this rank's rows or on the gathered global batch.

::

    every rank ── all_gather: one 8-byte hash per uid group it holds ──> is any uid group on two ranks?
      estimator.group_local and no group split         otherwise
        rewards + estimator on the rank's own rows        all_gather every input (rows in rank order),
        batch metrics from all-reduced sums               rewards + estimator on the global batch,
                                                          this rank's rows kept

A group-local estimator (``AdvantageEstimator.group_local``: GRPO, Dr.GRPO, RLOO, GRPO pass@k, OPO, ReMax)
gives a sample the same advantage whichever rows it sees, as long as its whole ``uid`` group is among them.
``TrainerGroup.train_step`` deals whole groups to ranks (``trainers.batching.shard_for_ranks`` never splits
one), so in a run these never gather the batch. Estimators with a batch-wide statistic (GAE's and
REINFORCE++(-baseline)'s whitening, GPG's batch correction) and batches whose groups a caller split across
ranks take the gathered path, which does not depend on how the batch was sharded.

Reward shaping is per sample — DAPO's overlong penalty (Yu et al. 2025, eq. 13) and the KL penalty at the
current coefficient (Ziegler et al. 2019, eq. 2) — and its metrics are batch means: on the local path each
rank all-reduces its sums, so every rank reports, and the adaptive KL controller moves by, the global value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common import schema
from trainers import collectives
from trainers.advantages import AdvantageEstimator, compute_advantages
from trainers.batching import batch_size
from trainers.config import AlgorithmConfig
from trainers.dapo import apply_overlong_penalty
from trainers.kl import apply_kl_in_reward
from trainers.metrics import masked_stats
from trainers.update import require_fields

# What every estimator reads, besides its own input_fields.
ADVANTAGE_FIELDS = schema.COMPUTE_ADVANTAGES.reads


def advantage_inputs(estimator: AdvantageEstimator, algorithm: AlgorithmConfig) -> tuple[str, ...]:
    """The batch fields the stage reads: ``ADVANTAGE_FIELDS``, the estimator's ``input_fields`` and, with
    ``algorithm.use_kl_in_reward``, ``old_log_probs`` and ``ref_log_prob``."""
    inputs = tuple(f for f in estimator.input_fields if f not in ADVANTAGE_FIELDS)
    kl = (schema.OLD_LOG_PROBS, schema.REF_LOG_PROB) if algorithm.use_kl_in_reward else ()
    return ADVANTAGE_FIELDS + inputs + kl


@dataclass
class _Rows:
    """The rows the estimator sees: ``fields`` (tensors batch first, ``uid`` a list of str), this rank's
    rows among them (``own``), and whether they are this rank's alone (``local``: batch metrics need an
    all-reduce)."""

    fields: dict[str, Any]
    own: slice
    local: bool


def _local_rows(batch: dict, needed: tuple[str, ...]) -> _Rows:
    fields = {k: batch[k].cpu() for k in needed if k != schema.UID}
    fields[schema.UID] = [str(u) for u in batch[schema.UID]]
    return _Rows(fields, slice(0, len(fields[schema.UID])), local=True)


def _gathered_rows(batch: dict, needed: tuple[str, ...], rank: int) -> _Rows:
    num_local = batch_size(batch)
    fields = {k: collectives.all_gather_rows(batch[k].cpu()) for k in needed if k != schema.UID}
    fields[schema.UID] = collectives.all_gather_strings([str(u) for u in batch[schema.UID]])
    offset = int(collectives.all_gather_rows(torch.tensor([num_local]))[:rank].sum().item())
    return _Rows(fields, slice(offset, offset + num_local), local=False)


def _batch_means(means: dict[str, float], weight: float, local: bool) -> dict[str, float]:
    """``means`` over this rank's rows, each weighted by ``weight`` (what it averages over), as means over
    the global batch: all-reduced sums on the local path, unchanged on the gathered one. Collective when
    ``local``."""
    if not local:
        return dict(means)
    *sums, total = collectives.all_reduce([v * weight if weight else 0.0 for v in means.values()] + [weight])
    return {k: s / total if total else 0.0 for k, s in zip(means, sums, strict=True)}


def _shaped_rewards(rows: _Rows, algorithm: AlgorithmConfig, kl_controller,
                    max_response_length: int | None) -> tuple[torch.Tensor, dict[str, float]]:
    """``token_level_rewards`` ``(rows, response_len)`` fp32: scores, plus DAPO's overlong penalty with
    ``overlong_buffer_len`` > 0, minus the KL penalty with ``use_kl_in_reward`` (then the KL controller is
    updated with the global batch's KL); and their ``overlong/*``, ``kl_in_reward/*`` metrics."""
    f = rows.fields
    mask = f[schema.RESPONSE_MASK]
    rewards = f[schema.TOKEN_LEVEL_SCORES].to(torch.float32, copy=True)  # never a view of the batch's scores
    num_samples = float(mask.shape[0])
    metrics: dict[str, float] = {}
    if algorithm.overlong_buffer_len > 0:  # DAPO eq. 13, on the sequence's last valid token
        rewards, overlong = apply_overlong_penalty(
            rewards, mask, max_response_length=max_response_length,
            overlong_buffer_len=algorithm.overlong_buffer_len, penalty_factor=algorithm.overlong_penalty_factor)
        metrics.update(_batch_means(overlong, num_samples, rows.local))
    if algorithm.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_in_reward(
            rewards, f[schema.OLD_LOG_PROBS], f[schema.REF_LOG_PROB], mask,
            kl_coef=kl_controller.value, estimator=algorithm.kl_in_reward_estimator)
        num_seqs = float(mask.bool().any(dim=-1).sum().item())  # kl_in_reward/kl averages over these
        metrics.update(kl_metrics)
        metrics.update(_batch_means({"kl_in_reward/kl": kl_metrics["kl_in_reward/kl"]}, num_seqs, rows.local))
        global_samples = collectives.all_reduce([num_samples])[0] if rows.local else num_samples
        kl_controller.update(metrics["kl_in_reward/kl"], num_samples=int(global_samples))
    return rewards, metrics


def compute_rank_advantages(batch: dict[str, Any], *, estimator: AdvantageEstimator, algorithm: AlgorithmConfig,
                            kl_controller, max_response_length: int | None,
                            rank: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``token_level_rewards``, ``advantages`` and ``returns`` ``(batch, response_len)`` for this rank's
    samples, and the metrics (``advantages/*``, ``returns/*``: mean, max, min over the global batch's
    valid tokens; ``overlong/*``, ``kl_in_reward/*`` with those options), equal on every rank.

    ``batch``: this rank's rows (a plain dict) with ``advantage_inputs(estimator, algorithm)``;
    ``kl_controller``: the worker's (``trainers.kl.make_kl_controller``), updated once per call with
    ``use_kl_in_reward``; ``max_response_length``: DAPO's ``L_max`` in tokens; ``rank``: this rank's
    index. Local or gathered path: see the module docstring. Raises ValueError naming missing fields (before
    any collective). Collective.
    """
    needed = advantage_inputs(estimator, algorithm)
    require_fields(batch, needed, "compute_advantages")
    local = estimator.group_local and collectives.uid_groups_rank_local([str(u) for u in batch[schema.UID]])
    rows = _local_rows(batch, needed) if local else _gathered_rows(batch, needed, rank)
    rewards, metrics = _shaped_rewards(rows, algorithm, kl_controller, max_response_length)
    mask = rows.fields[schema.RESPONSE_MASK]
    if rewards.shape[0] == 0:  # a rank without samples (a mini-batch with fewer groups than ranks)
        advantages, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
    else:
        inputs = {f: rows.fields[f] for f in estimator.input_fields if f not in ADVANTAGE_FIELDS}
        advantages, returns = compute_advantages(
            estimator, token_level_rewards=rewards, response_mask=mask, gamma=algorithm.gamma, lam=algorithm.lam,
            norm_adv_by_std=algorithm.norm_adv_by_std, uid=rows.fields[schema.UID], **inputs)
    stats = collectives.global_masked_stats if rows.local else masked_stats
    metrics.update(stats(advantages, mask, "advantages"))
    metrics.update(stats(returns, mask, "returns"))
    own = rows.own
    return {schema.TOKEN_LEVEL_REWARDS: rewards[own], schema.ADVANTAGES: advantages[own],
            schema.RETURNS: returns[own]}, metrics
