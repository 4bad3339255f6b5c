"""The per-step record a schedule writes (``Stages._record``): the clip ratio of the step's responses in
``metrics.jsonl`` and as the ``hflow_response_clip_ratio`` Prometheus series."""

from __future__ import annotations

import json
import urllib.request
from types import SimpleNamespace

import pytest

from common import schema
from controller.config import load_config
from controller.ledger import TrainedGroup
from controller.metrics import JobMetrics
from controller.report import RunReport
from controller.stages import REWARD_TAG, Stages


def _tag(uid: str, finish_reason: str, length: int) -> dict:
    return {schema.UID: uid, schema.MIN_WEIGHT_VERSION: 0, schema.MAX_WEIGHT_VERSION: 0, REWARD_TAG: 0.5,
            schema.RESPONSE_LENGTH: length, schema.FINISH_REASON: finish_reason}


def test_step_record_reports_the_clip_ratio(tmp_path):
    cfg = load_config(preset="tiny", overrides=["trainer.total_steps=1"])
    metrics, report = JobMetrics(), RunReport(tmp_path, total_steps=1, progress=False)
    pool = SimpleNamespace(size=lambda: 1)
    stages = Stages(cfg, rt=SimpleNamespace(pool=pool), metrics=metrics, report=report)
    tags = [_tag("u0", "length", 4), _tag("u0", "stop", 2), _tag("u1", "length", 4), _tag("u1", "stop", 1),
            _tag("u2", "stop", 3), _tag("u2", "stop", 3), _tag("u3", "stop", 1), _tag("u3", "length", 4)]
    trained = [TrainedGroup(f"u{i}", age_s=0.5, refill_round=0) for i in range(4)]
    stages._record(SimpleNamespace(tags=tags), 1, trained, {}, step_s=1.0, wait_s=0.0)
    report.close()
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["response_clip_ratio"] == pytest.approx(3 / 8)
    # Trained from version 1: the step (and the version it made) is 2, every sample one version stale.
    assert (record["step"], record["weight_version"], record["staleness_max"]) == (2, 2, 1)
    port = metrics.serve("127.0.0.1", 0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        metrics.close()
    assert "hflow_response_clip_ratio 0.375" in body
