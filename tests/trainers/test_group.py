"""TrainerGroup: two FSDP2 ranks as real Ray actors (gloo) against one in-process rank."""

from __future__ import annotations

import pytest
import torch

from common import schema
from common.models import ModelConfig
from tests.trainers._trainer_batches import (
    LINEAR_ADAM_LR,
    assert_same_updates,
    linear_adam,
    make_batch,
    single_rank_group,
    with_training_fields,
)
from tests.trainers.tensor_group import TensorTrainerGroup
from trainers.batching import shard_for_ranks
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.worker import TrainerWorker

TINY = ModelConfig(path="tiny")
# 2 prompts per mini-batch (several optimizer steps per update), micro-batches of 4 samples.
# lr and eps make Adam's update linear in the gradients (see linear_adam), so updates compare tightly.
TRAINER = {"ppo_mini_batch_size": 2, "ppo_micro_batch_size": 4, "lr": LINEAR_ADAM_LR, "num_threads": 1,
           "num_cpus_per_rank": 0.25, "timeout_s": 100.0}
ALGORITHM = AlgorithmConfig(adv_estimator="reinforce_plus_plus")  # batch whitening: needs the global batch


@pytest.fixture(scope="module")
def group(ray_cluster):
    g = TensorTrainerGroup(TrainerConfig(num_ranks=2, **TRAINER), ALGORITHM, TINY, temperature=0.9,
                     max_response_length=5)
    linear_adam(g)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def single(group):
    gen = single_rank_group()
    next(gen)
    worker = TrainerWorker(TrainerConfig(num_ranks=1, **TRAINER), ALGORITHM, TINY, temperature=0.9,
                           max_response_length=5)
    linear_adam(worker)
    yield worker
    next(gen, None)


def test_shards_keep_uid_groups_whole_and_mini_batches_global():
    uid = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"]
    shards = shard_for_ranks(uid, num_ranks=2, ppo_mini_batch_size=2)
    assert [s.indices for s in shards] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7]]
    assert [s.mini_batch_sizes for s in shards] == [[2, 2, 2], [2, 2, 0]]
    with pytest.raises(ValueError, match="num_ranks"):
        shard_for_ranks(["a", "a"], num_ranks=2, ppo_mini_batch_size=1)


def test_two_ranks_equal_one_rank(group, single):
    # 5 groups x 2 samples, 2 groups per mini-batch: rank 0 gets 3 groups, rank 1 gets 2. Rank 1 runs a
    # filler forward in compute_log_prob (1 micro-batch vs 2) and a masked filler step in the last mini-batch.
    batch = make_batch(num_groups=5, n=2, seed=7)
    shuffled = [5, 0, 9, 7, 2, 1, 8, 6, 3, 4]  # ranks receive whole groups; results come back in this order
    batch = {k: (v[shuffled] if isinstance(v, torch.Tensor) else [v[i] for i in shuffled]) for k, v in batch.items()}
    two, one = with_training_fields(group, batch), with_training_fields(single, batch)
    for key in (schema.OLD_LOG_PROBS, "entropy", schema.ADVANTAGES, schema.RETURNS):
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=1e-5, msg=key)
    before = single.full_state_dict()
    m_two, m_one = group.update_actor(two), single.update_actor(one)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac", "actor/num_tokens"):
        assert m_two[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-6), key
    assert_same_updates(before, single.full_state_dict(), before, group.full_state_dict())
    assert group.get_weight_version() == single.get_weight_version() == 1


def _local_shards(worker):
    return [(s.name, s.tensor.clone(), s.row_offset, s.full_shape) for s in worker.named_local_shards()]


def test_local_shards_reassemble_the_full_tensors(group):
    full = group.full_state_dict()
    per_rank = group.execute(_local_shards)
    for name, tensor in full.items():
        rebuilt = torch.full_like(tensor, float("nan"))
        for shards in per_rank:
            (_, local, offset, shape), = [s for s in shards if s[0] == name]
            assert shape == tuple(tensor.shape)
            rebuilt[offset : offset + local.shape[0]] = local
        assert torch.equal(rebuilt, tensor), name
    assert per_rank[0][0][2] == 0 and per_rank[1][0][2] == full[per_rank[1][0][0]].shape[0] // 2


def test_save_load_gives_identical_next_step(group, single, tmp_path):
    batch = with_training_fields(group, make_batch(num_groups=4, n=2, seed=8))
    group.save_checkpoint(tmp_path / "ckpt")
    saved, version = group.full_state_dict(), group.get_weight_version()
    first = group.update_actor(batch)
    weights = group.full_state_dict()
    group.update_actor(batch)  # move on, then go back
    group.load_checkpoint(tmp_path / "ckpt")
    assert group.get_weight_version() == version
    again = group.update_actor(batch)
    assert again["actor/pg_loss"] == first["actor/pg_loss"]
    assert again["actor/grad_norm"] == first["actor/grad_norm"]
    for name, tensor in group.full_state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    # The 2-rank checkpoint loads into 1 rank (DCP reshards) and continues identically too.
    single.load_checkpoint(tmp_path / "ckpt")
    assert single.get_weight_version() == version
    loaded = single.full_state_dict()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    resumed = single.update_actor(batch)
    assert resumed["actor/pg_loss"] == pytest.approx(first["actor/pg_loss"], rel=1e-5, abs=1e-6)
    assert_same_updates(saved, weights, saved, single.full_state_dict())


def test_actor_exception_reaches_caller(group):
    batch = make_batch(num_groups=2, n=2)  # no old_log_probs / advantages
    with pytest.raises(ValueError, match="update_actor needs batch fields") as info:
        group.update_actor(batch)
    assert any("trainer rank" in note for note in getattr(info.value, "__notes__", []))
    with pytest.raises(FileNotFoundError, match="no trainer checkpoint"):
        group.load_checkpoint("/nonexistent/ckpt")
    assert group.get_weight_version() >= 1  # validation failed on every rank before any collective


def test_shutdown_kills_actors_and_frees_the_placement_group(group, ray_cluster):
    from ray.util import placement_group_table

    actors, pg = list(group._actors), group._pg
    group.shutdown()
    group.shutdown()  # idempotent
    with pytest.raises(ray_cluster.exceptions.RayActorError):
        ray_cluster.get(actors[0].call.remote("get_weight_version"), timeout=30)
    assert placement_group_table(pg)["state"] == "REMOVED"
