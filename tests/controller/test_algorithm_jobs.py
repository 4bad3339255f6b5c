"""Algorithm plug-ins in whole jobs (tiny preset, sync): ReMax's roller extra reaches the trainer through the
runtime, and plug-ins chosen by name or as ``module:name`` run in the Ray trainer ranks."""

from __future__ import annotations

import math

import pytest

from controller.job import EXIT_OK
from tests.controller.test_job import SMALL, run

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    "overrides",
    [
        # the rollers add remax_baseline because the estimator's roller_extras say so
        ("algorithm.adv_estimator=remax", "algorithm.policy_loss.name=cispo"),
        # an estimator from outside the package, GPG's loss, token-sum, a straight-through KL loss
        ("algorithm.adv_estimator=tests.trainers.plugin_estimator:group_max_baseline", "algorithm.policy_loss.name=gpg",
         "algorithm.loss_agg_mode=token-sum", "trainer.use_reference=true", "algorithm.use_kl_loss=true",
         "algorithm.kl_estimator=k3+"),
    ],
    ids=["remax-cispo", "plugin-gpg-kl"],
)
def test_plugins_run_a_job(tmp_path, ray_cluster, overrides):
    code, steps, summary = run(tmp_path, "sync", *SMALL, "trainer.total_steps=2", *overrides)
    assert code == EXIT_OK and summary["status"] == "completed" and len(steps) == 2
    for step in steps:
        assert math.isfinite(step["actor/pg_loss"]) and step["actor/num_tokens"] > 0
        if "algorithm.use_kl_loss=true" in overrides:
            assert math.isfinite(step["actor/kl_loss"])
