"""common.ray_group: processes forked while a group adopts (as Ray starts its daemons: ``Popen`` with a
``preexec_fn``) leave their parent's process group for the reaper's, and die with it when the parent closes
the group or is killed. Real processes; no Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.ray_group import RayProcessGroup

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_children_forked_while_adopting_join_the_group_and_close_kills_them():
    group = RayProcessGroup()
    try:
        with group.adopting():
            adopted = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: None)  # as Ray starts its daemons
        other = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: None)  # after: stays in ours
        assert os.getpgid(adopted.pid) == group.pgid != os.getpgrp()
        assert os.getpgid(other.pid) == os.getpgrp()
        assert group.members() == [adopted.pid]
        group.close()
        assert adopted.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None and _wait_gone(group.pgid)
    finally:
        for proc in (adopted, other):
            proc.kill()
            proc.wait()
        group.close()


def test_a_sigkill_of_the_owner_kills_the_group():
    """The owner (a process that started the group and a child in it) is SIGKILLed: its reaper sees the pipe
    close and kills the child, which no signal to the owner's group would reach."""
    code = ("import subprocess, sys; from common.ray_group import RayProcessGroup; g = RayProcessGroup()\n"
            "with g.adopting(): c = subprocess.Popen(['sleep', '60'], preexec_fn=lambda: None)\n"
            "print(g.pgid, c.pid, flush=True); sys.stdin.read()")
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pgid, child = map(int, owner.stdout.readline().split())
        assert os.getpgid(child) == pgid != owner.pid
        os.killpg(owner.pid, signal.SIGKILL)  # the owner's whole group: the owner alone
        assert owner.wait(timeout=10) == -signal.SIGKILL
        assert _wait_gone(child) and _wait_gone(pgid)
    finally:
        owner.kill()
        owner.wait()
