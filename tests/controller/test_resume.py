"""Checkpoint and resume a whole job (controller/job_checkpoint.py), with real ``hflow-async`` processes.

One chain on the tiny model, fully-async with generation ahead of training (8 prompts, batch 2, 2 epochs =
8 steps, max_staleness 1, long forced responses), each edge case of issue 15 made certain:

1. SIGKILL while the checkpoint of step 2 is being written (a test hook pauses that save before its
   rename): step 1's checkpoint stays whole, step 2's is only a ``.tmp_`` directory. The roller generates
   2 groups at once and holds its 4th group (``s1.p1``) 10 s before generating it (fault injection ``slow``):
   step 1's checkpoint has that group in flight (a long response in flight at the checkpoint).
2. ``--resume`` (from step 1: the groups in flight re-issued) to the checkpoint of step 4, where epoch 1's
   data ends exactly on a batch boundary; a test hook holds that save 10 s before its snapshot, so epoch 2's
   first batch is generated and untrained in it (a checkpoint after a generation, before its training);
   SIGTERM during that save: the job stops once it is written, exit 143.
3. ``--resume`` again, into epoch 2 and to the end: every prompt trained exactly once per epoch (uid
   accounting over ``metrics.jsonl``), the in-flight group under its re-issued uid, the buffered batch first
   with the weight version it was generated with, ``weight_version`` = step on every row, staleness within
   the bound.

The same stop (SIGTERM mid-run) and resume in ``sync`` (staleness 0) and ``one-step-off`` (staleness <= 1).
A trainer rank killed (SIGKILL) with ``trainer.max_restarts=1``: the trainer group alone restarts from the
latest checkpoint (the roller processes are the same before and after), every prompt trained once; with 0
the job fails naming the rank.

A run with generation dumps (``metrics.dump_every=1``) stopped while its checkpoint holds buffered groups, then
a plain ``--resume RUN_DIR``: the buffered groups come back with the ``response_text`` the dump reads (issue 44,
item 3; the matrix of settings is ``test_job_checkpoint.py``'s, without pools).

The start-up decisions of ``--resume`` (a refused config change, buffered samples saved without a field the new
settings read, nothing left to train) need no pools.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.config import load_config, to_dict, to_yaml
from controller.job_checkpoint import CHECKPOINTS, HOLD_ENV, JOB_FILE, PAUSE_ENV, JobState, list_checkpoints
from tests.controller._cli_job import CliJob

RUN_TIMEOUT_S = 420  # Ray, the TransferQueue servers and the pools start on a loaded 2-core machine
STEP_LINE = re.compile(r"^step +(\d+)/", re.MULTILINE)
MAX_STALENESS = 1
JOB = ["--mode", "fully-async", "--preset", "tiny", "data.size=8", "data.train_batch_size=2", "data.epochs=2",
       "trainer.total_steps=8", "rollout.n=2", "trainer.ppo_mini_batch_size=2", f"algorithm.max_staleness={MAX_STALENESS}",
       "rollout.max_response_length=24", "rollout.forced_response_lengths=[[1,16,24]]", "trainer.save_every=1"]


def run(args: list[str], until: Callable[[str], bool] | None = None, sig: int = signal.SIGKILL,
        watch: Callable[[int, str], None] | None = None, **env_vars: str) -> tuple[int, str, str]:
    """Run ``python -m controller.cli *args``; once ``until(stdout)`` holds, send ``sig`` to the job's process
    (then kill what it started); ``watch(pid, stdout)`` is called while it runs. Returns (exit code, stdout,
    stderr)."""
    job = CliJob(args, **env_vars)
    proc = job.proc
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while watch is not None and proc.poll() is None and time.monotonic() < deadline:
            watch(proc.pid, job.out())
            time.sleep(0.2)
        while until is not None and not until(job.out()):
            assert proc.poll() is None, f"ended first (rc {proc.returncode}):\n{job.out()[-2000:]}\n{job.err()[-3000:]}"
            assert time.monotonic() < deadline, f"not there within {RUN_TIMEOUT_S}s:\n{job.err()[-3000:]}"
            time.sleep(0.2)
        if until is not None:
            proc.send_signal(sig)
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:  # what the job started (Ray, the TransferQueue servers) goes too, as after a crash of the node
        job.close(kill_group=True)
    return code, job.out(), job.err()


def base_uid(uid: str) -> str:
    return uid.split(".r")[0]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_kill_mid_save_then_sigterm_then_resume_trains_every_prompt_once(tmp_path):
    run_dir = tmp_path / "run"
    # 1. SIGKILL in the middle of the save of step 2. Two groups generated at once (4 slots, n=2): the 4th
    # group (s1.p1) is taken once groups 1 and 2 are done, when step 1 can train, and held 10 s ungenerated.
    held = ["rollers.max_batch_slots=4", "rollers.fault_injection=[roller0:slow:group=4:10]"]
    code, out, err = run([*JOB, *held, f"run_dir={run_dir}"],
                         until=lambda o: "checkpoint of step 2 written, pausing" in o, **{PAUSE_ENV: "2:300"})
    assert code == -signal.SIGKILL, err[-3000:]
    assert sorted(list_checkpoints(run_dir)) == [1]
    assert (run_dir / CHECKPOINTS / ".tmp_step_2" / JOB_FILE).is_file()  # the unfinished save, not taken
    first = JobState.read(run_dir / CHECKPOINTS / "step_1")
    assert first.weight_version == 1
    # Edge case: a long response in flight at the checkpoint. Generation runs ahead: step 2's groups are
    # buffered or still in flight, the held one certainly in flight.
    assert "s1.p1" in first.in_flight_uids, first
    assert sorted(first.buffered_uids + first.in_flight_uids) == ["s1.p0", "s1.p1"], first

    # 2. Resume from step 1 (no fault, the default slots); SIGTERM during the save of step 4, held 10 s before
    # its snapshot: the stop takes effect once that save is written (no second one).
    code, out, err = run(["--resume", str(run_dir), "rollers.fault_injection=[]", "rollers.max_batch_slots=128"],
                         until=lambda o: "checkpoint of step 4 holding" in o, sig=signal.SIGTERM,
                         **{HOLD_ENV: "4:10"})
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "(step 1, weight_version 1)" in out
    assert max(list_checkpoints(run_dir)) == 4, out[-2000:]
    stop = JobState.read(run_dir / CHECKPOINTS / "step_4")
    assert stop.weight_version == 4 and stop.reason == "every trainer.save_every steps", stop
    assert not list((run_dir / CHECKPOINTS).glob(".tmp_*")), "a save removes a leftover temporary directory"
    # Edge cases: epoch 1's 8 prompts end exactly at step 4's batch boundary; the checkpoint falls after a
    # generation (epoch 2's first batch, admitted once the rollers held version 3) and before its training.
    assert stop.feeder["num_fed"] == 10 and not stop.feeder["exhausted"], stop.feeder
    assert stop.buffered_uids == ["s4.p0", "s4.p1"] and stop.in_flight_uids == [], stop

    # 3. Resume to the end (epoch 2).
    code, out, err = run(["--resume", str(run_dir)])
    assert code == 0, err[-3000:]
    rows = assert_every_prompt_once(run_dir, 8, MAX_STALENESS)  # 8 prompts x 2 epochs
    trained_as = {u for r in rows for u in r["uids"] if base_uid(u) in first.in_flight_uids}
    assert trained_as and all(u != base_uid(u) for u in trained_as), trained_as  # re-issued, under fresh uids
    # The buffered batch is step 5's, with the weight version it was generated with (3; trained by 4).
    assert {base_uid(u) for u in rows[4]["uids"]} == {"s4.p0", "s4.p1"}, rows[4]["uids"]
    assert rows[4]["staleness_mean"] == rows[4]["staleness_max"] == 1, rows[4]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["num_steps"] == 8, (summary, err[-3000:])


def fake_run(run_dir: Path, step: int, overrides: list[str], **state) -> None:
    """A run directory with a config and one job checkpoint of ``step`` (no trainer files: the tests below
    end before any pool starts)."""
    cfg = load_config(preset="tiny", overrides=[*overrides, f"run_dir={run_dir}"])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    path = run_dir / CHECKPOINTS / f"step_{step}"
    path.mkdir(parents=True)
    fields = dict(step=step, weight_version=step, synced_weight_version=step, admission_started=step,
                  admission_dropped=0, feeder={"num_fed": step, "reissues": {}, "exhausted": False},
                  buffered_uids=[], in_flight_uids=[], num_syncs=step, num_dropped_groups=0, num_failed_groups=0,
                  num_zero_variance_groups=0, refill_depth={}, reason="test", saved_at=0.0, num_sample_bytes=0,
                  config=to_dict(cfg)) | state
    (path / JOB_FILE).write_text(json.dumps(fields))


def cli(capsys, *args: str) -> subprocess.CompletedProcess:
    """``hflow-async *args`` in this process (these runs end before Ray or any pool starts)."""
    from controller.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def test_resume_refuses_a_changed_rollout_n_and_allows_steps(tmp_path, capsys):
    run_dir = tmp_path / "run"
    fake_run(run_dir, 2, ["data.size=8", "data.train_batch_size=2", "trainer.ppo_mini_batch_size=2", "trainer.total_steps=4"])
    done = cli(capsys, "--resume", str(run_dir), "rollout.n=4", "trainer.total_steps=2")
    assert done.returncode == 2
    assert "rollout.n: 8 -> 4" in done.stderr and "total_steps" not in done.stderr.split("cannot resume")[1]
    # A harmless change alone passes the check (and here finds nothing left to train).
    done = cli(capsys, "--resume", str(run_dir), "trainer.total_steps=2", "metrics.progress=false")
    assert done.returncode == 0 and "nothing left to train" in done.stdout, done.stderr
    assert re.search(r"resuming with changed .*trainer.total_steps", done.stdout)


def test_resume_with_the_data_exhausted_and_nothing_buffered_exits_0(tmp_path, capsys):
    run_dir = tmp_path / "run"
    fake_run(run_dir, 4, ["data.size=8", "data.train_batch_size=2", "trainer.ppo_mini_batch_size=2", "trainer.total_steps=4"],
             feeder={"num_fed": 8, "reissues": {}, "exhausted": True})
    done = cli(capsys, "--resume", str(run_dir), "trainer.total_steps=6")
    assert done.returncode == 0 and "data exhausted at step 4" in done.stdout, done.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # nothing started


def run_with_buffered_samples(run_dir: Path, overrides: list[str], fields: list[str]) -> None:
    """``fake_run`` at step 1 with one group buffered, its samples saved with ``fields``."""
    from controller.job_checkpoint import SAMPLES_DIR
    from trainers.sample_store import INDEX_FILE

    fake_run(run_dir, 1, overrides, buffered_uids=["s1.p0"])
    samples = run_dir / CHECKPOINTS / "step_1" / SAMPLES_DIR
    samples.mkdir()
    (samples / INDEX_FILE).write_text(json.dumps({"num_samples": 8, "fields": fields, "tags": [], "objects": {}}))


def test_resume_refuses_buffered_samples_saved_without_a_field_its_settings_read(tmp_path):
    """A resume whose settings make a reader need a field the buffered samples were saved without is refused
    at once, naming the field and what to do: ``metrics.dump_every`` turned on (0 -> 1: the dump reads
    ``response_text``), or a checkpoint of a dumping run written before the checkpoint kept that field. With
    settings its samples serve, it goes ahead."""
    from controller.job_checkpoint import prepare_resume
    from controller.layout import sample_fields

    base = ["data.size=8", "data.train_batch_size=2", "trainer.ppo_mini_batch_size=2", "trainer.total_steps=4"]

    def config(run_dir: Path, *extra: str):
        return load_config(preset="tiny", overrides=[*base, f"run_dir={run_dir}", *extra])

    turned_on = tmp_path / "turned_on"
    run_with_buffered_samples(turned_on, base, list(sample_fields(config(turned_on))))
    with pytest.raises(ValueError, match=r"saved without \['response_text'\].*metrics.dump_every changed since"):
        prepare_resume(config(turned_on, "metrics.dump_every=1"), None, turned_on / "model")
    assert prepare_resume(config(turned_on), None, turned_on / "model") is not None

    before_the_fix = tmp_path / "before_the_fix"
    run_with_buffered_samples(before_the_fix, [*base, "metrics.dump_every=1"],
                              list(sample_fields(config(before_the_fix))))  # the trainer's fields only
    with pytest.raises(ValueError, match=r"saved without \['response_text'\].*predates.*metrics.dump_every=0"):
        prepare_resume(config(before_the_fix, "metrics.dump_every=1"), None, before_the_fix / "model")
    assert prepare_resume(config(before_the_fix, "metrics.dump_every=0"), None, before_the_fix / "model") is not None


def test_a_refused_resume_of_buffered_samples_names_only_the_keys_that_add_the_field(tmp_path):
    """The advice names what would work: a run that dumped throughout, checkpointed before its samples kept
    ``response_text``, resumed with another key changed (trainer.total_steps) is told the checkpoint predates
    the field (resume with metrics.dump_every=0: its own values fail too), not that total_steps changed; a run
    that did not dump is told to keep its own metrics.dump_every, whatever else changed."""
    from controller.job_checkpoint import prepare_resume
    from controller.layout import sample_fields

    base = ["data.size=8", "data.train_batch_size=2", "trainer.ppo_mini_batch_size=2", "trainer.total_steps=4"]

    def config(run_dir: Path, *extra: str):
        return load_config(preset="tiny", overrides=[*base, f"run_dir={run_dir}", *extra])

    before_the_fix = tmp_path / "before_the_fix"
    run_with_buffered_samples(before_the_fix, [*base, "metrics.dump_every=1"],
                              list(sample_fields(config(before_the_fix))))  # the trainer's fields only
    with pytest.raises(ValueError, match=r"saved without \['response_text'\]") as refused:
        prepare_resume(config(before_the_fix, "metrics.dump_every=1", "trainer.total_steps=6"), None,
                       before_the_fix / "model")
    assert "predates" in str(refused.value) and "metrics.dump_every=0" in str(refused.value)
    assert "total_steps" not in str(refused.value), refused.value

    turned_on = tmp_path / "turned_on"
    run_with_buffered_samples(turned_on, base, list(sample_fields(config(turned_on))))
    with pytest.raises(ValueError, match=r"saved without \['response_text'\]") as refused:
        prepare_resume(config(turned_on, "metrics.dump_every=1", "trainer.total_steps=6"), None, turned_on / "model")
    assert "metrics.dump_every changed since the save" in str(refused.value)
    assert "run's own metrics.dump_every=0" in str(refused.value) and "total_steps" not in str(refused.value)


def test_resume_needs_a_job_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    fake_run(run_dir, 1, [])
    (run_dir / CHECKPOINTS / "step_1" / JOB_FILE).unlink()
    done = cli(capsys, "--resume", str(run_dir))
    assert done.returncode == 2 and "no job checkpoint" in done.stderr
    done = cli(capsys, "--resume", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "no run there" in done.stderr


TRAINER, ROLLER = b"ray::TrainerActor", b"ray::RollerActor"


def actor_pids(job_pid: int, title: bytes) -> list[int]:
    """PIDs of the actors of class ``title`` (``TRAINER``, ``ROLLER``) the job ``job_pid`` started (Ray's worker
    processes descend from the raylet the job started, and take their actor's class as their title); other
    jobs' are left alone."""
    parent, titles = {}, {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            titles[int(proc.name)] = (proc / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):  # a process that ended while we looked
            continue

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == job_pid:
                return True
            pid = parent.get(pid, 0)
        return False

    return sorted(pid for pid, name in titles.items() if title in name and descends(pid))


def kill_trainer_after_checkpoint(run_dir: Path, seen: dict[str, list[int]]) -> Callable[[int, str], None]:
    """A ``watch`` for ``run``: once ``run_dir`` has a job checkpoint, SIGKILL the trainer rank's process (once;
    it may be training the next step, writing the next checkpoint or pushing weights). Notes in ``seen`` the
    roller and trainer processes before the kill and once the trainer group is back."""

    def watch(pid: int, out: str) -> None:
        if "killed" not in seen and list_checkpoints(run_dir):
            seen["rollers"], seen["killed"] = actor_pids(pid, ROLLER), actor_pids(pid, TRAINER)
            assert len(seen["killed"]) == 1, seen
            os.kill(seen["killed"][0], signal.SIGKILL)
        elif "killed" in seen and "trainer group restarted" in out:
            note_after_restart(pid, seen)

    return watch


def note_after_restart(pid: int, seen: dict[str, list[int]]) -> None:
    """Note the roller and trainer processes of job ``pid`` after the trainer's restart (each look replaces the
    last, so the notes are those of the run's last look, while its pools still ran)."""
    rollers, trainers = actor_pids(pid, ROLLER), actor_pids(pid, TRAINER)
    if rollers and trainers:
        seen["rollers_after"], seen["trainers_after"] = rollers, trainers


def assert_every_prompt_once(run_dir: Path, num_steps: int, bound: int) -> list[dict]:
    """``metrics.jsonl`` has steps 1..``num_steps`` at ``weight_version`` = step, each prompt of the 8 x
    ``num_steps / 4`` epochs trained once (batch 2), staleness within ``bound``; returns its rows."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if not r.get("validation")]
    assert [r["step"] for r in rows] == list(range(1, num_steps + 1))
    assert all(r["weight_version"] == r["step"] for r in rows)  # the version continues across stops
    assert max(r["staleness_max"] for r in rows) <= bound, [r["staleness_max"] for r in rows]
    trained = sorted(base_uid(u) for r in rows for u in r["uids"])
    assert trained == sorted(f"s{step}.p{pos}" for step in range(num_steps) for pos in range(2)), \
        "a prompt was skipped or trained twice"
    return rows


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("max_restarts", [0, 1])
def test_a_lost_trainer_rank_restarts_the_trainer_alone_or_fails_naming_it(tmp_path, max_restarts):
    run_dir = tmp_path / "run"
    args = [*JOB, "data.epochs=1", "trainer.total_steps=4", f"trainer.max_restarts={max_restarts}",
            f"run_dir={run_dir}"]
    seen: dict[str, list[int]] = {}
    code, out, err = run(args, watch=kill_trainer_after_checkpoint(run_dir, seen))
    assert "trainer rank 0 was lost in " in err
    if max_restarts == 0:
        assert code == 1 and "run failed: TrainerRankLost" in err
        return
    assert code == 0, err[-3000:]
    assert "restarting the trainer group from" in err and "restarting the pools" not in err
    assert "rollers: 1 kept, 0 replaced" in out  # save_every=1: no roller holds weights newer than the checkpoint
    # The rollers kept running: the same processes before the kill and after the trainer came back.
    assert seen["rollers"] and seen["rollers_after"] == seen["rollers"], seen
    assert len(seen["trainers_after"]) == 1 and seen["trainers_after"] != seen["killed"], seen
    assert_every_prompt_once(run_dir, 4, MAX_STALENESS)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_trainer_restarts"] == 1 and summary["num_roller_restarts"] == 0, summary


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
@pytest.mark.parametrize(("mode", "bound"), [("sync", 0), ("one-step-off", 1)])
def test_sigterm_then_resume_trains_every_prompt_once_in_sync_and_one_step_off(tmp_path, mode, bound):
    run_dir = tmp_path / "run"
    args = [mode if a == "fully-async" else a for a in JOB]
    # No periodic save: the checkpoint is the one the stop writes, mid-run (a batch generated or in flight).
    # The roller holds step 2's second group (its 4th) 10 s, so the tiny job cannot finish all 4 steps between
    # step 1's line and the signal (it did on a fast machine: the stop came after step 4).
    args += ["data.epochs=1", "trainer.total_steps=4", "trainer.save_every=100", f"run_dir={run_dir}",
             "rollers.fault_injection=[roller0:slow:group=4:10]"]
    code, out, err = run(args, until=lambda o: STEP_LINE.search(o) is not None, sig=signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    stopped_at = max(list_checkpoints(run_dir))
    stop = JobState.read(run_dir / CHECKPOINTS / f"step_{stopped_at}")
    assert stopped_at == 1 and stop.reason == "stopped by SIGTERM" and stop.weight_version == 1, stop

    code, out, err = run(["--resume", str(run_dir), "rollers.fault_injection=[]"])
    assert code == 0, err[-3000:]
    assert f"(step {stopped_at}, weight_version {stopped_at})" in out
    assert_every_prompt_once(run_dir, 4, bound)


def kill_trainer_once_rollers_are_ahead(run_dir: Path, step: int, seen: dict[str, list[int]]
                                        ) -> Callable[[int, str], None]:
    """A ``watch`` for ``run``: once ``run_dir`` has the job checkpoint of ``step`` and a roller holds a newer
    weight version (the admin endpoint's pool state), SIGKILL the trainer rank, before the next checkpoint.
    Notes the roller processes before the kill and once the trainer group is back, as
    ``kill_trainer_after_checkpoint``."""
    from controller.admin import AdminError, pool_state

    def watch(pid: int, out: str) -> None:
        if "killed" in seen:
            if "trainer group restarted" in out:
                note_after_restart(pid, seen)
            return
        if step not in list_checkpoints(run_dir):
            return
        try:
            versions = [r["weight_version"] for r in pool_state(run_dir)["rollers"]]
        except AdminError:
            return
        if versions and max(versions) > step:
            assert max(list_checkpoints(run_dir)) == step, "the next checkpoint came first: widen save_every"
            seen["rollers"], seen["killed"] = actor_pids(pid, ROLLER), actor_pids(pid, TRAINER)
            os.kill(seen["killed"][0], signal.SIGKILL)

    return watch


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_a_trainer_restart_replaces_rollers_that_hold_weights_newer_than_the_checkpoint(tmp_path):
    """``trainer.save_every=3``: the kill lands once the rollers hold version 4 or 5, the checkpoint is step 3.
    Those weights are in no history the restored trainer will have, so the rollers holding them are replaced
    and what they generated is re-issued; steps 4.. are trained again, every prompt once. The first roller
    takes 3 s over each weight update from its 4th on, so the kill lands before the run's last checkpoint."""
    run_dir = tmp_path / "run"
    args = [*JOB, "trainer.total_steps=6", "trainer.save_every=3", "trainer.max_restarts=1", f"run_dir={run_dir}",
            "rollers.fault_injection=[roller0:slow:weight_sync=4:3]"]
    seen: dict[str, list[int]] = {}
    code, out, err = run(args, watch=kill_trainer_once_rollers_are_ahead(run_dir, 3, seen))
    assert code == 0, err[-3000:]
    assert "restarting the trainer group from" in err and "trainer group restarted from step 3 " in out, out[-2000:]
    assert "rollers: 0 kept, 1 replaced" in out, out[-2000:]
    assert len(seen["rollers"]) == 1 and seen["rollers"][0] not in seen["rollers_after"], seen
    assert "holds weight_version" in err and "newer than the restored 3" in err
    superseded = [json.loads(line) for line in (run_dir / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded and min(r["step"] for r in superseded) == 4
    assert_every_prompt_once(run_dir, 6, MAX_STALENESS)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_a_plain_resume_of_a_run_with_generation_dumps_dumps_its_buffered_groups(tmp_path):
    """Issue 44, item 3, as a user met it: a run with ``metrics.dump_every=1`` stopped (SIGTERM) while a
    checkpoint holds groups generated ahead of training, then ``--resume RUN_DIR`` (the run's own config):
    exit 0, every step dumped, the buffered groups' responses included. Before the fix: exit 1,
    ``get: field 'response_text' missing``."""
    run_dir = tmp_path / "run"
    code, out, err = run([*JOB, "data.epochs=1", "trainer.total_steps=4", "metrics.dump_every=1",
                          f"run_dir={run_dir}"],
                         until=lambda o: "checkpoint of step 2 holding" in o, sig=signal.SIGTERM, **{HOLD_ENV: "2:10"})
    assert code == 128 + signal.SIGTERM, err[-3000:]
    stop = JobState.read(run_dir / CHECKPOINTS / "step_2")
    assert stop.buffered_uids, stop  # generated ahead of training while the save was held

    code, out, err = run(["--resume", str(run_dir)])
    assert code == 0, err[-3000:]
    rows = assert_every_prompt_once(run_dir, 4, MAX_STALENESS)
    dumped = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    trained = [row for row in dumped if row["kind"] == "train"]
    assert sorted({row["step"] for row in trained}) == [1, 2, 3, 4]
    assert {base_uid(row["uid"]) for row in trained} >= set(stop.buffered_uids), stop
    assert all(isinstance(row["response"], str) for row in trained)
    assert len(rows) == 4
