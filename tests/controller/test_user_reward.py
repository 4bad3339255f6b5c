"""A user's reward (``rollout.reward=module:function``) or task (``data.task=module:name``): found next to the
user's work without PYTHONPATH, and a reward that cannot be loaded is a config error before any pool starts
(exit 2, one line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def hflow(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the project itself; the user's module is not on it
    return subprocess.run([sys.executable, "-m", "controller.cli", "--preset", "tiny", "metrics.progress=false",
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=280)


@pytest.mark.parametrize("spec, needle", [
    ("no_such_module:score", "cannot import 'no_such_module'"),
    ("broken_reward:score", "ZeroDivisionError"),
    ("broken_reward:missing", "has no callable 'missing'"),
    ("broken_reward:one_arg", "fn(response_text: str, ground_truth: dict)"),
])
def test_unloadable_reward_is_a_start_error(tmp_path, spec, needle):
    source = {"missing": "score = None\nmissing = 1\n", "one_arg": "def one_arg(text):\n    return 1.0\n"}
    (tmp_path / "broken_reward.py").write_text(source.get(spec.split(":")[1], "1 / 0\n"))
    start = time.monotonic()
    out = hflow(tmp_path, f"rollout.reward={spec}", f"run_dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("hflow-async:")]
    assert len(errors) == 1 and f"rollout.reward={spec!r}" in errors[0] and needle in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "pools up" not in out.stdout
    assert time.monotonic() - start < 120


def test_reward_module_in_the_current_directory_is_used(tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "def score(response_text, ground_truth):\n    return 0.25\n")
    out = hflow(tmp_path, "rollout.reward=my_reward:score", "trainer.total_steps=1", "data.train_batch_size=2",
                "trainer.ppo_mini_batch_size=2", f"run_dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr[-3000:]
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["reward_mean"] == 0.25


def test_task_plugin_in_the_current_directory_is_used_with_its_reward(tmp_path):
    """``data.task=module:name``: the feeder loads the user's task, and ``rollout.reward=auto`` becomes the
    reward the task registered with (here a user function), resolved by the controller for the rollers."""
    (tmp_path / "my_task.py").write_text(
        "from controller.tasks import TaskRecord, register_task\n\n"
        "def score(response_text, ground_truth):\n    return ground_truth['value']\n\n"
        "@register_task('fixed', reward='my_task:score')\n"
        "def fixed(size, seed, value=0.0):\n"
        "    return [TaskRecord(f'repeat the word {w}', {'value': value}) for w in 'abcdefgh'[:size]]\n")
    out = hflow(tmp_path, "data.task=my_task:fixed", "data.size=4", "data.task_kwargs={value: 0.75}",
                "trainer.total_steps=1", "data.train_batch_size=2", "trainer.ppo_mini_batch_size=2",
                f"run_dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr[-3000:]
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["reward_mean"] == 0.75


def test_kl_without_reference_is_a_config_error(tmp_path):
    out = hflow(tmp_path, "algorithm.use_kl_loss=true", f"run_dir={tmp_path / 'run'}")
    assert out.returncode == 2 and "trainer.use_reference=true" in out.stderr


def test_plugin_in_the_current_directory_is_found_by_the_console_script(tmp_path):
    script = Path(sys.executable).parent / "hflow-async"
    if not script.exists():
        pytest.skip("the hflow-async console script is not installed beside this interpreter")
    (tmp_path / "my_estimator.py").write_text(
        "from trainers.advantages import register_adv_estimator\n"
        "from tests.trainers.plugin_estimator import group_max_baseline\n"
        "register_adv_estimator('my_max', input_fields=('uid',))(group_max_baseline)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(script), "show-config", "algorithm.adv_estimator=my_estimator:my_max"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "adv_estimator: my_estimator:my_max" in out.stdout
