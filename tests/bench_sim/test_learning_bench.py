"""``bench/learning_bench.py``'s curve, without running a job: the time axis leaves out the trainer's waits
on validation rounds (every mode's rollers take validation prompts first), and time to accuracy."""

from __future__ import annotations

import json
import math

import pytest

from bench import learning_bench


def test_only_trainer_waits_inside_a_round_are_left_out():
    busy = [(10.0, 20.0), (20.0, 21.0), (30.0, 40.0)]  # two updates, one sync
    # Round [0, 8]: the trainer waited all of it. Round [15, 35]: it waited 21-30 only. Overlapping rounds
    # count once; time after ``until`` does not count.
    assert learning_bench.validation_wait_s([(0.0, 8.0)], busy, 40.0) == pytest.approx(8.0)
    assert learning_bench.validation_wait_s([(15.0, 35.0)], busy, 40.0) == pytest.approx(9.0)
    assert learning_bench.validation_wait_s([(15.0, 35.0), (22.0, 28.0)], busy, 40.0) == pytest.approx(9.0)
    assert learning_bench.validation_wait_s([(15.0, 35.0)], busy, 25.0) == pytest.approx(4.0)
    assert learning_bench.validation_wait_s([(45.0, 50.0)], busy, 40.0) == 0.0


def test_curve_times_samples_and_time_to_accuracy(tmp_path):
    # Origin 100 s: a round for version 0 (8 s), update 1 ends at 120, a round for version 1 from its sync's
    # end (121) lasting 10 s while the trainer waits, update 2 at 140-150.
    rows = [{"step": 0, "validation": True, "weight_version": 0, "val/duration_s": 8.0, "val/accuracy": 0.1,
             "val/accuracy_greedy": 0.2},
            {"step": 1, "weight_version": 1, "num_samples": 16},
            {"step": 1, "validation": True, "weight_version": 1, "val/duration_s": 10.0, "val/accuracy": 0.3,
             "val/accuracy_greedy": 0.4},
            {"step": 2, "weight_version": 2, "num_samples": 16},
            {"step": 2, "validation": True, "weight_version": 2, "val/duration_s": 5.0, "val/accuracy": 0.5,
             "val/accuracy_greedy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "timeline.json").write_text(json.dumps({
        "rollers": {"roller0": [[100.0, 108.0], [108.0, 110.0], [131.0, 139.0]]},
        "update": [[110.0, 120.0], [140.0, 150.0]], "sync": [[120.0, 121.0], [150.0, 151.0]]}))
    (tmp_path / "summary.json").write_text(json.dumps({"wall_s": 70.0}))
    points = learning_bench.read_curve(tmp_path)["points"]
    assert [p["weight_version"] for p in points] == [0, 1, 2]
    assert [p["samples"] for p in points] == [0, 16, 32]
    assert [p["validation_wait_s"] for p in points] == pytest.approx([0.0, 8.0, 18.0])
    assert [p["time_s"] for p in points] == pytest.approx([0.0, 12.0, 32.0])
    assert learning_bench.time_to_accuracy(points, 0.3) == pytest.approx(12.0)
    assert math.isnan(learning_bench.time_to_accuracy(points, 0.9))


def test_median_over_runs_counts_a_run_that_never_got_there_as_slowest():
    nan = math.nan
    assert learning_bench.median_spread([30.0, 10.0, 20.0]) == {"median": 20.0, "min": 10.0, "max": 30.0}
    assert learning_bench.median_spread([10.0, nan, 20.0]) == {"median": 20.0, "min": 10.0, "max": 20.0}
    assert math.isnan(learning_bench.median_spread([10.0, nan, nan])["median"])
    assert learning_bench.median_spread([10.0, 20.0])["median"] == 15.0
    assert math.isnan(learning_bench.median_spread([10.0, nan])["median"])
    assert all(math.isnan(v) for v in learning_bench.median_spread([nan]).values())


def test_reps_default_to_three_and_one_for_quick():
    assert learning_bench.parse_args([]).reps == 3
    assert learning_bench.parse_args(["--quick"]).reps == 1
    assert learning_bench.parse_args(["--quick", "--reps", "3"]).reps == 3
    with pytest.raises(SystemExit):
        learning_bench.parse_args(["--reps", "0"])


def _fake_run(run_dir, acc1: float, update_end: float) -> None:
    """A completed two-version run: initial accuracy 0.1, ``acc1`` after one update ending at ``update_end``."""
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "validation": True, "weight_version": 0, "val/duration_s": 0.0, "val/accuracy": 0.1},
            {"step": 1, "weight_version": 1, "num_samples": 8},
            {"step": 1, "validation": True, "weight_version": 1, "val/duration_s": 0.0, "val/accuracy": acc1}]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run_dir / "timeline.json").write_text(json.dumps({
        "rollers": {"roller0": [[0.0, 5.0]]}, "update": [[5.0, update_end]], "sync": [[update_end, update_end]]}))
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "wall_s": update_end}))


def test_reused_runs_give_medians_per_mode(tmp_path, capsys):
    acc = {"sync": (0.3, 0.1, 0.4), "one-step-off": (0.5, 0.6, 0.2), "fully-async": (0.1, 0.1, 0.3)}
    for rep in range(3):
        for mode, values in acc.items():
            _fake_run(tmp_path / "learning_runs" / f"rep{rep}" / mode, values[rep], 10.0 + rep)
    learning_bench.main(["--reps", "3", "--reuse-runs", "--out", str(tmp_path)])
    result = capsys.readouterr().out.strip().splitlines()[-1]
    # Target 2 x 0.1: sync reaches it in reps 0 and 2 (10 s, 12 s), one-step-off in all three, fully-async
    # only in rep 2 (its median never gets there).
    assert result == ("RESULT acc0=0.1000 acc_sync=0.3000 acc_one_step_off=0.5000 acc_fully_async=0.1000 "
                      "tta_s_sync=12.0 tta_s_one_step_off=11.0 tta_s_fully_async=nan target=0.2000 reps=3")
    saved = json.loads((tmp_path / "learning_bench.json").read_text())
    assert saved["modes"]["sync"]["final_accuracy"] == {"median": 0.3, "min": 0.1, "max": 0.4}
    assert len(saved["modes"]["sync"]["runs"]) == 3 and (tmp_path / "learning_bench.png").exists()
