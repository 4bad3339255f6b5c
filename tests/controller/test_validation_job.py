"""Validation, generation dumps and TensorBoard in whole tiny jobs (real Ray actors, TransferQueue, trainer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.config import load_config
from controller.generations import GENERATIONS_FILE
from controller.job import EXIT_OK, run_job
from tests.controller.test_validation import read_tensorboard

pytestmark = pytest.mark.timeout(300)

SMALL = ("data.size=64", "data.train_batch_size=8", "trainer.ppo_mini_batch_size=8", "data.val_size=6", "val.n=3",
         "data.val_disjoint=false")
GROUP = 3 + 1  # val.n sampled + 1 greedy per held-out prompt


def run(tmp_path: Path, mode: str, *overrides: str) -> tuple[int, list[dict], list[dict], dict]:
    """(exit code, step rows, validation rows, summary) of the tiny preset with ``overrides``."""
    cfg = load_config(mode=mode, preset="tiny", overrides=[f"run_dir={tmp_path}", "metrics.progress=false",
                                                             *SMALL, *overrides])
    code = run_job(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "summary.json").read_text())
    return code, [r for r in rows if not r.get("validation")], [r for r in rows if r.get("validation")], summary


def check_rounds(rounds: list[dict], versions: list[int], single_version: bool) -> None:
    assert sorted(r["weight_version"] for r in rounds) == versions
    for r in rounds:
        assert r["val/num_prompts"] == 6 and r["val/num_samples"] == 6 * GROUP and r["val/num_failed_groups"] == 0
        assert 0 <= r["val/accuracy"] <= 1 and 0 <= r["val/accuracy_greedy"] <= 1 and "val/pass@3" in r
        assert r["val/weight_version_min"] >= r["weight_version"]  # nothing older than the version it names
        if single_version:
            assert r["val/multi_version_samples"] == 0 and r["val/weight_version_max"] == r["weight_version"]


def test_sync_validation_rows_dump_and_tensorboard(tmp_path, ray_cluster):
    code, steps, rounds, summary = run(tmp_path, "sync", "trainer.total_steps=3", "trainer.val_every=2",
                                       "metrics.dump_every=2", "metrics.tensorboard=true")
    assert code == EXIT_OK and [s["step"] for s in steps] == [1, 2, 3]
    check_rounds(rounds, [0, 2, 3], single_version=True)  # before the first step, every 2, after the last
    assert summary["num_val_rounds"] == 3 and summary["val_accuracy_last"] == rounds[-1]["val/accuracy"]
    assert summary["num_groups_generated"] == summary["num_groups_admitted"] == 24  # validation counted apart
    dump = [json.loads(x) for x in (tmp_path / GENERATIONS_FILE).read_text().splitlines()]
    kinds = {}
    for row in dump:
        kinds.setdefault((row["kind"], row["step"], row["weight_version"]), []).append(row)
    assert sorted(kinds) == [("train", 2, 1), ("validation", 0, 0), ("validation", 2, 2)]
    assert len(kinds["train", 2, 1]) == 8 * 8 and len(kinds["validation", 2, 2]) == 6 * GROUP
    assert sum(r["greedy"] for r in kinds["validation", 0, 0]) == 6
    for row in dump:
        assert row["prompt"] == f"repeat the word {row['ground_truth']['answer']}"  # decoded where it lives
        assert isinstance(row["response"], str) and row["reward"] in (0.0, 1.0) and row["min_weight_version"] == (
            row["weight_version"])
    dumped = [r["reward"] for r in kinds["train", 2, 1]]
    assert sum(dumped) / len(dumped) == pytest.approx(steps[1]["reward_mean"])  # the samples step 2 trained
    scalars = read_tensorboard(tmp_path / "tensorboard")
    assert [step for step, _ in scalars["train/reward_mean"]] == [1, 2, 3]
    assert [v for _, v in scalars["train/reward_mean"]] == pytest.approx([s["reward_mean"] for s in steps])
    by_version = {r["weight_version"]: r["val/accuracy"] for r in rounds}
    assert dict(scalars["val/accuracy"]) == pytest.approx(by_version)


@pytest.mark.parametrize("mode", ["fully-async", pytest.param("one-step-off", marks=[pytest.mark.slow, pytest.mark.long])])
def test_validation_trains_every_step_in_the_overlapping_modes(tmp_path, ray_cluster, mode):
    """In fully-async validation overlaps training: the run trains every step on whole batches, none of its
    groups dropped (validation is outside the staleness bound), within the bound."""
    code, steps, rounds, summary = run(tmp_path, mode, "trainer.total_steps=4", "trainer.val_every=2",
                                       "algorithm.max_staleness=1")
    assert code == EXIT_OK and [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["num_groups"] == 8 for s in steps) and summary["num_dropped_groups"] == 0
    assert max(s["staleness_max"] for s in steps) <= 1 and summary["weight_version"] == 4
    check_rounds(rounds, [0, 2, 4], single_version=mode != "fully-async")
