"""The job's Prometheus file_sd targets file (controller/prometheus_sd.py): format, copy, end of run."""

from __future__ import annotations

import json
import socket

import pytest

from controller.prometheus_sd import TARGETS_FILE, TargetsFile, scrape_address, target_groups, url_address


def test_addresses_a_prometheus_can_reach():
    assert scrape_address("127.0.0.1", 9400) == "127.0.0.1:9400"
    assert scrape_address("0.0.0.0", 9400) == f"{socket.gethostname()}:9400"  # a wildcard bind: this host
    assert scrape_address("::1", 9400) == "[::1]:9400"
    assert url_address("http://127.0.0.1:30001/") == "127.0.0.1:30001"
    assert url_address("https://sglang.internal") == "sglang.internal:443"
    with pytest.raises(ValueError, match="ftp://x"):
        url_address("ftp://x")


def test_target_groups_label_each_component():
    groups = target_groups({"run": "r1"}, "127.0.0.1:9400", {"roller1": "http://127.0.0.1:2", "roller0": "http://h:1"})
    assert groups == [
        {"targets": ["127.0.0.1:9400"], "labels": {"run": "r1", "component": "controller"}},
        {"targets": ["h:1"], "labels": {"run": "r1", "component": "sglang", "roller": "roller0"}},
        {"targets": ["127.0.0.1:2"], "labels": {"run": "r1", "component": "sglang", "roller": "roller1"}},
    ]
    assert target_groups({}, None, {}) == []  # metrics off, torch engine: nothing to scrape


def test_targets_file_and_its_copy_follow_the_job(tmp_path):
    run_dir, sd_dir = tmp_path / "runs" / "r1", tmp_path / "sd"
    run_dir.mkdir(parents=True)
    targets = TargetsFile(run_dir, sd_dir, {"run": "r1"})
    targets.update(controller="127.0.0.1:9400")
    targets.update(sglang={"roller0": "http://127.0.0.1:30001"})  # the controller's entry is kept
    [copy] = list(sd_dir.glob("hflow-r1-*.json"))
    written = json.loads((run_dir / TARGETS_FILE).read_text())
    assert written == json.loads(copy.read_text())
    assert [g["targets"] for g in written] == [["127.0.0.1:9400"], ["127.0.0.1:30001"]]
    assert [p.name for p in run_dir.iterdir()] == [TARGETS_FILE]  # no temporary file left behind
    other = TargetsFile(tmp_path / "elsewhere" / "r1", sd_dir, {})  # same run name, other directory
    assert other.copy != copy
    targets.close()
    targets.close()  # idempotent
    assert json.loads((run_dir / TARGETS_FILE).read_text()) == [] and not copy.exists()


def test_no_sd_dir_means_no_copy(tmp_path):
    targets = TargetsFile(tmp_path, "", {})
    targets.update(controller="127.0.0.1:1")
    assert targets.copy is None and [p.name for p in tmp_path.iterdir()] == [TARGETS_FILE]


def test_rollers_name_an_sglang_metrics_url_only_where_one_is_served():
    import asyncio
    from types import SimpleNamespace

    from rollers.actor import RollerActor
    from rollers.config import RollersConfig

    def url(engine: str, **cfg):
        actor = SimpleNamespace(rollers_cfg=RollersConfig(engine=engine, **cfg), engine=SimpleNamespace(url="http://h:1"))
        return asyncio.run(RollerActor.metrics_url(actor))

    assert url("sglang") == "http://h:1"                            # a real SGLang server, --enable-metrics
    assert url("sglang", sglang_url="http://h:1", sglang_launch="torch") == "http://h:1"  # the user's server
    assert url("sglang", sglang_launch="torch") is None             # our torch server: no /metrics
    assert url("torch") is None
