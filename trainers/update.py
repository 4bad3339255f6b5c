"""One optimizer step of the actor or the critic on one PPO mini-batch, with gradient accumulation.

Gradient accumulation over micro-batches and data-parallel ranks (the DAPO/verl "global token" rule):
each micro-batch's loss is its *sum* over valid tokens divided by the token (or sequence) count of the
**whole global mini-batch** — all micro-batches on all ranks, from one all-reduce before the first
forward. Gradients are summed over micro-batches (``backward`` accumulates) and over ranks (FSDP2
reduce-scatter with divide factor 1), so the step equals one step on the whole mini-batch however it is
split: 1 micro-batch of 8 equals 8 of 1, and 2 ranks equal 1 rank.

Micro-batches are cut from the mini-batch in :func:`trainers.batching.length_order` (samples of similar length
together), with ``trainer.ppo_max_token_len_per_gpu`` by a token budget too (verl's dynamic batch size:
:func:`trainers.batching.micro_batch_plan`), and each is cut to its own longest sample
(:func:`trainers.batching.trim_padding`): with long-tail lengths (multi-turn trajectories) most of the
padding a batch-wide width would carry is never computed. The loss is a sum over samples, so the order
changes nothing but float rounding; only plug-in losses with micro-batch-local statistics (``clip_cov``,
``kl_cov``) see other micro-batches.

All ranks run the same number of forward/backward passes (every FSDP2 pass is collective): a rank with
fewer micro-batches runs *filler* micro-batches — a copy of one of its samples with ``response_mask`` all
zero, whose loss is exactly 0 and whose gradient is exactly 0.

A mini-batch with no valid token on any rank, or whose gradient norm is not finite, skips the optimizer
step (counted in ``*/skipped_steps``): AdamW's moments and weight decay are left untouched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from common import schema
from trainers import collectives
from trainers.batching import batch_size, micro_batch_plan, select, trim_padding
from trainers.config import AlgorithmConfig
from trainers.fsdp import response_log_probs, response_values
from trainers.kl import kl_loss
from trainers.losses import aggregate_loss, policy_loss, value_loss
from trainers.metrics import count_tokens_and_seqs, masked_sum
from trainers.policy_losses import POLICY_LOSSES
from trainers.rollout_corr import MismatchSums

ACTOR_FIELDS = schema.UPDATE_ACTOR.reads
CRITIC_FIELDS = schema.UPDATE_CRITIC.reads


def require_fields(batch: dict, fields: tuple[str, ...], method: str) -> None:
    """Raise ValueError naming every field of ``fields`` that ``batch`` lacks."""
    missing = [name for name in fields if name not in batch]
    if missing:
        raise ValueError(f"{method} needs batch fields {missing}; the batch has {sorted(batch)}")


def actor_fields(algorithm: AlgorithmConfig, old_from_current: bool = False) -> tuple[str, ...]:
    """The batch fields ``update_actor`` reads under ``algorithm`` (without ``old_log_probs`` when they
    are taken from the training forward: ``old_from_current``)."""
    base = tuple(f for f in ACTOR_FIELDS if not (old_from_current and f == schema.OLD_LOG_PROBS))
    extra = ()
    if algorithm.use_kl_loss:
        extra += (schema.REF_LOG_PROB,)
    if algorithm.stale_correction != "none":
        extra += (schema.ROLLOUT_LOG_PROBS,)
    return base + extra


def filler_sample(batch: dict) -> dict:
    """One sample of ``batch`` with ``response_mask`` all zero (when it has one): a micro-batch that
    contributes nothing to a loss; forward-only callers drop its outputs."""
    if batch_size(batch) == 0:
        raise ValueError("this rank has no sample at all; every rank needs at least one uid group")
    row = select(batch, [0])
    if schema.RESPONSE_MASK in row:
        row[schema.RESPONSE_MASK] = torch.zeros_like(row[schema.RESPONSE_MASK])
    return row


def synced_micro_batches(mini: dict | None, plan: tuple[list[int], list[slice]], filler: dict,
                         model: torch.nn.Module | None = None) -> Iterator[dict]:
    """The micro-batches of ``mini`` (``None`` = this rank has no sample in it) as ``plan`` cuts them
    (``micro_batch_plan(mini, ...)``, ``([], [])`` for ``None``), each through ``trim_padding``; then fillers
    up to the largest micro-batch count of any rank. Collective (one all-reduce).

    ``model`` (an FSDP2 model whose gradients the micro-batches accumulate): on a one-rank group its
    gradients are reduced only after the last micro-batch's backward (``set_requires_gradient_sync``), as
    the unsharded gradient is the whole one there and FSDP's per-micro-batch reduce (a flat float32 copy of
    every gradient, then added into the sharded one) is pure overhead; with mixed precision the gradients
    still accumulate in float32. With more ranks every micro-batch reduces (holding unsharded gradients
    would undo the sharding's memory saving)."""
    order, slices = plan
    total = int(collectives.all_reduce([len(slices)], dist.ReduceOp.MAX)[0])
    defer = isinstance(model, FSDPModule) and dist.get_world_size() == 1
    try:
        for i in range(total):
            if defer:
                model.set_requires_gradient_sync(i == total - 1)
            yield trim_padding(select(mini, order[slices[i]]) if i < len(slices) else filler)
    finally:
        if defer:
            model.set_requires_gradient_sync(True)


@dataclass
class StepSums:
    """Per-rank sums over one update, all-reduced at the end by :meth:`finish`."""

    token_sums: dict[str, float] = field(default_factory=dict)  # name -> this rank's sum over valid tokens
    step_sums: dict[str, float] = field(default_factory=dict)  # name -> this rank's share, summed over steps
    global_step_sums: dict[str, float] = field(default_factory=dict)  # name -> global value, summed over steps
    num_tokens: float = 0.0
    num_steps: int = 0
    skipped_steps: int = 0

    def add_tokens(self, name: str, value: float) -> None:
        self.token_sums[name] = self.token_sums.get(name, 0.0) + value

    def add_step(self, name: str, value: float) -> None:
        """Add this rank's part of a per-step quantity (summed over ranks by :meth:`finish`)."""
        self.step_sums[name] = self.step_sums.get(name, 0.0) + value

    def add_global_step(self, name: str, value: float) -> None:
        """Add a per-step quantity every rank already knows in full (e.g. the global grad norm)."""
        self.global_step_sums[name] = self.global_step_sums.get(name, 0.0) + value

    def finish(self, prefix: str) -> dict[str, float]:
        """Token metrics: global sum / global valid tokens; step metrics: global value, mean over steps.
        Collective (one all-reduce); every rank returns the same dict."""
        names = sorted(self.token_sums)
        steps = sorted(self.step_sums)
        sums = collectives.all_reduce([self.num_tokens] + [self.token_sums[n] for n in names]
                                      + [self.step_sums[n] for n in steps])
        total_tokens = sums[0]
        out = {f"{prefix}/{n}": s / max(total_tokens, 1.0) for n, s in zip(names, sums[1:], strict=False)}
        per_step = dict(zip(steps, sums[1 + len(names):], strict=True)) | self.global_step_sums
        out.update({f"{prefix}/{n}": s / max(self.num_steps, 1) for n, s in per_step.items()})
        out[f"{prefix}/num_tokens"] = total_tokens
        out[f"{prefix}/skipped_steps"] = float(self.skipped_steps)
        return out


def _clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float,
                   global_tokens: float, sums: StepSums) -> None:
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    norm = float(grad_norm.item())
    sums.num_steps += 1
    sums.add_global_step("grad_norm", norm if math.isfinite(norm) else 0.0)
    if global_tokens == 0 or not math.isfinite(norm):
        sums.skipped_steps += 1
        return
    optimizer.step()


