"""How a job stops on SIGINT, SIGTERM and SIGHUP: the schedule unwinds through its ``finally`` blocks, the run
writes its summary, and the process exits ``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM, 129 for a hangup;
the shell's convention). ``controller/job.py`` installs the handlers for the length of a run (main thread only).
A signal to the job's whole process group (Ctrl-C, ``timeout``, ``kill -- -PGID``) reaches the job's process
alone: the Ray cluster it starts runs in a process group of its own (``common.ray_group``), so the clean stop
below is the same for a signal to the process and to its group. A signal to every process of the job (systemd's
and Slurm's default stops) stops Ray's processes too: the job's summary is written as ever, then stopping the
pools waits on a Ray that no longer answers, so after ``controller.job.SHUTDOWN_DEADLINE_S`` the job kills its
cluster and leaves with the same exit code (its stop line says so).

    signal ──> STOP.handle ── first, during the schedule ──> cancel the schedule's task (again each second
                         │                                    until it ends: an await may swallow one)
                         ├─ outside the schedule, or a second ──> KeyboardInterrupt where the main thread is
                         └─ while tearing down ──> noted and ignored (summary, pools and Ray still close)
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading

EXIT_SIGNAL_BASE = 128  # a stop by signal N exits 128 + N: 130 for SIGINT, 143 for SIGTERM (shell convention)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C; kill, timeout, systemd, Slurm; hangup


class JobStop:
    """How a stop signal (``STOP_SIGNALS``) stops a job (handlers installed by ``install_handlers``, main
    thread only).

    The first signal during the schedule cancels the schedule's task: every stage unwinds through its
    ``finally`` (no task is left holding a KeyboardInterrupt, so nothing prints a traceback). Outside the
    schedule (start-up, export), and for a second signal, it raises KeyboardInterrupt where the main thread
    is. Once the run tears down (``tear_down``: summary, pools, Ray; every wait there is bounded) further
    signals are noted and ignored, so a second Ctrl-C cannot leave a half-written summary or a traceback.
    ``signum``: the first stop signal of this run, or None.
    """

    def __init__(self):
        self.signum: int | None = None
        self._task: asyncio.Task | None = None
        self._tearing_down = False

    def reset(self) -> None:
        self.signum, self._task, self._tearing_down = None, None, False

    def tear_down(self) -> None:
        self._tearing_down = True

    def attach(self, task: asyncio.Task | None) -> None:
        """The schedule's task (None: detach). Only a job on the main thread receives signals."""
        if threading.current_thread() is threading.main_thread():
            self._task = task

    def _recancel(self, task: asyncio.Task) -> None:
        if not task.done():
            task.get_loop().call_later(1.0, self._cancel_again, task)

    def _cancel_again(self, task: asyncio.Task) -> None:
        if not task.done():
            task.cancel()
            self._recancel(task)

    def handle(self, signum, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if self._tearing_down:
            print(f"hflow-async: {signal.Signals(signum).name} while stopping: still shutting the pools down",
                  file=sys.stderr, flush=True)
            return
        task = self._task
        if first and task is not None and not task.done():
            task.cancel()
            # Cancel again each second until the task ends: an await may swallow one cancellation (Python
            # 3.11's wait_for when its inner future completes at the same moment; libraries' awaitables).
            task.get_loop().call_soon_threadsafe(self._recancel, task)  # also wakes the loop
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)


STOP = JobStop()


def install_handlers() -> dict:
    """Install ``STOP``'s handler for every signal of ``STOP_SIGNALS`` (Ctrl-C, SIGTERM and a hangup stop the
    job alike). Main thread only; returns the previous handlers to restore (empty elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, STOP.handle) for sig in STOP_SIGNALS}


def interrupted(summary: dict) -> int:
    """Note a stop by signal in ``summary``; its exit code, 128 + the signal (SIGINT without a handler)."""
    signum = STOP.signum or signal.SIGINT
    summary.update(status="interrupted", error=f"stopped by {signal.Signals(signum).name}")
    return EXIT_SIGNAL_BASE + signum


async def close_all(*closers) -> None:
    """Await every closer in turn, even when one is cancelled; then re-raise the cancellation."""
    cancelled = None
    for closer in closers:
        try:
            await closer
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        raise cancelled
