import json
import urllib.request

import pytest

from controller.metrics import JobMetrics
from controller.report import REQUIRED_STEP_KEYS, RunReport, group_reward_stats


def test_group_reward_stats():
    stats = group_reward_stats({"a": [1, 0, 1, 0], "b": [0, 0, 0, 0], "c": [1, 1, 1, 1], "d": [0.5, 0, 0, 0]})
    assert stats == {"frac_groups_reward_variance": 0.5, "frac_groups_any_correct": 0.75}
    assert group_reward_stats({})["frac_groups_reward_variance"] == 0.0


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