def _global_counts(mini: dict | None) -> tuple[float, float]:
    local = count_tokens_and_seqs(mini[schema.RESPONSE_MASK]) if mini else (0, 0)
    tokens, seqs = collectives.all_reduce(local)
    return tokens, seqs


def actor_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, mini: dict | None, filler: dict,
               sums: StepSums, *, algorithm: AlgorithmConfig, temperature: float, micro_batch_size: int,
               max_grad_norm: float, norm_length: int | None, old_from_current: bool = False,
               mismatch: MismatchSums | None = None, max_token_len: int = 0, share_prompts: bool = False) -> None:
    """Accumulate the loss (``algorithm.policy_loss`` − entropy bonus + KL loss) of ``mini`` over
    micro-batches (at most ``micro_batch_size`` samples and, if > 0, ``max_token_len`` tokens each:
    ``trainers.batching.micro_batch_plan``), clip the gradient norm to ``max_grad_norm`` and step
    ``optimizer``. Adds to ``sums``. ``share_prompts`` (``trainer.prefix_grouper``): each micro-batch's
    forward computes a prompt once for all its samples (``trainers.fsdp.response_log_probs``).

    ``old_from_current``: ``old_log_probs`` are this forward's log-probs, detached (valid only when the
    policy has not stepped since the samples were generated: ``trainers.rollout_corr``); the batch then
    need not carry them. ``mismatch``: add this (pre-step) forward's log-probs against the micro-batches'
    ``rollout_log_probs`` to it. Collective."""
    optimizer.zero_grad(set_to_none=True)
    tokens, seqs = _global_counts(mini)
    agg = {"loss_agg_mode": algorithm.loss_agg_mode, "global_num_tokens": tokens, "global_num_seqs": seqs,
           "norm_length": norm_length}
    loss_mode = POLICY_LOSSES.get(algorithm.policy_loss.name)
    plan = micro_batch_plan(mini, micro_batch_size, max_token_len, share_prompts)
    for mb in synced_micro_batches(mini, plan, filler, model=policy):
        mask = mb[schema.RESPONSE_MASK]
        log_probs, entropy = response_log_probs(policy, mb, temperature, with_entropy=True,
                                                entropy_grad=algorithm.entropy_coeff > 0, share_prompts=share_prompts)
        if mismatch is not None:
            mismatch.add(log_probs, mb[schema.ROLLOUT_LOG_PROBS], mask)
        old_log_probs = log_probs.detach() if old_from_current else mb[schema.OLD_LOG_PROBS]
        loss, pg = policy_loss(
            log_probs, old_log_probs, mb[schema.ADVANTAGES], mask, loss_mode=loss_mode,
            clip_ratio_low=algorithm.clip_ratio_low, clip_ratio_high=algorithm.clip_ratio_high,
            config=algorithm.policy_loss, stale_correction=algorithm.stale_correction, tis_cap=algorithm.tis_cap,
            rollout_log_probs=mb[schema.ROLLOUT_LOG_PROBS] if algorithm.stale_correction != "none" else None,
            **agg,
        )
        sums.add_step("pg_loss", pg["pg_loss"])  # summed over micro-batches and ranks = mini-batch loss
        if algorithm.entropy_coeff > 0:
            bonus = aggregate_loss(entropy, mask, algorithm.loss_agg_mode, global_num_tokens=tokens,
                                   global_num_seqs=seqs, norm_length=norm_length)
            loss = loss - algorithm.entropy_coeff * bonus
        if algorithm.use_kl_loss:
            kl, kl_metrics = kl_loss(log_probs, mb[schema.REF_LOG_PROB], mask, estimator=algorithm.kl_estimator,
                                     **agg)
            loss = loss + algorithm.kl_loss_coef * kl
            sums.add_step("kl_loss", kl_metrics["kl_loss"])
        loss.backward()
        num = pg["num_tokens"]
        sums.num_tokens += num
        for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "ratio_mean"):
            sums.add_tokens(key, pg[key] * num)
        sums.add_tokens("entropy", masked_sum(entropy.detach(), mask).item())
    _clip_and_step(policy, optimizer, max_grad_norm, tokens, sums)


