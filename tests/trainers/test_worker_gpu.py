"""TrainerWorker on a CUDA device with NCCL (1 rank, in process). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from common import schema
from common.models import ModelConfig
from tests.trainers._trainer_batches import make_batch, single_rank_group, with_training_fields
from trainers.config import AlgorithmConfig, TrainerConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_group():
    yield from single_rank_group("nccl")


def test_update_on_gpu_matches_cpu_log_probs(nccl_group):
    from trainers.worker import TrainerWorker

    worker = TrainerWorker(TrainerConfig(ppo_mini_batch_size=2, lr=1e-3), AlgorithmConfig(), ModelConfig(path="tiny"))
    assert worker.device.type == "cuda" and next(worker.policy.parameters()).device.type == "cuda"
    batch = with_training_fields(worker, make_batch(seed=11))
    assert batch[schema.OLD_LOG_PROBS].device.type == "cpu"  # outputs come back on the CPU
    before = worker.full_state_dict()
    metrics = worker.update_actor(batch)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6) and metrics["actor/skipped_steps"] == 0.0
    after = worker.full_state_dict()
    assert all(not torch.equal(before[name], after[name]) for name in before)
