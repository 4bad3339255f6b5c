"""deploy/check.py (``make deploy-check``) without a Prometheus: the dashboard names only series the job
exports and has a panel for each, and the check's own pieces reject what they must. The check itself (a
real Prometheus against a real run) is ``make deploy-check``, run by CI after ``make test``."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from controller.metrics import JobMetrics
from deploy import check

DASHBOARD = json.loads(check.DASHBOARD.read_text())


def test_every_dashboard_query_names_only_exported_series():
    queries = check.dashboard_queries(DASHBOARD)
    assert len(queries) >= 20
    assert check.unknown_series(queries, check.exported_series()) == []


def test_every_exported_series_has_a_panel():
    used = {name for _, _, expr in check.dashboard_queries(DASHBOARD) for name in check.SERIES_NAME.findall(expr)}
    families = {f.name for f in JobMetrics().registry.collect()}
    assert [f for f in sorted(families) if not any(u.startswith(f) for u in used)] == []


def test_exported_series_follow_the_exposition_format():
    names = check.exported_series()
    assert {"hflow_samples_consumed_total", "hflow_queue_lag_bucket", "hflow_queue_lag_count",
            "hflow_roller_pool_size", "hflow_accuracy_ratio"} <= names
    assert "hflow_samples_consumed" not in names  # a counter is scraped with _total


def test_a_made_up_series_or_a_query_without_one_is_reported():
    queries = [("Reward", "A", "hflow_reward_mean"), ("Typo", "A", "rate(hflow_rewrad_total[1m])"),
               ("Other", "B", "up")]
    assert check.unknown_series(queries, check.exported_series()) == [
        "panel 'Typo' query A: hflow_rewrad_total is not a series the job exports",
        "panel 'Other' query B: names no hflow_* series: up",
    ]


def test_grafana_variables_are_filled_in_or_rejected():
    variables = {"run": "r1", "__rate_interval": "10s"}
    assert check.expand('rate(hflow_x{run=~"$run"}[$__rate_interval])', variables) == 'rate(hflow_x{run=~"r1"}[10s])'
    assert check.expand('hflow_x{run=~"${run}"}', variables) == 'hflow_x{run=~"r1"}'
    with pytest.raises(check.CheckFailed, match=r"\$node"):
        check.expand('hflow_x{node="$node"}', variables)


def test_panels_are_laid_out_with_a_datasource_and_unique_ids():
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert {"type", "title", "gridPos"} <= p.keys(), p.get("title")
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["description"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    assert {v["name"] for v in DASHBOARD["templating"]["list"]} == {"datasource", "run"}


def test_the_check_scrapes_through_the_shipped_jobs():
    shipped = yaml.safe_load(check.PROMETHEUS_CONFIG.read_text())
    derived = check.derive_config(shipped, check.REPO / "sd", 1)
    assert [j["job_name"] for j in derived["scrape_configs"]] == ["hflow", "sglang"]
    assert [j["relabel_configs"] for j in derived["scrape_configs"]] == [j["relabel_configs"] for j in shipped["scrape_configs"]]
    assert {f for j in derived["scrape_configs"] for sd in j["file_sd_configs"] for f in sd["files"]} == {
        str(check.REPO / "sd" / "*.json")}
    assert derived["global"]["scrape_interval"] == "1s" and shipped["global"]["scrape_interval"] == "5s"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make deploy-check installs it)")
def test_promtool_accepts_the_shipped_config_and_rejects_a_broken_one(tmp_path):
    check.check_config(shutil.which("promtool"), check.PROMETHEUS_CONFIG)
    broken = tmp_path / "p.yml"
    broken.write_text("scrape_configs:\n  - job_name: hflow\n    file_sd_configs:\n      - files: ['runs/*/x.json']\n")
    with pytest.raises(check.CheckFailed, match="not valid for file discovery"):
        check.check_config(shutil.which("promtool"), broken)
