"""Trainer checkpoints (torch.distributed.checkpoint) in one process: save -> load -> identical next step."""

from __future__ import annotations

import pytest
import torch

from common import schema
from common.models import ModelConfig
from tests.trainers._trainer_batches import make_batch, single_rank_group
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.worker import TrainerWorker

TINY = ModelConfig(path="tiny")


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield from single_rank_group()


def make_worker(algorithm: AlgorithmConfig, **overrides) -> TrainerWorker:
    cfg = {"ppo_mini_batch_size": 1, "ppo_micro_batch_size": 4, "lr": 1e-3, "critic_lr": 1e-3, "num_threads": 1,
           "warmup_steps": 2, "lr_schedule": "cosine", "total_steps": 6, "use_reference": True, **overrides}
    return TrainerWorker(TrainerConfig(**cfg), algorithm, TINY, temperature=1.0, max_response_length=5)


GAE_KL = AlgorithmConfig(adv_estimator="gae", use_kl_in_reward=True, kl_ctrl_type="adaptive", kl_target=0.01,
                         kl_horizon=10, use_kl_loss=True, entropy_coeff=0.01)


def train_step(worker: TrainerWorker, seed: int) -> dict[str, float]:
    """A full trainer step: log-probs, values, advantages (KL in reward), critic and actor updates."""
    batch = make_batch(num_groups=2, n=2, seed=seed)
    batch.update(worker.compute_log_prob(batch))
    batch.update(worker.compute_values(batch))
    fields, adv_metrics = worker.compute_advantages(batch)
    batch.update(fields)
    metrics = {**adv_metrics, **worker.update_critic(batch), **worker.update_actor(batch)}
    del metrics["actor/tokens_per_s"]  # wall-clock
    return metrics


def weights(worker: TrainerWorker) -> dict[str, torch.Tensor]:
    from trainers.fsdp import named_full_tensors

    return {**worker.full_state_dict(), **{f"critic.{n}": t.clone() for n, t in named_full_tensors(worker.critic)}}


def test_save_load_gives_identical_next_step(tmp_path):
    worker = make_worker(GAE_KL)
    train_step(worker, seed=0)
    worker.save_checkpoint(tmp_path / "ckpt")
    state = (worker.get_weight_version(), worker.kl_controller.value, worker.actor_scheduler.get_last_lr())
    draw = torch.rand(4)
    expected = train_step(worker, seed=1)
    expected_weights = weights(worker)
    train_step(worker, seed=2)

    worker.load_checkpoint(tmp_path / "ckpt")
    assert (worker.get_weight_version(), worker.kl_controller.value, worker.actor_scheduler.get_last_lr()) == state
    assert torch.equal(torch.rand(4), draw)  # RNG restored
    assert train_step(worker, seed=1) == expected
    for name, tensor in weights(worker).items():
        assert torch.equal(tensor, expected_weights[name]), name


def test_fresh_worker_resumes_from_checkpoint(tmp_path):
    first = make_worker(GAE_KL)
    train_step(first, seed=0)
    first.save_checkpoint(tmp_path / "ckpt")
    expected = train_step(first, seed=1)
    fresh = make_worker(GAE_KL)
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert fresh.get_weight_version() == 1
    assert train_step(fresh, seed=1) == expected


def test_load_errors(tmp_path):
    plain = make_worker(AlgorithmConfig(), use_reference=False)
    with pytest.raises(FileNotFoundError, match="no trainer checkpoint"):
        plain.load_checkpoint(tmp_path / "missing")
    plain.save_checkpoint(tmp_path / "no_critic")
    with pytest.raises(ValueError, match="no critic"):
        make_worker(GAE_KL).load_checkpoint(tmp_path / "no_critic")
    assert schema.OLD_LOG_PROBS in plain.compute_log_prob(make_batch(num_groups=1, n=2))


class _Counter:
    """A minimal DCP ``Stateful`` that is not a trainer worker."""

    def __init__(self, value: int):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.value = int(state_dict["value"])


def test_checkpoint_module_takes_stateful_parts_not_a_worker(tmp_path):
    """``trainers.checkpoint`` saves and loads any ``Stateful`` parts (it does not reach into a worker's
    fields); a missing part is named; the worker's counters go through its own ``state_dict``."""
    import sys

    from trainers import checkpoint

    checkpoint.save(tmp_path / "ckpt", {"counter": _Counter(7)}, rank=0)
    restored = _Counter(0)
    assert checkpoint.load(tmp_path / "ckpt", {"counter": restored}, rank=0) is True
    assert restored.value == 7
    with pytest.raises(ValueError, match="no other"):
        checkpoint.load(tmp_path / "ckpt", {"counter": _Counter(0), "other": _Counter(0)}, rank=0)
    assert "TrainerWorker" not in vars(sys.modules["trainers.checkpoint"])
    worker = make_worker(AlgorithmConfig(), use_reference=False)
    worker.weight_version = 3
    assert int(worker.state_dict()["weight_version"]) == 3
    worker.load_state_dict(worker.state_dict() | {"weight_version": torch.tensor(5)})
    assert worker.get_weight_version() == 5
