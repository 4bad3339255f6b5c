"""The README as a guide: it points only at files in the repository, and its tables match the code."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from controller.metrics import JobMetrics
from controller.report import SUMMARY_KEYS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in out.stdout.splitlines()]


def test_no_pointer_to_a_design_document_outside_the_repository():
    offenders = [str(p.relative_to(REPO)) for p in _tracked("*.py", "*.md", "*.yaml")
                 if p.is_file() and not p.is_relative_to(REPO / "tests") and "DESIGN.md" in p.read_text()]
    assert offenders == []


GENERATED = {"bench/.envs/"}  # made by the benchmarks when they run, named by the README


def test_readme_paths_exist():
    """Every path the README names inside the repository's folders is a file or folder of it."""
    roots = {p.relative_to(REPO).parts[0] for p in _tracked() if len(p.relative_to(REPO).parts) > 1}
    paths = {m for m in re.findall(r"`([\w.-]+/[\w./-]*)`", README) if m.split("/")[0] in roots} - GENERATED
    assert len(paths) >= 5
    assert [p for p in sorted(paths) if not (REPO / p).exists()] == []


def test_readme_metrics_table_is_the_served_series():
    table = README.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    documented = dict(re.findall(r"^\| `(hflow_\w+)(?:\{\w+\})?` \| (\w+) \|", table, re.M))
    served = {f.name + ("_total" if f.type == "counter" else ""): f.type for f in JobMetrics().registry.collect()}
    assert documented == served
    assert "metrics.port=" in table  # how to get a fixed scrape target


def test_readme_guides_the_mode_knobs_the_progress_line_and_the_summary():
    modes = README.split("### Choosing a mode", 1)[1].split("\n## ", 1)[0]
    for key in ("max_staleness", "require_batches", "trigger_sync_steps", "stale_correction"):
        assert f"| `algorithm.{key}` (" in modes, key
    progress = README.split("## Reading a run", 1)[1].split("\n## ", 1)[0]
    for field in ("`v12`", "`staleness 0.44/1`", "`acc 0.500`", "samples/s", "`step 1.2s`"):
        assert field in progress, field
    assert "show-config --describe" in README
    assert all(f"`{key}`" in README for key in ("startup_s", "shutdown_s", "wall_s")), SUMMARY_KEYS
