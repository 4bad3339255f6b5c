"""``TensorTrainerGroup``: a ``TrainerGroup`` that also passes whole tensor batches through the driver,
stage by stage (test-only: runs move only metadata, ``TrainerGroup.train_step``). The tests use it to
compare a multi-rank group with one in-process rank on the same batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from common import schema
from trainers.batching import RankShard, as_batch_dict, batch_size, select, shard_for_ranks
from trainers.group import TrainerGroup


class TensorTrainerGroup(TrainerGroup):
    """The worker's stages over a whole batch: sharded by ``uid`` group to the ranks, results gathered back
    in the caller's sample order (per-sample fields) or from rank 0 (metrics)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy weights (HF names, tied weights once), gathered on rank 0 and passed to the caller."""
        return self.call("full_state_dict")[0]

    def _shards(self, batch: dict) -> list[RankShard]:
        if schema.UID not in batch:
            raise ValueError(f"a trainer batch needs {schema.UID!r} to be sharded by prompt group; has {sorted(batch)}")
        return shard_for_ranks(batch[schema.UID], self.num_ranks, self.trainer.ppo_mini_batch_size)

    def _scatter(self, method: str, batch: Mapping[str, Any], with_sizes: bool = False) -> tuple[list, list]:
        b = as_batch_dict(batch)
        batch_size(b)
        shards = self._shards(b)
        refs = []
        for actor, shard in zip(self._actors, shards, strict=True):
            extra = (shard.mini_batch_sizes,) if with_sizes else ()
            refs.append(actor.call.remote(method, select(b, shard.indices), *extra))
        return self._wait(refs, method), shards

    @staticmethod
    def _gather_fields(parts: list[dict], shards: list[RankShard]) -> dict[str, torch.Tensor]:
        """Per-sample outputs of every rank put back in the caller's sample order."""
        order = torch.tensor([i for shard in shards for i in shard.indices])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return {key: torch.cat([p[key] for p in parts]).index_select(0, inverse) for key in parts[0]}



    def compute_log_prob(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``TrainerWorker.compute_log_prob`` over the whole batch (``old_log_probs``, ``entropy``[,
        ``ref_log_prob``]), rows in the caller's order."""
        parts, shards = self._scatter("compute_log_prob", batch)
        return self._gather_fields(parts, shards)

    def compute_values(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``TrainerWorker.compute_values`` over the whole batch, rows in the caller's order."""
        parts, shards = self._scatter("compute_values", batch)
        return self._gather_fields(parts, shards)

    def compute_advantages(self, batch: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """``TrainerWorker.compute_advantages``: (fields in the caller's order, metrics)."""
        parts, shards = self._scatter("compute_advantages", batch)
        return self._gather_fields([p[0] for p in parts], shards), parts[0][1]

    def update_actor(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """One actor update over global mini-batches of ``ppo_mini_batch_size`` uid groups; metrics."""
        parts, _ = self._scatter("update_actor", batch, with_sizes=True)
        return parts[0]

    def update_critic(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """One critic update (GAE only); metrics."""
        parts, _ = self._scatter("update_critic", batch, with_sizes=True)
        return parts[0]
