"""The group ledger (``controller.ledger``): the admission bound, every way a group leaves it, one staleness
convention, its checkpoint state in both formats — and that no other module edits its state."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from controller.ledger import (
    FORMAT,
    REISSUED_NEWER_WEIGHTS,
    REISSUED_ROLLER_LEFT,
    REISSUED_STALE,
    ZERO_VARIANCE,
    GroupLedger,
    ledger_state,
    max_live_groups,
    staleness,
)

ROOT = Path(__file__).resolve().parents[2]


def _ledger(batch=4, max_staleness=1, total=100, replaces_failed=True) -> GroupLedger:
    return GroupLedger(batch, max_staleness, total, replaces_failed)


def _admit(ledger: GroupLedger, k: int, prefix: str = "g", bounded: bool = True) -> list[str]:
    reserved = ledger.reserve(k, bounded)
    uids = [f"{prefix}{ledger.num_started - reserved + i}" for i in range(reserved)]
    ledger.admitted(reserved, uids)
    return uids


def test_max_staleness_zero_admits_exactly_one_batch_per_synced_version():
    ledger = _ledger(batch=8, max_staleness=0)
    assert ledger.admission_limit() == 7 and ledger.num_admissible() == 8
    uids = _admit(ledger, 20)
    assert len(uids) == 8 and ledger.num_admissible() == 0 and ledger.at_cap()
    ledger.trained(uids)  # the trainer is at 1, the rollers still at 0: the bound holds during a sync
    assert ledger.num_admissible() == 0
    ledger.synced(1)
    assert ledger.num_admissible() == 8
    assert ledger.num_admissible(bounded=False) == 100 - 8  # unbounded: the groups of the run not started yet


def test_max_staleness_one_runs_one_batch_ahead_and_the_total_caps_admission():
    ledger = _ledger(batch=4, max_staleness=1, total=10)
    assert len(_admit(ledger, 100)) == 8 and ledger.num_admissible() == 0
    ledger.synced(0)
    assert ledger.num_admissible() == 0
    ledger.trained([f"g{i}" for i in range(4)])
    ledger.synced(1)
    assert ledger.num_admissible() == 2  # the bound allows 4 more, the run's total only 2


def test_a_replacement_takes_its_predecessors_slot_and_is_counted_by_why():
    ledger = _ledger(batch=4, max_staleness=1)
    uids = _admit(ledger, 8)
    assert ledger.num_admissible() == 0
    ledger.replaced(uids[0], "g0.r1", REISSUED_ROLLER_LEFT)
    ledger.replaced(uids[1], "g1.r1", REISSUED_STALE)
    ledger.replaced(uids[2], "g2.r1", REISSUED_NEWER_WEIGHTS)
    ledger.replaced(uids[3], "s9.p0", ZERO_VARIANCE)
    ledger.replaced("s9.p0", "s9.p1", ZERO_VARIANCE)
    assert ledger.num_admissible() == 0 and ledger.outstanding == 8  # each took its predecessor's slot
    assert ledger.counts() == {"num_dropped_groups": 2, "num_failed_groups": 0, "num_zero_variance_groups": 2,
                               "num_reissued_groups": 1}
    assert ledger.refill_round("s9.p1") == 2 and ledger.refill_round("g0.r1") == 0
    ledger.replaced("s9.p1", "s9.p1.r1", REISSUED_ROLLER_LEFT)  # a re-issue keeps its refill round
    assert ledger.refill_round("s9.p1.r1") == 2
    with pytest.raises(ValueError, match="not one of"):
        ledger.replaced("g4", "x", "lost")


@pytest.mark.parametrize("replaces_failed", [True, False])
def test_failed_groups_leave_and_free_their_slots_only_where_the_schedule_replaces_them(replaces_failed):
    ledger = _ledger(batch=4, max_staleness=0, replaces_failed=replaces_failed)
    uids = _admit(ledger, 4)
    ledger.failed(uids[:2], skipped=True)
    assert ledger.outstanding == 2 and ledger.counts()["num_failed_groups"] == 2
    assert ledger.num_admissible() == (2 if replaces_failed else 0)
    ledger.failed(uids[2:3], skipped=False)  # on_failed_group=fail: counted, the run ends
    assert ledger.outstanding == 2 and ledger.counts()["num_failed_groups"] == 3


def test_training_advances_the_version_and_reports_what_it_knew():
    ledger = _ledger()
    uids = _admit(ledger, 2)
    trained = ledger.trained([uids[0]] * 3 + [uids[1]])  # one uid per sample: each group once
    assert [g.uid for g in trained] == uids and all(g.age_s >= 0 for g in trained)
    assert ledger.weight_version == ledger.step == 1 and ledger.outstanding == 0
    with pytest.raises(ValueError, match="ahead of the trainer"):
        ledger.synced(2)


def test_short_feed_exhausts_and_unstarts_the_unfilled_slots():
    ledger = _ledger(batch=4, max_staleness=1)
    reserved = ledger.reserve(5)
    ledger.admitted(reserved, ["a", "b"])
    assert ledger.exhausted and ledger.num_started == 2 and ledger.num_admissible() == 0
    ledger.requeued(["x"])  # a trainer restart gives trained prompts back: the data is not exhausted
    assert not ledger.exhausted and ledger.num_admissible() == 8 - 2 + 1


def test_rewind_never_leaves_the_rollers_version_ahead_of_the_trainer():
    ledger = _ledger(batch=2, max_staleness=0)
    for _ in range(3):
        ledger.trained(_admit(ledger, 2))
        ledger.synced(ledger.weight_version)
    ledger.rewind(1)
    assert ledger.weight_version == ledger.synced_weight_version == 1


def test_one_staleness_convention():
    assert staleness(trained_from=5, min_weight_version=3) == 2
    ledger = _ledger()
    ledger.trained([])
    assert ledger.staleness(min_weight_version=0) == 1
    assert max_live_groups(4, 0) == 8 and max_live_groups(4, 3) == 16
    with pytest.raises(ValueError, match="train_batch_size"):
        GroupLedger(0, 0, 1, False)


def test_state_round_trips_and_a_restore_adopts_refill_rounds():
    ledger = _ledger(batch=2, max_staleness=2)
    uids = _admit(ledger, 4)
    ledger.replaced(uids[0], "r0", ZERO_VARIANCE)
    ledger.trained(uids[1:3])
    ledger.synced(1)
    ledger.failed([uids[3]], skipped=True)
    state = json.loads(json.dumps(ledger.to_state()))
    assert state["format"] == FORMAT and state["refill_rounds"] == {"r0": 1}
    again = _ledger(batch=2, max_staleness=2)
    rounds = again.restore(state)
    again.adopt(["r0"])
    again.adopt_rounds(rounds)
    assert again.to_state() == {**state, "synced_weight_version": 0, "num_syncs": 1}  # fresh rollers: version 0
    assert again.refill_round("r0") == 1


def test_a_checkpoint_written_before_the_ledger_is_read_and_an_unknown_format_is_refused():
    flat = {"step": 3, "weight_version": 3, "synced_weight_version": 3, "admission_started": 9,
            "admission_dropped": 2, "feeder": {"num_fed": 9, "reissues": {}, "exhausted": True},
            "buffered_uids": [], "in_flight_uids": [], "num_syncs": 3, "num_dropped_groups": 1,
            "num_failed_groups": 1, "num_zero_variance_groups": 0, "refill_depth": {"s1.p0": 1}, "reason": "x",
            "saved_at": 0.0, "num_sample_bytes": 0, "config": {}}
    ledger = _ledger()
    assert ledger.restore(flat) == {"s1.p0": 1}
    state = ledger.to_state()
    assert (state["weight_version"], state["started"], state["released"], state["exhausted"]) == (3, 9, 2, True)
    assert ledger.counts()["num_dropped_groups"] == 1 and ledger.num_syncs == 3
    with pytest.raises(ValueError, match="format 3 is not one this version reads"):
        ledger_state({"format": 3, "ledger": {"format": 3}})


def test_job_state_reads_both_formats_and_refuses_others(tmp_path):
    from controller.job_checkpoint import JOB_FILE, JobState

    ledger = _ledger()
    ledger.trained(_admit(ledger, 4))
    current = {"format": FORMAT, "step": 1, "weight_version": 1, "ledger": ledger.to_state(),
               "feeder": {"exhausted": False}, "buffered_uids": ["a"], "in_flight_uids": [], "reason": "r",
               "saved_at": 0.0, "num_sample_bytes": 0, "config": {}}
    (tmp_path / JOB_FILE).write_text(json.dumps(current))
    read = JobState.read(tmp_path)
    assert read.ledger == ledger.to_state() and read.buffered_uids == ["a"] and read.format == FORMAT
    (tmp_path / JOB_FILE).write_text(json.dumps({**current, "format": 7, "ledger": {"format": 7}}))
    with pytest.raises(ValueError, match=r"job.json: job checkpoint format 7 is not one this version reads"):
        JobState.read(tmp_path)
    (tmp_path / JOB_FILE).write_text("[]")
    with pytest.raises(ValueError, match="not a readable job checkpoint"):
        JobState.read(tmp_path)


# ------------------------------------------------------------------------------------ nobody else edits it


def test_the_ledgers_state_is_private_and_read_only_from_outside():
    ledger = _ledger()
    assert all(name.startswith("_") for name in vars(ledger)), vars(ledger)
    for name in ("weight_version", "step", "synced_weight_version", "outstanding", "exhausted", "closed",
                 "num_started", "num_syncs"):
        with pytest.raises(AttributeError):
            setattr(ledger, name, 0)


def test_no_module_touches_the_ledgers_private_fields_or_keeps_group_state_of_its_own():
    """Outside ``controller/ledger.py`` no code reads or writes ``<something>.ledger._<field>``, and the stages
    hold none of the state the ledger owns (the blackboard fields they had)."""
    offenders = []
    for path in [*ROOT.glob("controller/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py")]:
        if path.name == "ledger.py" and path.parent.name == "controller":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "ledger"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .ledger.{node.attr}")
    assert not offenders, offenders
    stages = (ROOT / "controller" / "stages.py").read_text()
    for field in ("self.admission", "self.outstanding", "self.weight_version", "self.synced_weight_version",
                  "self.refill_depth", "self.admitted_at", "self.exhausted", "self.num_dropped_groups"):
        assert field not in stages, field