def critic_step(critic: torch.nn.Module, optimizer: torch.optim.Optimizer, mini: dict | None, filler: dict,
                sums: StepSums, *, algorithm: AlgorithmConfig, micro_batch_size: int, max_grad_norm: float,
                norm_length: int | None, max_token_len: int = 0, share_prompts: bool = False) -> None:
    """Accumulate the clipped value loss of ``mini`` (``algorithm.cliprange_value``) over micro-batches
    (cut and forwarded as in :func:`actor_step`), clip the gradient norm and step ``optimizer``. Adds to
    ``sums``. Collective."""
    optimizer.zero_grad(set_to_none=True)
    tokens, seqs = _global_counts(mini)
    plan = micro_batch_plan(mini, micro_batch_size, max_token_len, share_prompts)
    for mb in synced_micro_batches(mini, plan, filler, model=critic):
        mask = mb[schema.RESPONSE_MASK]
        values = response_values(critic, mb, share_prompts)
        loss, vf = value_loss(values, mb[schema.VALUES], mb[schema.RETURNS], mask,
                              cliprange_value=algorithm.cliprange_value, loss_agg_mode=algorithm.loss_agg_mode,
                              global_num_tokens=tokens, global_num_seqs=seqs, norm_length=norm_length)
        loss.backward()
        sums.add_step("vf_loss", vf["vf_loss"])
        sums.num_tokens += vf["num_tokens"]
        sums.add_tokens("vf_clipfrac", vf["vf_clipfrac"] * vf["num_tokens"])
        sums.add_tokens("vpred_mean", vf["vpred_mean"] * vf["num_tokens"])
    _clip_and_step(critic, optimizer, max_grad_norm, tokens, sums)
