import pytest

from controller.admission import Admission, staleness


def test_sync_bound_admits_exactly_one_batch_per_version():
    adm = Admission(train_batch_size=8, max_staleness=0)
    assert adm.limit(0) == 7 and adm.num_admissible(0) == 8  # positive at max_staleness=0
    adm.start(8, weight_version=0)
    assert adm.num_admissible(0) == 0
    assert adm.num_admissible(1) == 8
    with pytest.raises(ValueError, match="staleness bound"):
        adm.start(1, weight_version=0)


def test_staleness_one_lets_producer_run_one_batch_ahead():
    adm = Admission(train_batch_size=4, max_staleness=1)
    assert adm.num_admissible(0) == 8
    adm.start(8, 0)
    assert adm.num_admissible(0) == 0 and adm.num_admissible(1) == 4


def test_dropped_groups_are_reissued_within_the_bound():
    adm = Admission(train_batch_size=4, max_staleness=1)
    adm.start(8, 0)
    adm.drop(2)
    assert adm.num_admissible(0) == 2
    adm.start(2, 0)
    assert adm.started - adm.dropped == 8


def test_staleness_definition():
    assert staleness(trainer_weight_version=5, min_weight_version=3) == 2
    with pytest.raises(ValueError, match="train_batch_size"):
        Admission(train_batch_size=0, max_staleness=0)
