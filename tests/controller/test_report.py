import json
import urllib.request

import pytest

from controller.metrics import JobMetrics
from controller.report import REQUIRED_STEP_KEYS, SUMMARY_KEYS, RunReport, group_reward_stats, plot_steps


def test_group_reward_stats():
    stats = group_reward_stats({"a": [1, 0, 1, 0], "b": [0, 0, 0, 0], "c": [1, 1, 1, 1], "d": [0.5, 0, 0, 0]})
    assert stats == {"frac_groups_reward_variance": 0.5, "frac_groups_any_correct": 0.75}
    assert group_reward_stats({}) == {"frac_groups_reward_variance": None, "frac_groups_any_correct": None}


def test_run_report_writes_jsonl_summary_and_plot(tmp_path):
    report = RunReport(tmp_path, total_steps=2, progress=False)
    for step in (1, 2):
        report.log_step({"step": step, "reward_mean": 0.1 * step, "weight_version": step, "staleness_mean": 0.5,
                         "staleness_max": 1, "samples_per_s": 3.0})
    with pytest.raises(ValueError, match="samples_per_s"):
        report.log_step({"step": 3, "reward_mean": 0, "weight_version": 3, "staleness_mean": 0, "staleness_max": 0})
    summary = report.finish({"model": "tiny", "task": "tiny-repeat"})
    report.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert all(set(REQUIRED_STEP_KEYS) <= set(x) for x in lines)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["num_steps"] == 2 and on_disk["model"] == "tiny" and on_disk == json.loads(json.dumps(summary))
    assert on_disk["reward_last"] == pytest.approx(0.2)
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_amend_adds_what_is_known_only_after_the_summary(tmp_path, capsys):
    """The job writes the summary, stops its pools and Ray, then adds the shutdown time and the final wall
    time to it."""
    report = RunReport(tmp_path, total_steps=1, progress=True)
    with pytest.raises(RuntimeError, match="before finish"):
        report.amend(shutdown_s=1.0)
    summary = report.finish({"status": "completed", "startup_s": 2.0, "wall_s": 5.0})
    report.close()
    assert {"startup_s", "shutdown_s"} <= set(SUMMARY_KEYS) and summary["shutdown_s"] is None
    assert "summary:" not in capsys.readouterr().out  # printed once complete, not before
    report.amend(shutdown_s=1.5, wall_s=6.5)
    report.announce()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == {**summary, "shutdown_s": 1.5, "wall_s": 6.5}
    assert '"shutdown_s": 1.5' in capsys.readouterr().out


def test_summary_has_every_key_whatever_the_outcome(tmp_path):
    """A run that ended before any step (failed at start-up, stopped early) still gets the full key set,
    null where unknown, and valid JSON (no NaN)."""
    report = RunReport(tmp_path / "early", total_steps=5, progress=False)
    summary = report.finish({"status": "failed", "error": "boom", "mode": "sync"})
    report.close()
    on_disk = json.loads((tmp_path / "early" / "summary.json").read_text(), parse_constant=pytest.fail)
    assert list(on_disk)[:len(SUMMARY_KEYS)] == list(SUMMARY_KEYS) and on_disk == summary
    assert on_disk["status"] == "failed" and on_disk["error"] == "boom" and on_disk["num_steps"] == 0
    for key in ("reward_first", "reward_mean", "staleness_max", "num_syncs", "weight_version",
                "frac_groups_any_correct", "model"):
        assert on_disk[key] is None, key
    assert not (tmp_path / "early" / "plot.png").exists()  # no step, nothing to plot


def test_plot_is_titled_and_scaled_for_reading(tmp_path):
    """The issue's case: rewards 0.008-0.031 (noise), accuracy equal to reward, staleness all 0."""
    rewards = [0.008, 0.031, 0.016, 0.023, 0.008]
    steps = [{"step": i + 1, "reward_mean": r, "accuracy": r, "weight_version": i + 1, "staleness_mean": 0.0,
              "staleness_max": 0, "samples_per_s": 3.0} for i, r in enumerate(rewards)]
    fig = plot_steps(steps, {"mode": "sync", "model": "tiny", "task": "tiny-repeat", "status": "completed"}, 5)
    ax_reward, ax_acc, ax_stale = fig.axes
    title = fig._suptitle.get_text()
    assert all(word in title for word in ("sync", "tiny", "tiny-repeat", "5 of 5 steps"))
    for ax in (ax_reward, ax_acc):  # own panels, each spanning [0, 1]: 0.008-0.031 is a flat line near 0
        low, high = ax.get_ylim()
        assert low <= 0 and high >= 1 and high - low < 1.2
    low, high = ax_stale.get_ylim()
    assert -0.5 <= low < 0 and high >= 1  # all-zero staleness: an axis of whole versions, not ±0.04
    assert all(float(t).is_integer() for t in ax_stale.get_yticks())
    assert all(float(t).is_integer() for t in ax_stale.get_xticks())  # whole steps
    fig.savefig(tmp_path / "plot.png", dpi=100)
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_metrics_endpoint_serves_every_series():
    metrics = JobMetrics()
    port = metrics.serve("127.0.0.1", 0)
    try:
        metrics.queue_depth.labels(task="train").set(3)
        metrics.roller_busy.labels(roller="0").set(0.5)
        metrics.queue_lag.observe(1)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        metrics.close()
    for name in metrics.series_names():
        assert name in body, name
    assert 'hflow_queue_depth{task="train"} 3.0' in body
    assert len(metrics.series_names()) >= 15
