"""The job's Prometheus series: what the docstring table says is what is served, with help texts that say
what is counted (where the stages count them: tests/controller/test_stages.py)."""

from __future__ import annotations

import re

import controller.metrics
from controller.metrics import JobMetrics


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


def test_a_scrape_reads_consumed_and_dropped_before_produced():
    """A scrape runs on the HTTP server's thread while the schedule counts: it reads consumed and dropped
    first, so the produced it reads after them is never below them."""
    names = [family.name for family in JobMetrics().registry.collect()]  # the order a scrape reads them in
    assert names.index("hflow_samples_consumed") < names.index("hflow_samples_produced")
    assert names.index("hflow_samples_dropped") < names.index("hflow_samples_produced")
