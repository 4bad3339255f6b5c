"""The processes of a local Ray cluster in a process group of their own, killed when the process that
started them ends, however it ends.

A job is stopped the way users and schedulers do it: ``kill PID``; Ctrl-C or a hangup of its terminal and
``timeout``, ``kill -TERM -- -PGID`` (signals to the whole process group); SIGKILL. ``ray.init`` starts its
daemons (GCS, raylet, dashboard, monitors; the raylet starts its agents) in the driver's process group, so a
signal to the group killed the cluster at the moment the driver began its clean stop, which then waited 60 s
for the dead GCS and exited 1. And a SIGKILL of the driver left the raylet's agents running for minutes
(orphaned, they wait on the dead GCS to report the raylet's death). So a local cluster is started as::

    driver (stays in the user's process group) ──pipe──> reaper (its own process group R; ignores stop signals)
      └── ray.init: gcs_server, raylet, dashboard, monitors (each joins R between fork and exec)
                      └── raylet: agents (in R, as its children); workers (groups of their own; each exits
                                  within ~1 s of the raylet: Ray's own check)

A stop signal to the user's group reaches the driver alone, which shuts Ray down as for ``kill PID``. When the
driver's process ends (an exit, or SIGKILL), the pipe's last writer is gone and the reaper SIGKILLs group R,
itself last. Linux only (``setpgid`` at fork; elsewhere Ray's processes stay in the driver's group).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from contextlib import contextmanager, suppress

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 10.0  # the reaper SIGKILLs its group at once; this bounds a wait on a machine that stalls
_adopting_pgid: int | None = None  # set while RayProcessGroup.adopting runs: forked children join it


def _join_adopting_group() -> None:
    """In a forked child (before its exec): join the group being filled, if any. Python runs this for
    ``subprocess.Popen`` with a ``preexec_fn``, as Ray starts its processes; a failure leaves the child where
    it was (the reaper is gone: nothing to join)."""
    if _adopting_pgid is not None:
        try:
            os.setpgid(0, _adopting_pgid)
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_join_adopting_group)


class RayProcessGroup:
    """A process group for the processes a local Ray cluster starts (``adopting``), and a reaper process,
    its leader, that SIGKILLs the group when this process closes it (``close``) or ends (SIGKILL included).

    ``pgid``: the group's id (the reaper's pid). Raises OSError when the reaper cannot be started.
    """

    def __init__(self):
        self._reaper = subprocess.Popen(
            [sys.executable, "-c", "from common.ray_group import reap_on_eof; reap_on_eof()"],
            stdin=subprocess.PIPE, process_group=0, env={**os.environ, "PYTHONPATH": _import_root()})
        self.pgid = self._reaper.pid

    @contextmanager
    def adopting(self):
        """Processes this process forks meanwhile with a ``preexec_fn`` (Ray's ``subprocess.Popen``s) start in
        this group instead of the caller's."""
        global _adopting_pgid
        _adopting_pgid = self.pgid
        try:
            yield self
        finally:
            _adopting_pgid = None

    def members(self) -> list[int]:
        """Pids of the group's processes other than the reaper (from ``/proc``; empty where there is none)."""
        return [pid for pid, pgid in _proc_stats() if pgid == self.pgid and pid != self.pgid]

    def close(self) -> None:
        """SIGKILL every process still in the group (the reaper does, on end of input), and wait for the reaper
        (at most ``_CLOSE_TIMEOUT_S`` seconds; then it is killed). Idempotent."""
        if self._reaper.poll() is None:
            self._reaper.stdin.close()
            try:
                self._reaper.wait(timeout=_CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the reaper of Ray's process group %d did not end: killing the group", self.pgid)
                with suppress(ProcessLookupError):
                    os.killpg(self.pgid, signal.SIGKILL)
                self._reaper.wait(timeout=_CLOSE_TIMEOUT_S)


def reap_on_eof() -> None:
    """The reaper's main: ignore stop signals (a scheduler that signals every process of the job must not end
    it before the driver), wait for end of input (the driver closed the pipe or ended), then SIGKILL this
    process group, this process included."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sys.stdin.buffer.read()
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _import_root() -> str:
    """``PYTHONPATH`` for the reaper: the directory holding this package, before what the caller had."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def _proc_stats():
    """(pid, pgid) of every process in ``/proc`` (processes that end while read are passed over)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z":  # a zombie has ended: only its parent's wait is missing
            yield int(name), int(fields[2])

