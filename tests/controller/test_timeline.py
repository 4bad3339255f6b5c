"""``RUN_DIR/timeline.json`` and the per-step ``wait_s`` / ``response_lengths`` that ``bench/modes_bench.py``
reads (a whole tiny job: real Ray actors, TransferQueue and checkpoint-engine processes)."""

from __future__ import annotations

import json

import pytest

from controller.config import load_config
from controller.job import EXIT_OK, run_job

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("mode", ["sync", "fully-async"])
def test_timeline_records_updates_syncs_and_roller_busy(tmp_path, ray_cluster, mode):
    cfg = load_config(mode=mode, preset="tiny", overrides=[
        f"run_dir={tmp_path}", "metrics.progress=false", "data.size=32", "data.train_batch_size=8",
        "trainer.ppo_mini_batch_size=8", "trainer.total_steps=3", "rollout.max_response_length=6",
        "rollout.forced_response_lengths=[[3,1,2],[1,5,6]]"])
    assert run_job(cfg) == EXIT_OK
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert len(timeline["update"]) == len(timeline["sync"]) == 3
    for (s, e), (ss, se) in zip(timeline["update"], timeline["sync"], strict=True):
        assert s <= e <= ss <= se  # every update is followed by its weight sync
    busy = timeline["rollers"]["roller0"]
    assert busy and all(s <= e for s, e in busy)
    assert busy[0][0] < timeline["update"][0][0]  # the first batch is generated before the first update
    for step in steps:
        assert step["wait_s"] >= 0
        assert len(step["response_lengths"]) == step["num_samples"] == 8 * cfg.rollout.n
        assert set(step["response_lengths"]) <= {1, 2, 5, 6}  # forced lengths reach the job
    if mode == "sync":  # the roller is idle while the trainer updates
        for s, e in timeline["update"]:
            assert all(be <= s + 1e-3 or bs >= e - 1e-3 for bs, be in busy)
