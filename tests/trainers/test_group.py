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
    valid = batch[schema.RESPONSE_MASK].bool()  # padding: whatever each rank's micro-batch width left there
    for key in (schema.OLD_LOG_PROBS, "entropy", schema.ADVANTAGES, schema.RETURNS):
        assert two[key].shape == one[key].shape, key
        torch.testing.assert_close(two[key][valid], one[key][valid], atol=1e-5, rtol=1e-5, msg=key)
    before = single.full_state_dict()
    m_two, m_one = group.update_actor(two), single.update_actor(one)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac", "actor/num_tokens"):
        assert m_two[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-6), key
    assert_same_updates(before, single.full_state_dict(), before, group.full_state_dict())
    assert group.get_weight_version() == single.get_weight_version() == 1


def _advantages_on_rank(worker, batch: dict, rows_of_rank: list[list[int]], overrides: dict):
    """``compute_advantages`` on this rank's ``rows_of_rank`` of ``batch`` under the algorithm with
    ``overrides`` (estimator and KL controller swapped in for the call); returns the fields, the metrics,
    the KL coefficient after the call and the shapes of every ``all_gather_rows`` it made."""
    import dataclasses

    from trainers import collectives
    from trainers.advantages import ADV_ESTIMATORS
    from trainers.batching import select
    from trainers.kl import make_kl_controller

    saved = worker.estimator, worker.algorithm, worker.kl_controller, collectives.all_gather_rows
    calls = []

    def counting(x):
        calls.append(tuple(x.shape))
        return saved[3](x)

    worker.algorithm = dataclasses.replace(worker.algorithm, **overrides)
    worker.estimator = ADV_ESTIMATORS.get(worker.algorithm.adv_estimator)
    worker.kl_controller = make_kl_controller(worker.algorithm)
    collectives.all_gather_rows = counting
    try:
        fields, metrics = worker.compute_advantages(select(batch, rows_of_rank[worker.rank]))
        return fields, metrics, worker.kl_controller.value, calls
    finally:
        worker.estimator, worker.algorithm, worker.kl_controller, collectives.all_gather_rows = saved


# DAPO's overlong penalty and an adaptive KL-in-reward controller: their batch metrics must be global too.
SHAPING = {"overlong_buffer_len": 3, "use_kl_in_reward": True, "kl_ctrl_type": "adaptive", "kl_in_reward_coef": 0.5,
           "kl_horizon": 10}


@pytest.mark.parametrize("estimator, group_local", [("grpo", True), ("rloo", True), ("remax", True),
                                                    ("gpg", False), ("reinforce_plus_plus_baseline", False)])
def test_group_local_advantages_skip_the_gather(group, estimator, group_local):
    # 5 groups x 4 samples. Whole groups per rank (how TrainerGroup deals them) vs every group split across
    # the two ranks (even rows / odd rows), which must gather the batch: the same advantages and metrics.
    g = torch.Generator().manual_seed(3)
    batch = make_batch(num_groups=5, n=4, seed=9)
    mask = batch[schema.RESPONSE_MASK]
    last = mask.sum(-1) - 1
    batch[schema.TOKEN_LEVEL_SCORES] = torch.zeros(mask.shape).index_put_(
        (torch.arange(20), last), torch.randn(20, generator=g))
    batch[schema.OLD_LOG_PROBS] = -torch.rand(mask.shape, generator=g) * 3
    batch[schema.REF_LOG_PROB] = -torch.rand(mask.shape, generator=g) * 3
    batch[schema.REMAX_BASELINE] = torch.randn(20, generator=g)
    whole = [s.indices for s in shard_for_ranks(batch[schema.UID], 2, 2)]
    split = [list(range(0, 20, 2)), list(range(1, 20, 2))]
    results = {}
    for name, rows in (("whole", whole), ("split", split)):
        per_rank = group.execute(_advantages_on_rank, batch, rows, {"adv_estimator": estimator, **SHAPING})
        fields = {k: torch.zeros(20, mask.shape[1]) for k in per_rank[0][0]}
        for (part, _, _, _), index in zip(per_rank, rows, strict=True):
            for k in fields:
                fields[k][index] = part[k]
        assert per_rank[0][1] == pytest.approx(per_rank[1][1], rel=1e-12)  # every rank reports the same metrics
        assert per_rank[0][2] == pytest.approx(per_rank[1][2], rel=1e-12)
        results[name] = fields, per_rank[0][1], per_rank[0][2], [calls for *_, calls in per_rank]
    (local, local_metrics, local_coef, local_calls), (gathered, metrics, coef, gathered_calls) = \
        results["whole"], results["split"]
    for key, value in gathered.items():
        torch.testing.assert_close(local[key], value, atol=1e-6, rtol=1e-6, msg=key)
    assert local[schema.ADVANTAGES].abs().max() > 0.1
    assert sorted(local_metrics) == sorted(metrics)
    for key, value in metrics.items():
        assert local_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key  # float32 means
    assert metrics["overlong/frac_penalised"] > 0 and metrics["kl_in_reward/kl"] != 0
    assert local_coef == pytest.approx(coef, rel=1e-5) and coef != 0.5  # the controller moved, by the global KL
    assert all(any(len(shape) == 2 for shape in calls) for calls in gathered_calls)  # the inputs were gathered
    if group_local:  # only the uid-hash check: one int64 per group the rank holds (rank 0: 3 groups, rank 1: 2)
        assert local_calls == [[(3,)], [(2,)]]
    else:
        assert all(any(len(shape) == 2 for shape in calls) for calls in local_calls)


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
