"""controller.resources.plan_threads: auto per mode, explicit integers as overrides; config validation."""

from __future__ import annotations

import pytest

from common.env import available_cores, resolve_num_threads
from controller.config import load_config
from controller.resources import plan_threads


def _cfg(mode: str, *overrides: str):
    """The tiny preset with both pools' threads auto (the preset pins them to 1), then ``overrides``."""
    auto = ["rollers.num_threads=auto", "trainer.num_threads=auto"]
    return load_config(mode=mode, preset="tiny", overrides=auto + list(overrides))


@pytest.mark.parametrize("cores,rollers,trainer", [(2, 1, 1), (3, 1, 2), (16, 8, 8), (1, 1, 1)])
def test_one_step_off_splits_the_cores(cores, rollers, trainer):
    plan = plan_threads(_cfg("one-step-off"), num_cores=cores)
    assert (plan.roller_threads, plan.trainer_threads) == (rollers, trainer)
    # One core cannot be split: both pools share it, and the trainer yields it while the roller decodes.
    assert ("cores split" if cores > 1 else "rollers on top") in plan.describe("one-step-off")


@pytest.mark.parametrize("cores,rollers,trainer", [(2, 1, 2), (3, 1, 3), (16, 8, 16), (1, 1, 1)])
def test_fully_async_gives_the_trainer_every_core_and_the_rollers_half_on_top(cores, rollers, trainer):
    plan = plan_threads(_cfg("fully-async"), num_cores=cores)
    assert (plan.roller_threads, plan.trainer_threads) == (rollers, trainer)
    assert "the trainer every core" in plan.describe("fully-async")


def test_sync_gives_every_core_to_each_phase():
    plan = plan_threads(_cfg("sync"), num_cores=8)
    assert (plan.roller_threads, plan.trainer_threads) == (8, 8)
    plan = plan_threads(_cfg("sync", "rollers.num_replicas=2", "trainer.num_ranks=4"), num_cores=8)
    assert (plan.roller_threads, plan.trainer_threads) == (4, 2)
    assert "sync: phases alternate" in plan.describe("sync")


def test_explicit_integers_override_and_auto_takes_the_rest():
    plan = plan_threads(_cfg("fully-async", "rollers.num_threads=3"), num_cores=8)
    assert (plan.roller_threads, plan.trainer_threads) == (3, 5)
    assert plan.chosen == "rollers explicit, trainer auto"
    plan = plan_threads(_cfg("one-step-off", "trainer.num_threads=8"), num_cores=8)
    assert (plan.roller_threads, plan.trainer_threads) == (1, 8)  # never below one thread
    plan = plan_threads(_cfg("sync", "rollers.num_threads=2", "trainer.num_threads=1"), num_cores=8)
    assert (plan.roller_threads, plan.trainer_threads) == (2, 1)


@pytest.mark.parametrize("value", ["0", "many", "1.5", "true"])
def test_bad_thread_counts_name_the_key(value):
    with pytest.raises(ValueError, match="rollers.num_threads"):
        _cfg("sync", f"rollers.num_threads={value}")


def test_a_pool_started_on_its_own_resolves_auto_to_every_core():
    assert resolve_num_threads("auto") == available_cores() >= 1
    assert resolve_num_threads(3) == 3
    with pytest.raises(ValueError, match="'auto'"):
        resolve_num_threads("3")


def test_core_lending_only_for_overlapping_modes_oversubscribing_one_node():
    for cfg in (_cfg("fully-async"), _cfg("fully-async", "rollers.num_threads=1", "trainer.num_threads=2"),
                _cfg("one-step-off", "rollers.num_threads=1", "trainer.num_threads=2")):
        plan = plan_threads(cfg, num_cores=2)
        assert plan.core_lending and "yielding theirs while they decode" in plan.describe(cfg.mode), cfg.mode
    for cfg in (_cfg("sync"), _cfg("one-step-off"), _cfg("fully-async", "rollers.num_threads=1", "trainer.num_threads=1"),
                _cfg("fully-async", "ray.address=127.0.0.1:6379"), _cfg("fully-async", "rollers.engine=sglang")):
        assert not plan_threads(cfg, num_cores=2).core_lending, cfg.mode
