"""Production modules hold only what a run path uses: the paths below were used by tests alone and now
live in ``tests/`` (issue 19, item 4)."""

from __future__ import annotations

import importlib

import pytest

TEST_ONLY = [
    ("rollers.roller", "PermitAdmission", "tests/rollers/engine_helpers.py (runs admit at the feeder)"),
    ("rollers.roller", "OpenAdmission", "the roller takes what the feeder put"),
    ("rollers.roller", "LocalGroupChannel", "tests/rollers/engine_helpers.py"),
    ("rollers.actor", "PermitAdmission", "tests/rollers/engine_helpers.py"),
    ("transferqueue.launch", "start_transferqueue_ray", "tests/transferqueue/ray_servers.py"),
    ("transferqueue", "start_transferqueue_ray", "tests/transferqueue/ray_servers.py"),
    ("controller.feeder", "FedGroup", "unused"),
    ("controller.runtime", "_tq_channel", "rollers.tq_channel.TQGroupChannel.from_handle"),
    ("trainers.metrics", "compute_data_metrics", "tests/trainers/test_losses.py"),
]


@pytest.mark.parametrize("module, name, where", TEST_ONLY)
def test_test_only_paths_are_not_in_production_modules(module, name, where):
    assert not hasattr(importlib.import_module(module), name), f"{module}.{name} belongs in {where}"


def test_trainer_group_moves_only_metadata():
    """``TrainerGroup`` offers ``train_step(meta)``; the tensor-passing stages are the tests'
    ``TensorTrainerGroup``."""
    from rollers.actor import RollerActor
    from rollers.roller import Roller
    from trainers.group import TrainerGroup

    for stage in ("compute_log_prob", "compute_values", "compute_advantages", "update_actor", "update_critic"):
        assert not hasattr(TrainerGroup, stage), stage
    assert hasattr(TrainerGroup, "train_step")
    assert not hasattr(Roller, "grant") and not hasattr(RollerActor, "grant")
