"""Multi-turn jobs end to end (real Ray actors, FSDP2 trainer, TransferQueue): the agent loop under the
schedules. The environment is ``tests.rollers.agent_envs:scripted_turns`` (two observations, then the task's
reward), imported by the rollers from the test tree."""

from __future__ import annotations

import pytest

from controller.job import EXIT_OK
from tests.controller.test_job import assert_trains_as_sync, run

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.long]  # two jobs: ~40 s quiet, ~150 s on a loaded 2-core machine

MULTI_TURN = ("rollout.environment=tests.rollers.agent_envs:scripted_turns", "rollout.max_turns=3",
              "rollout.max_response_length=24", "data.size=32", "data.train_batch_size=8",
              "trainer.ppo_mini_batch_size=8", "trainer.total_steps=2", "algorithm.max_staleness=0")


def test_multi_turn_fully_async_max_staleness_zero_matches_sync(tmp_path, ray_cluster):
    code_a, sync_steps, _ = run(tmp_path / "sync", "sync", *MULTI_TURN)
    code_b, async_steps, _ = run(tmp_path / "async", "fully-async", *MULTI_TURN)
    assert code_a == code_b == EXIT_OK and len(sync_steps) == len(async_steps) == 2
    assert_trains_as_sync(sync_steps, async_steps)  # token-identical trajectories, equal losses
    # every trajectory got at least its first turn's reward from the environment (0.25 per answered turn)
    assert all(s["reward_mean"] >= 0.25 for s in sync_steps), [s["reward_mean"] for s in sync_steps]
