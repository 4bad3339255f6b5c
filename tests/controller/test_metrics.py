"""The job's Prometheus series: what the docstring table says is what is served, and the counters count
what their help says, where it happens (the schedule's stages driven with stand-ins for the pools)."""

from __future__ import annotations

import asyncio
import re

import controller.metrics
from common import schema
from controller.config import load_config
from controller.metrics import JobMetrics
from controller.report import RunReport
from controller.schedules import Stages
from transferqueue.records import BatchMeta


def _documented_series() -> dict[str, str]:
    """Series name -> type from the table of ``controller/metrics.py``'s module docstring."""
    rows = re.findall(r"^(hflow_\w+)(?:\{\w+\})?\s+(gauge|counter|histogram)\s", controller.metrics.__doc__, re.M)
    return dict(rows)


def test_docstring_table_is_the_served_series():
    served = {}
    for family in JobMetrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        served[name] = family.type
        assert len(family.documentation) > 20, (family.name, family.documentation)  # says what is counted
    assert _documented_series() == served
    assert "DESIGN.md" not in controller.metrics.__doc__  # no pointer to a file outside the repository


def test_count_produced_follows_the_higher_of_two_lower_bounds():
    metrics = JobMetrics()
    value = lambda: metrics.registry.get_sample_value("hflow_samples_produced_total")  # noqa: E731
    metrics.count_produced(8)     # the controller received 8 samples
    metrics.count_produced(5)     # a roller count polled before them: no change
    assert value() == 8
    metrics.count_produced(12)    # rollers produced 4 more that no one took yet
    assert value() == 12


class _FakeTQ:
    """The controller's TransferQueue client: hands out whole groups of ready samples."""

    def __init__(self, groups: list[list[dict]]):
        self.groups, self.next_id = list(groups), 0

    async def aget_meta(self, fields, batch_size, task, partition, **kwargs):
        tags = self.groups.pop(0)
        ids = list(range(self.next_id, self.next_id + len(tags)))
        self.next_id += len(tags)
        return BatchMeta(partition, ids, list(fields), tags)

    async def aclear(self, partition, sample_ids):
        return None


class _FakeTrainer:
    def train_step(self, meta):
        return {"actor/pg_loss": 0.0}


class _FakeRuntime:
    def __init__(self, groups):
        self.tq, self.trainer = _FakeTQ(groups), _FakeTrainer()


def _group(uid: str, n: int, version: int = 0) -> list[dict]:
    return [{schema.UID: uid, schema.MIN_WEIGHT_VERSION: version, schema.MAX_WEIGHT_VERSION: version,
             "reward": float(i % 2), schema.RESPONSE_LENGTH: 3, schema.FINISH_REASON: "stop"} for i in range(n)]


def test_stages_count_samples_where_they_are_seen(tmp_path):
    """Samples the controller takes from the TransferQueue count as produced at once (the rollers' own
    count is only polled every 2 s), so produced >= consumed + dropped at every moment; the sample-age
    histogram has one observation per trained sample, like consumed."""
    cfg = load_config(mode="sync", preset="tiny", overrides=["data.train_batch_size=2", "trainer.ppo_mini_batch_size=2",
                                                             f"run_dir={tmp_path}", "metrics.progress=false"])
    n = cfg.rollout.n
    metrics, report = JobMetrics(), RunReport(tmp_path, total_steps=2, progress=False)
    st = Stages(cfg, _FakeRuntime([_group(f"u{i}", n) for i in range(4)]), metrics, report)
    get = metrics.registry.get_sample_value

    async def steps():
        for step in range(2):
            meta = await st.generate(2, train_version=st.version)
            assert get("hflow_samples_produced_total") == 2 * n * (step + 1)
            assert get("hflow_samples_consumed_total") == 2 * n * step
            await st.update(meta)
            assert get("hflow_samples_consumed_total") == 2 * n * (step + 1) == get("hflow_samples_produced_total")
            assert get("hflow_sample_age_seconds_count") == get("hflow_samples_consumed_total")
            assert get("hflow_queue_lag_count") == get("hflow_response_length_count") == 2 * n * (step + 1)

    asyncio.run(steps())
    report.close()


def test_a_scrape_reads_consumed_and_dropped_before_produced():
    """A scrape runs on the HTTP server's thread while the schedule counts: it reads consumed and dropped
    first, so the produced it reads after them is never below them."""
    names = [family.name for family in JobMetrics().registry.collect()]  # the order a scrape reads them in
    assert names.index("hflow_samples_consumed") < names.index("hflow_samples_produced")
    assert names.index("hflow_samples_dropped") < names.index("hflow_samples_produced")
