"""The per-rank FSDP2 trainer: policy (+ optional reference and critic), optimizers, and the trainer stages.

``TrainerWorker`` is a plain class holding one rank's state; it needs the default process group to be
initialised (``trainers.fsdp.init_distributed``) and is what the tests drive directly in one process.
``TrainerActor`` is the thin Ray actor around it that ``TrainerGroup`` (``trainers/group.py``) starts, one
per rank. Every method that touches a model is collective: all ranks call it with their own data-parallel
slice of the batch (whole ``uid`` groups), in the same order.

Stages, in the order a training step runs them (batch in, fields or metrics out)::

    compute_log_prob(batch)     -> old_log_probs, entropy (+ ref_log_prob with a reference model); skipped
                                   when they equal the update's own forward, or taken from the rollers'
                                   rollout_log_probs (algorithm.bypass_mode): trainers/rollout_corr.py
    compute_values(batch)       -> values                                  (critic only, GAE)
    compute_advantages(batch)   -> token_level_rewards, advantages, returns (+ metrics)
    update_critic(batch)        -> metrics                                 (critic only)
    update_actor(batch)         -> metrics; weight_version += 1

Batches use the sample-schema names (``common/schema.py``); dicts or TensorDicts come in, dicts go out.
The LR schedule steps once per ``update_actor`` / ``update_critic`` call (one trainer step), over
``trainer.total_steps`` steps after ``trainer.warmup_steps`` of linear warm-up.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import net, schema
from common.core_lending import CoreLender
from common.env import resolve_num_threads, set_torch_threads
from common.models import ModelConfig
from trainers import checkpoint, collectives, export, fsdp
from trainers.advantage_stage import compute_rank_advantages
from trainers.advantages import ADV_ESTIMATORS
from trainers.batching import as_batch_dict, batch_size, local_mini_batch_sizes, micro_batch_plan, select
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.kl import make_kl_controller
from trainers.rollout_corr import MismatchSums, can_skip_old_forward, is_on_policy
from trainers.update import (
    CRITIC_FIELDS,
    StepSums,
    actor_fields,
    actor_step,
    critic_step,
    filler_sample,
    require_fields,
    synced_micro_batches,
)

logger = logging.getLogger(__name__)

FORWARD_FIELDS = schema.FORWARD.reads


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier after ``step`` scheduler steps: linear warm-up over ``warmup_steps`` (from
    ``1 / warmup_steps``), then ``constant`` 1 or ``cosine`` decay to 0 at ``total_steps``
    (Loshchilov & Hutter 2017, SGDR, without restarts)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _make_optimizer(model: torch.nn.Module, cfg: TrainerConfig, lr: float):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)

    def factor(step: int) -> float:
        return lr_factor(step, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class TrainerWorker:
    """One data-parallel rank of the trainer.

    ``temperature``: ``rollout.temperature`` (log-probs of ``logits / T``; 0 = greedy, raw logits);
    ``max_response_length``: ``rollout.max_response_length``, the constant of ``seq-mean-token-sum-norm``.
    A critic is built when the advantage estimator ``needs_critic`` (gae); a reference model when
    ``trainer.use_reference`` (needed by ``algorithm.use_kl_loss`` / ``use_kl_in_reward``).
    ``core_lending_dir``: the job's core-lending directory (``common.core_lending``; None: threads fixed). Raises
    RuntimeError if the process group is not initialised, ValueError for a KL option without reference
    or for ``algorithm.overlong_buffer_len`` > 0 without a ``max_response_length`` at least that long.
    """

    def __init__(self, trainer: TrainerConfig, algorithm: AlgorithmConfig, model: ModelConfig, *,
                 temperature: float = 1.0, max_response_length: int | None = None, tq_handle: dict | None = None,
                 core_lending_dir: str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("TrainerWorker needs torch.distributed initialised (trainers.fsdp.init_distributed)")
        if (algorithm.use_kl_loss or algorithm.use_kl_in_reward) and not trainer.use_reference:
            raise ValueError("algorithm.use_kl_loss / use_kl_in_reward need trainer.use_reference=true")
        if algorithm.overlong_buffer_len > 0 and (max_response_length is None
                                                  or algorithm.overlong_buffer_len > max_response_length):
            raise ValueError(f"algorithm.overlong_buffer_len={algorithm.overlong_buffer_len} needs "
                             f"rollout.max_response_length >= it, got {max_response_length}")
        self.trainer, self.algorithm, self.model_config = trainer, algorithm, model
        self.temperature = float(temperature)
        self.norm_length = max_response_length
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        self.policy = fsdp.build_fsdp_model(model, fsdp.POLICY, self.device)
        self.actor_optimizer, self.actor_scheduler = _make_optimizer(self.policy, trainer, trainer.lr)
        self.reference = None
        if trainer.use_reference:
            self.reference = fsdp.build_fsdp_model(model, fsdp.POLICY, self.device).requires_grad_(False)
        self.estimator = ADV_ESTIMATORS.get(algorithm.adv_estimator)
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if self.estimator.needs_critic:
            self.critic = fsdp.build_fsdp_model(model, fsdp.CRITIC, self.device)
            self.critic_optimizer, self.critic_scheduler = _make_optimizer(self.critic, trainer, trainer.critic_lr)
        self.core_lender = None
        if core_lending_dir is not None:  # before each decoder layer's forward and backward: common.core_lending
            self.core_lender = CoreLender(core_lending_dir, torch.get_num_threads())
            for module in (self.policy, self.reference, self.critic):
                if module is not None:
                    self.core_lender.attach(module, fsdp.decoder_layers(module))
        self.kl_controller = make_kl_controller(algorithm)
        self.weight_version = 0
        self.tq_handle = tq_handle
        self.weight_sender = None  # this rank's checkpointengine.WeightSender (trainers.weight_sync)
        self._tq_client = None

    # ------------------------------------------------------------------------------------------ helpers

    def _to_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        out = as_batch_dict(batch)
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    def _mini_batches(self, batch: dict, mini_batch_sizes: list[int] | None) -> list[dict | None]:
        """This rank's mini-batches (``None`` where it has no sample), as many as the rank with the most."""
        if mini_batch_sizes is None:
            groups = max(1, self.trainer.ppo_mini_batch_size // self.world_size)
            order, mini_batch_sizes = local_mini_batch_sizes(batch[schema.UID], groups)
            batch = select(batch, order)
        elif sum(mini_batch_sizes) != batch_size(batch) or min(mini_batch_sizes, default=0) < 0:
            raise ValueError(f"mini_batch_sizes {mini_batch_sizes} do not add up to the {batch_size(batch)} samples")
        total = int(collectives.all_reduce([len(mini_batch_sizes)], dist.ReduceOp.MAX)[0])
        minis: list[dict | None] = []
        start = 0
        for i in range(total):
            size = mini_batch_sizes[i] if i < len(mini_batch_sizes) else 0
            minis.append(select(batch, range(start, start + size)) if size else None)
            start += size
        return minis

    @torch.no_grad()
    def _forward_all(self, batch: dict, fn) -> tuple[torch.Tensor, ...]:
        """``fn(micro_batch)`` over this rank's micro-batches (``synced_micro_batches``: length-sorted, trimmed;
        fillers' results dropped). ``fn`` returns a tuple of per-token tensors ``(micro, kept_response_len)``;
        returns them for the whole batch, in its order and at its width ``(batch, response_len)``, 0 on the
        cut columns."""
        micro, max_tokens = self.trainer.ppo_micro_batch_size, self.trainer.ppo_max_token_len_per_gpu
        share = self.trainer.prefix_grouper
        order, slices = plan = micro_batch_plan(batch, micro, max_tokens, share)
        results = [fn(mb) for mb in synced_micro_batches(batch, plan, filler_sample(batch))][: len(slices)]
        width = batch[schema.RESPONSES].shape[1]
        inverse = torch.argsort(torch.tensor(order))
        return tuple(torch.cat([F.pad(r[i], (0, width - r[i].shape[1])) for r in results])[inverse.to(self.device)]
                     for i in range(len(results[0])))

    # ------------------------------------------------------------------------------------------- stages

    def compute_log_prob(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``old_log_probs`` and ``entropy`` ``(batch, response_len)`` fp32 under the current policy at
        ``temperature`` (+ ``ref_log_prob`` with a reference model). Needs ``input_ids``,
        ``attention_mask``, ``responses``. Collective."""
        b = self._to_device(batch)
        require_fields(b, FORWARD_FIELDS, "compute_log_prob")
        out: dict[str, torch.Tensor] = {}
        log_probs, entropy = self._forward_all(
            b, lambda mb: fsdp.response_log_probs(self.policy, mb, self.temperature, True,
                                                  share_prompts=self.trainer.prefix_grouper))
        out[schema.OLD_LOG_PROBS] = log_probs.cpu()
        out["entropy"] = entropy.cpu()
        fsdp.reshard(self.policy)
        return out | self.compute_ref_log_prob(b)

    def compute_ref_log_prob(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``ref_log_prob`` ``(batch, response_len)`` fp32 under the reference policy at ``temperature``;
        ``{}`` without a reference model. Needs the fields of ``compute_log_prob``. Collective."""
        if self.reference is None:
            return {}
        b = self._to_device(batch)
        require_fields(b, FORWARD_FIELDS, "compute_ref_log_prob")
        (refs,) = self._forward_all(b, lambda mb: fsdp.response_log_probs(
            self.reference, mb, self.temperature, share_prompts=self.trainer.prefix_grouper)[:1])
        fsdp.reshard(self.reference)
        return {schema.REF_LOG_PROB: refs.cpu()}

    def compute_values(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``values`` ``(batch, response_len)`` fp32 from the critic. Raises RuntimeError without a critic
        (the advantage estimator does not need one). Collective."""
        if self.critic is None:
            raise RuntimeError(f"compute_values needs a critic; algorithm.adv_estimator={self.estimator.name!r} "
                               "does not use one (gae does)")
        b = self._to_device(batch)
        require_fields(b, FORWARD_FIELDS, "compute_values")
        (values,) = self._forward_all(b, lambda mb: (fsdp.response_values(self.critic, mb,
                                                                          self.trainer.prefix_grouper),))
        values = values.cpu()
        fsdp.reshard(self.critic)
        return {schema.VALUES: values}

    def compute_advantages(self, batch: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """``token_level_rewards`` (scores, plus DAPO's overlong penalty with ``overlong_buffer_len`` > 0,
        minus the KL penalty with ``use_kl_in_reward``), ``advantages`` and ``returns``
        ``(batch, response_len)`` for this rank's samples, and metrics (``advantages/*``, ``returns/*``,
        ``overlong/*`` with the penalty, ``kl_in_reward/*`` with the KL penalty), the same on every rank.

        A group-local estimator (GRPO, RLOO, ...) runs on this rank's rows when every ``uid`` group is whole
        on one rank; otherwise every rank gathers the **global** batch, so batch-level whitening (GAE,
        REINFORCE++) and split groups do not depend on how the batch was sharded
        (``trainers/advantage_stage.py``). Needs ``token_level_scores``, ``response_mask``, ``uid``, the
        estimator's ``input_fields`` (``values`` for gae, ``remax_baseline`` for remax) and
        ``old_log_probs``, ``ref_log_prob`` for KL-in-reward; raises ValueError naming a missing one.
        Collective.
        """
        return compute_rank_advantages(as_batch_dict(batch), estimator=self.estimator, algorithm=self.algorithm,
                                       kl_controller=self.kl_controller, max_response_length=self.norm_length,
                                       rank=self.rank)

    def update_actor(self, batch: Mapping[str, Any], mini_batch_sizes: list[int] | None = None, *,
                     old_from_current: bool = False) -> dict[str, float]:
        """``trainer.ppo_epochs`` passes of PPO over ``batch``; returns flat ``actor/*`` metrics.

        ``mini_batch_sizes``: this rank's samples in each global mini-batch, as ``TrainerGroup`` cuts
        them (``trainers.batching.shard_for_ranks``); ``None`` cuts the local batch into mini-batches of
        ``ppo_mini_batch_size // num_ranks`` uid groups. Needs ``input_ids``, ``attention_mask``,
        ``responses``, ``response_mask``, ``old_log_probs``, ``advantages`` (+ ``ref_log_prob`` with
        ``use_kl_loss``, ``rollout_log_probs`` with a ``stale_correction``); raises ValueError naming a
        missing field. Metrics are over exactly the valid tokens the loss uses: ``pg_loss`` (mean per
        mini-batch), ``pg_clipfrac``, ``ppo_kl``, ``entropy``, ``grad_norm`` (before clipping),
        ``lr``, ``tokens_per_s`` (valid response tokens, all ranks, all epochs), ``skipped_steps``,
        ``advantages/mean|max|min``; with ``rollout_log_probs`` in the batch, ``rollout_corr/*``
        (``trainers.rollout_corr``) from the recomputed ``old_log_probs``, else from the first mini-batch's
        forward before the first optimizer step.

        ``old_from_current``: take ``old_log_probs`` from the training forward, detached (the batch need
        not carry them); only valid when the samples were generated with the current weights (the caller's
        promise, ``trainers.rollout_corr.can_skip_old_forward``); raises ValueError unless the update is one
        epoch of one mini-batch. ``weight_version`` increases by one. Collective.
        """
        b = self._to_device(batch)
        require_fields(b, actor_fields(self.algorithm, old_from_current)
                       + ((schema.UID,) if mini_batch_sizes is None else ()), "update_actor")
        sums = StepSums()
        start = time.perf_counter()
        minis = self._mini_batches(b, mini_batch_sizes)
        if old_from_current and (self.trainer.ppo_epochs != 1 or len(minis) != 1):
            raise ValueError(f"old_from_current needs one epoch of one mini-batch, got trainer.ppo_epochs="
                             f"{self.trainer.ppo_epochs} and {len(minis)} mini-batches: recompute old_log_probs")
        mismatch = MismatchSums() if schema.ROLLOUT_LOG_PROBS in b else None
        recomputed = mismatch is not None and schema.OLD_LOG_PROBS in b and not old_from_current \
            and not self.algorithm.bypass_mode
        if recomputed:
            mismatch.add(b[schema.OLD_LOG_PROBS], b[schema.ROLLOUT_LOG_PROBS], b[schema.RESPONSE_MASK])
        filler = filler_sample(b)
        lr = self.actor_scheduler.get_last_lr()[0]
        for epoch in range(self.trainer.ppo_epochs):
            for i, mini in enumerate(minis):
                probe = mismatch if (epoch == 0 and i == 0 and not recomputed) else None
                actor_step(self.policy, self.actor_optimizer, mini, filler, sums, algorithm=self.algorithm,
                           temperature=self.temperature, micro_batch_size=self.trainer.ppo_micro_batch_size,
                           max_grad_norm=self.trainer.max_grad_norm, norm_length=self.norm_length,
                           old_from_current=old_from_current, mismatch=probe,
                           max_token_len=self.trainer.ppo_max_token_len_per_gpu,
                           share_prompts=self.trainer.prefix_grouper)
        self.actor_scheduler.step()
        self.weight_version += 1
        metrics = sums.finish("actor")
        if mismatch is not None:
            metrics.update(mismatch.finish())
        metrics["actor/lr"] = lr
        metrics["actor/tokens_per_s"] = metrics["actor/num_tokens"] / max(time.perf_counter() - start, 1e-9)
        metrics["actor/weight_version"] = float(self.weight_version)
        metrics.update(collectives.global_masked_stats(b[schema.ADVANTAGES], b[schema.RESPONSE_MASK],
                                                       "actor/advantages"))
        return metrics

    def update_critic(self, batch: Mapping[str, Any], mini_batch_sizes: list[int] | None = None) -> dict[str, float]:
        """``trainer.ppo_epochs`` passes of clipped value regression on ``returns``; ``critic/*`` metrics
        (``vf_loss``, ``vf_clipfrac``, ``vpred_mean``, ``grad_norm``, ``lr``). Needs ``values`` (before the
        update) and ``returns`` besides the prompt/response fields. Raises RuntimeError without a critic."""
        if self.critic is None:
            raise RuntimeError(f"update_critic needs a critic; algorithm.adv_estimator={self.estimator.name!r} "
                               "does not use one (gae does)")
        b = self._to_device(batch)
        require_fields(b, CRITIC_FIELDS + ((schema.UID,) if mini_batch_sizes is None else ()), "update_critic")
        sums = StepSums()
        minis = self._mini_batches(b, mini_batch_sizes)
        filler = filler_sample(b)
        lr = self.critic_scheduler.get_last_lr()[0]
        for _ in range(self.trainer.ppo_epochs):
            for mini in minis:
                critic_step(self.critic, self.critic_optimizer, mini, filler, sums, algorithm=self.algorithm,
                            micro_batch_size=self.trainer.ppo_micro_batch_size,
                            max_grad_norm=self.trainer.max_grad_norm, norm_length=self.norm_length,
                            max_token_len=self.trainer.ppo_max_token_len_per_gpu,
                            share_prompts=self.trainer.prefix_grouper)
        self.critic_scheduler.step()
        metrics = sums.finish("critic")
        metrics["critic/lr"] = lr
        metrics.update(collectives.global_masked_stats(b[schema.RETURNS], b[schema.RESPONSE_MASK], "critic/returns"))
        return metrics

    def train_step(self, meta: dict, mini_batch_sizes: list[int]) -> dict[str, float]:
        """One trainer step on this rank's slice of a batch, read from the TransferQueue.

        ``meta``: a ``BatchMeta`` in wire form (``to_wire``) naming this rank's samples, whole ``uid``
        groups, in global mini-batch order; ``mini_batch_sizes`` as for ``update_actor``. Runs the stages
        ``compute_log_prob`` → (``compute_values``) → ``compute_advantages`` → (``update_critic``) →
        ``update_actor``; returns their metrics merged. Raises RuntimeError without a TransferQueue handle.
        Collective.
        """
        from trainers.tq_batch import fetch_batch
        from transferqueue.client import TQClient
        from transferqueue.records import BatchMeta, TQHandle

        if self.tq_handle is None:
            raise RuntimeError("train_step needs the trainer built with a TransferQueue handle (tq_handle)")
        if self._tq_client is None:
            self._tq_client = TQClient(TQHandle.from_dict(self.tq_handle))
        batch_meta = BatchMeta.from_wire(meta)
        batch = fetch_batch(self._tq_client, batch_meta, self.estimator.roller_extras)
        old_from_current, old_metrics = self._old_log_probs(batch, batch_meta.tags, len(mini_batch_sizes))
        if self.critic is not None:
            batch.update(self.compute_values(batch))
        fields, metrics = self.compute_advantages(batch)
        batch.update(fields)
        if self.critic is not None:
            metrics.update(self.update_critic(batch, mini_batch_sizes))
        metrics.update(self.update_actor(batch, mini_batch_sizes, old_from_current=old_from_current))
        return metrics | old_metrics

    def _old_log_probs(self, batch: dict, tags: list[dict], num_mini_batches: int) -> tuple[bool, dict[str, float]]:
        """Put ``old_log_probs`` (and ``ref_log_prob``) into ``batch`` from the source this step allows
        (``trainers.rollout_corr``); returns whether the update takes them from its own forward, and
        ``actor/old_log_prob_s`` (seconds of the extra forward, 0 when skipped) and
        ``actor/old_log_prob_recomputed`` (1 or 0). Collective: the ranks agree through one all-reduce."""
        start = time.perf_counter()
        local = is_on_policy(tags, self.weight_version)
        on_policy = bool(collectives.all_reduce([float(local)], dist.ReduceOp.MIN)[0])
        skip = can_skip_old_forward(self.algorithm, ppo_epochs=self.trainer.ppo_epochs,
                                    num_mini_batches=num_mini_batches, on_policy=on_policy)
        recompute = not skip and not self.algorithm.bypass_mode
        if recompute:
            batch.update(self.compute_log_prob(batch))
        else:
            if self.algorithm.bypass_mode:
                batch[schema.OLD_LOG_PROBS] = batch[schema.ROLLOUT_LOG_PROBS]
            batch.update(self.compute_ref_log_prob(batch))
        return skip, {"actor/old_log_prob_s": time.perf_counter() - start if recompute else 0.0,
                      "actor/old_log_prob_recomputed": float(recompute)}

    # ------------------------------------------------------------------------------- weights, checkpoint

    def get_weight_version(self) -> int:
        """Completed ``update_actor`` calls (0 at start; restored by ``load_checkpoint``)."""
        return self.weight_version

    def named_local_shards(self) -> Iterator[fsdp.LocalShard]:
        """This rank's ``Shard(0)`` rows of every policy parameter, with row offsets (``fsdp.named_local_shards``)."""
        fsdp.reshard(self.policy)
        return fsdp.named_local_shards(self.policy)

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full policy tensors, gathered one by one; every rank must iterate, only rank 0 yields."""
        fsdp.reshard(self.policy)
        return fsdp.named_full_tensors(self.policy)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """All full policy tensors on CPU on rank 0 (``{}`` elsewhere). For small models and tests."""
        return {name: t.cpu().clone() for name, t in self.named_full_tensors()}

    def checkpoint_state(self) -> dict[str, Any]:
        """The parts of a resumable checkpoint as DCP ``Stateful`` objects: ``actor`` (policy + AdamW),
        ``actor_scheduler``, ``critic``/``critic_scheduler`` when there is a critic, and ``trainer`` (this
        worker's own counters, :meth:`state_dict`)."""
        state: dict[str, Any] = {
            "actor": checkpoint.ModelOptimizerState(self.policy, self.actor_optimizer),
            "actor_scheduler": self.actor_scheduler,
            "trainer": self,
        }
        if self.critic is not None:
            state["critic"] = checkpoint.ModelOptimizerState(self.critic, self.critic_optimizer)
            state["critic_scheduler"] = self.critic_scheduler
        return state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This worker's counters (the ``trainer`` part of a checkpoint; models and optimizers are their
        own parts): ``weight_version`` and ``world_size`` int64 scalars, ``kl_coef`` fp64 scalar."""
        return {
            "weight_version": torch.tensor(self.weight_version, dtype=torch.long),
            "world_size": torch.tensor(self.world_size, dtype=torch.long),
            "kl_coef": torch.tensor(self.kl_controller.value, dtype=torch.float64),
        }

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Restore the counters :meth:`state_dict` returned (a different saved ``world_size`` is logged:
        the RNG states of the ranks then do not line up with the saved ones)."""
        saved_world_size = int(state_dict["world_size"])
        if saved_world_size != self.world_size:
            logger.warning("checkpoint was saved with %d ranks, loading with %d: RNG states do not carry over",
                           saved_world_size, self.world_size)
        self.weight_version = int(state_dict["weight_version"])
        self.kl_controller.value = float(state_dict["kl_coef"])

    def save_checkpoint(self, path: str) -> None:
        """Save everything needed to resume (``trainers.checkpoint.save`` of ``checkpoint_state``). Collective."""
        checkpoint.save(path, self.checkpoint_state(), self.rank)

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote (``trainers.checkpoint.load``). Collective. Raises
        FileNotFoundError without a checkpoint, ValueError when it lacks a part this worker has."""
        checkpoint.load(path, self.checkpoint_state(), self.rank)

    def export_model(self, path: str) -> None:
        """Write the policy as a Hugging Face model directory at ``path`` (``trainers/export.py``): the full
        weights are gathered on rank 0, which writes. Collective. Raises FileExistsError if ``path`` exists."""
        state = self.full_state_dict()
        if self.rank == 0:
            export.export_state(state, self.model_config, path)


class TrainerActor:
    """Ray actor wrapper of one rank: joins the process group, then holds a ``TrainerWorker``.

    Started by ``TrainerGroup`` with ``ray.remote``; ``call(method, *args)`` runs a ``TrainerWorker``
    method, ``execute(fn, *args)`` runs ``fn(worker, *args)`` (an extension point, e.g. for the
    checkpoint engine's sender).
    """

    def __init__(self, num_threads: int | str):
        set_torch_threads(resolve_num_threads(num_threads))
        self.worker: TrainerWorker | None = None

    def rendezvous_address(self, host: str) -> tuple[str, int]:
        """(address, free port) for the process group's rendezvous, on this rank's node (rank 0 only):
        ``host`` resolved here (``node``: this rank's Ray node address, ``common.net.resolve_bind_host``)."""
        address = net.resolve_bind_host("trainer.host", host)
        return address, net.free_port(address)

    def setup(self, rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
              timeout_s: float, worker_kwargs: dict) -> None:
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray gives each rank actor one GPU: its cuda:0
        fsdp.init_distributed(rank, world_size, master_addr, master_port, backend, timeout_s)
        self.worker = TrainerWorker(**worker_kwargs)

    def call(self, method: str, *args, **kwargs):
        if self.worker is None:
            raise RuntimeError("the trainer actor is not set up")
        return getattr(self.worker, method)(*args, **kwargs)

    def execute(self, fn, *args, **kwargs):
        if self.worker is None:
            raise RuntimeError("the trainer actor is not set up")
        return fn(self.worker, *args, **kwargs)

    def close(self) -> None:
        self.worker = None
        if dist.is_initialized():
            dist.destroy_process_group()
