"""The ``hflow-async`` command line as a user's process meets it (controller/cli.py): start errors answer
before Ray or a pool's libraries load."""

from __future__ import annotations

import re
import subprocess
import sys

from controller.config import load_config, to_yaml
from controller.job_checkpoint import CHECKPOINTS, JOB_FILE
from tests.controller._cli_job import REPO

# A start error answers in seconds; this bound only keeps a hung process from hanging the suite.
ANSWER_TIMEOUT_S = 120
# Loaded only once a job starts (controller.job.run_job): their import is what took minutes on a loaded machine.
JOB_ONLY_MODULES = ("ray", "controller.job", "trainers.group")


def imported_modules(importtime_stderr: str) -> set[str]:
    """Modules named by ``python -X importtime``'s lines on stderr."""
    return {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", importtime_stderr,
                                            re.MULTILINE)}


def cli_process(*args: str) -> tuple[int, list[str], set[str]]:
    """``python -m controller.cli *args`` in its own process: (exit code, stderr's lines other than the
    import report, the modules it imported)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "controller.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=ANSWER_TIMEOUT_S)
    message = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    return done.returncode, message, imported_modules(done.stderr)


def test_resume_of_a_run_never_checkpointed_answers_before_the_job_libraries_load(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(load_config(preset="tiny", overrides=[f"run_dir={run_dir}"])))
    code, message, modules = cli_process("--resume", str(run_dir))
    assert code == 2, message
    assert message == [f"hflow-async: cannot start: {run_dir} has no job checkpoint to resume from (checkpoints/step_N with "
                       "job.json, written every trainer.save_every steps, on a stop signal and at the end)"]
    assert not modules & set(JOB_ONLY_MODULES)
    assert not (run_dir / "metrics.jsonl").exists()
    # A checkpoint of another step than --resume-step's: the same immediate answer, naming the steps there are.
    (run_dir / CHECKPOINTS / "step_1").mkdir(parents=True)
    (run_dir / CHECKPOINTS / "step_1" / JOB_FILE).write_text("{}")
    code, message, modules = cli_process("--resume", str(run_dir), "--resume-step", "3")
    assert code == 2, message
    assert message == [f"hflow-async: cannot start: --resume-step 3: {run_dir} has job checkpoints of steps [1]"]
    assert not modules & set(JOB_ONLY_MODULES)
