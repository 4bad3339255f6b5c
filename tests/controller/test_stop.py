"""Stopping a job: a real ``hflow-async --preset tiny`` process (``python -m controller.cli``, the console
script's entry point) gets SIGTERM, SIGINT or SIGHUP, to its process or to its whole process group (as a
terminal's Ctrl-C or hangup, ``timeout``, ``kill -- -PGID``, do it), once it has started steps, or while its
pools start. It prints one line, no traceback, exits 128 + the signal within seconds, leaves a summary with
every key, and nothing it started is left running. A SIGKILL of its process leaves nothing running either."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.report import SUMMARY_KEYS
from tests.controller._cli_job import CliJob

START_TIMEOUT_S = 240  # Ray, the TransferQueue servers and the pools start on a loaded 2-core machine
STOP_TIMEOUT_S = 120
LEFT_WITHIN_S = 15  # nothing of the job may run this long after its process ended
STEP_LINE = re.compile(r"^step +\d+/", re.MULTILINE)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(START_TIMEOUT_S + STOP_TIMEOUT_S + 60)]


def run_and_stop(run_dir: Path, mode: str, sig: signal.Signals, ready: Callable[[int, str, str], bool],
                 again_after_s: float | None = None, to_group: bool = False, to_all: bool = False,
                 **env_vars: str):
    """Start the tiny preset in ``mode`` (with ``env_vars`` in its environment), send ``sig`` to it once
    ``ready(pid, stdout, stderr)`` (and again ``again_after_s`` later, as an impatient user does), to its
    process, (``to_group``) to its process group, or (``to_all``) to every process of the job; returns (exit
    code, stdout, stderr, what of the job still ran ``LEFT_WITHIN_S`` after it ended: ``CliJob.running``).
    The process and everything it started are killed if it does not end."""
    job = CliJob(["--mode", mode, "--preset", "tiny", f"run_dir={run_dir}"], **env_vars)
    proc = job.proc

    def send() -> None:
        if to_all:  # as systemd (KillMode=control-group) and Slurm's scancel do: every process, Ray's too
            for pid in [int(p.split()[0]) for p in job.running()]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        elif to_group:  # as `kill -SIG -- -PGID`, `timeout` and a terminal do; the job leads its group (CliJob)
            os.killpg(proc.pid, sig)
        else:  # to the job's process only, as `kill PID` does
            proc.send_signal(sig)

    try:
        wait_until_ready(job, ready)
        send()
        if again_after_s is not None:
            time.sleep(again_after_s)
            if proc.poll() is None:
                send()
        code = proc.wait(timeout=STOP_TIMEOUT_S)
        left = left_running(job)
    finally:
        job.close(kill_group=True)  # what was left (asserted by the caller) goes too
    return code, job.out(), job.err(), left


def wait_until_ready(job: CliJob, ready: Callable[[int, str, str], bool]) -> None:
    proc = job.proc
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready(proc.pid, job.out(), job.err()):
        assert proc.poll() is None, f"ended before the signal (rc {proc.returncode}):\n{job.err()[-3000:]}"
        assert time.monotonic() < deadline, f"not ready within {START_TIMEOUT_S}s:\n{job.err()[-3000:]}"
        time.sleep(0.2)


def left_running(job: CliJob) -> list[str]:
    """What of ``job`` (ended) still runs ``LEFT_WITHIN_S`` seconds after it ended (empty once all is gone)."""
    deadline = time.monotonic() + LEFT_WITHIN_S
    while (left := job.running()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def steps_started(pid: int, out: str, err: str) -> bool:
    return STEP_LINE.search(out) is not None


def pools_starting(pid: int, out: str, err: str) -> bool:
    """The job has started its TransferQueue servers: Ray is up, the pools are starting, no step yet."""
    for child in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((child / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"transferqueue.launch" in (child / "cmdline").read_bytes():
                return True
        except (OSError, ValueError, IndexError):  # a process that ended while we looked
            continue
    return False


def check_stopped(run_dir: Path, code: int, out: str, err: str, sig: signal.Signals, left: list[str]) -> dict:
    """Exit code 128 + sig, one stop line and no traceback, nothing of the job left running; the run's
    summary (all keys, interrupted, its shutdown time)."""
    assert code == 128 + sig, (code, err[-3000:])
    assert left == [], left
    for noise in ("Traceback", "Task exception was never retrieved", "KeyboardInterrupt", "run failed"):
        assert noise not in out + err, (noise, err[-3000:])
    stops = [line for line in err.splitlines() if line.startswith("hflow-async:")]
    assert len(stops) == 1 and stops[0].startswith(f"hflow-async: stopped by {sig.name} "), stops
    assert "Failed to connect to GCS" not in err, err[-3000:]  # Ray ends a driver whose GCS is gone after 60 s
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) == {*SUMMARY_KEYS, "config"}
    assert summary["status"] == "interrupted" and summary["error"] == f"stopped by {sig.name}"
    assert summary["model_dir"] is None and not (run_dir / "model").exists()  # only a completed run exports
    assert summary["shutdown_s"] is not None and 0 <= summary["shutdown_s"] < summary["wall_s"]
    return summary


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.long), "one-step-off", pytest.param("fully-async", marks=pytest.mark.long)])
def test_sigterm_during_steps_is_a_clean_stop(tmp_path, mode):
    code, out, err, left = run_and_stop(tmp_path / "run", mode, signal.SIGTERM, steps_started)
    summary = check_stopped(tmp_path / "run", code, out, err, signal.SIGTERM, left)
    steps = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert summary["num_steps"] == len(steps) >= 1
    assert summary["weight_version"] >= summary["num_steps"] and summary["num_syncs"] >= summary["num_steps"] - 1
    assert summary["num_groups_admitted"] >= 16 and 0 <= summary["frac_groups_any_correct"] <= 1
    assert f"after {len(steps)} of 250 steps; pools stopped" in err


def test_sigint_is_a_clean_stop_with_exit_130(tmp_path):
    """Also: start-up says what it is starting, the summary has start-up and shutdown seconds, and the
    job removes the session directory of the Ray cluster it started."""
    import tempfile

    cache = Path(tempfile.mkdtemp(prefix="hf", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        code, out, err, left = run_and_stop(tmp_path / "run", "one-step-off", signal.SIGINT, steps_started,
                                            HFLOW_CACHE_DIR=str(cache))
        summary = check_stopped(tmp_path / "run", code, out, err, signal.SIGINT, left)
        assert summary["num_steps"] >= 1
        assert 0 < summary["startup_s"] < summary["wall_s"] and 0 <= summary["shutdown_s"] < summary["wall_s"]
        for starting in ("starting a local Ray cluster", "starting the TransferQueue", "starting the prompt feeder",
                         "starting 1 roller (torch engine) and 1 trainer rank", "connecting weight sync"):
            assert f"hflow-async: {starting}" in out, out[:3000]
        assert [p.name for p in (cache / "ray").iterdir()] == []  # no session_* left behind
    finally:
        shutil.rmtree(cache, ignore_errors=True)


@pytest.mark.parametrize("gap_s", [0.5, pytest.param(2.0, marks=pytest.mark.long)])
def test_a_second_sigint_while_stopping_is_noted_not_a_traceback(tmp_path, gap_s):
    code, out, err, _ = run_and_stop(tmp_path / "run", "one-step-off", signal.SIGINT, steps_started,
                                     again_after_s=gap_s)
    assert code == 130, (code, err[-3000:])
    for noise in ("Traceback", "Task exception was never retrieved", "run failed"):
        assert noise not in out + err, (noise, err[-3000:])
    assert "hflow-async: stopped by SIGINT " in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert set(summary) == {*SUMMARY_KEYS, "config"} and summary["status"] == "interrupted"
    assert (tmp_path / "run" / "plot.png").exists()


def test_sigterm_while_pools_start_leaves_a_summary(tmp_path):
    code, out, err, left = run_and_stop(tmp_path / "run", "one-step-off", signal.SIGTERM, pools_starting)
    summary = check_stopped(tmp_path / "run", code, out, err, signal.SIGTERM, left)
    assert summary["num_steps"] == 0 and summary["reward_mean"] is None


@pytest.mark.parametrize("sig, to_group", [
    pytest.param(signal.SIGTERM, True, id="SIGTERM-group"),  # timeout, kill -TERM -- -PGID
    pytest.param(signal.SIGINT, True, id="SIGINT-group", marks=pytest.mark.long),  # a terminal's Ctrl-C
    pytest.param(signal.SIGHUP, True, id="SIGHUP-group", marks=pytest.mark.long),  # the terminal hangs up
    pytest.param(signal.SIGHUP, False, id="SIGHUP-pid", marks=pytest.mark.long),  # kill -HUP PID
])
def test_every_stop_signal_to_the_process_or_its_group_is_the_same_clean_stop(tmp_path, sig, to_group):
    """A signal to the whole process group reaches the job alone (its Ray cluster runs in a group of its own):
    was a 60 s wait on the GCS the group signal had killed, then exit 1 and ``shutdown_s: null``."""
    started = time.monotonic()
    code, out, err, left = run_and_stop(tmp_path / "run", "sync", sig, steps_started, to_group=to_group)
    summary = check_stopped(tmp_path / "run", code, out, err, sig, left)
    assert summary["num_steps"] >= 1 and summary["shutdown_s"] < 30, summary["shutdown_s"]
    assert f"after {summary['num_steps']} of 250 steps; pools stopped" in err
    assert time.monotonic() - started < START_TIMEOUT_S + 30 + LEFT_WITHIN_S


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, id="SIGTERM"),
                                 pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.long)])
def test_a_stop_signal_to_every_process_of_the_job_is_a_stop_within_seconds(tmp_path, sig):
    """systemd's default stop (KillMode=control-group) and Slurm's scancel signal every process of the job,
    Ray's daemons and workers included: the summary is written as for any stop, then the pools cannot be
    stopped through a Ray that no longer answers, so the job kills its cluster after
    ``SHUTDOWN_DEADLINE_S`` and leaves (was: a 60 s wait, Ray's 'Failed to connect to GCS', exit 1 and
    ``shutdown_s: null``)."""
    from controller.job import SHUTDOWN_DEADLINE_S

    code, out, err, left = run_and_stop(tmp_path / "run", "sync", sig, steps_started, to_all=True)
    summary = check_stopped(tmp_path / "run", code, out, err, sig, left)
    assert summary["num_steps"] >= 1 and summary["shutdown_s"] < SHUTDOWN_DEADLINE_S + 10, summary["shutdown_s"]
    assert f"after {summary['num_steps']} of 250 steps; " in err


def test_a_sigkill_of_the_job_leaves_nothing_of_it_running(tmp_path):
    """Ray's daemons die with the job's process (Ray's fate sharing), its agents and anything else of its
    cluster with the process group the job's reaper kills, its workers within a second of the raylet, the
    TransferQueue servers with their launcher: nothing is left ``LEFT_WITHIN_S`` after (the raylet's agents
    were left for minutes)."""
    job = CliJob(["--mode", "sync", "--preset", "tiny", f"run_dir={tmp_path / 'run'}"])
    try:
        wait_until_ready(job, steps_started)
        before = job.running()
        assert any("ray::" in p for p in before) and any("raylet" in p for p in before), before
        job.proc.kill()
        job.proc.wait(timeout=30)
        assert left_running(job) == []
    finally:
        job.close(kill_group=True)
