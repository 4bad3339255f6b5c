"""``python -m controller.cli ARGS`` as a user runs it, for the tests that signal or kill a job's process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class CliJob:
    """The job in its own process session (so its process group can be killed with everything it started),
    ``stdout``/``stderr`` collected by two reader threads (``out()``, ``err()``). Every process the job starts
    inherits the variable ``HFLOW_TEST_JOB`` (``running()`` finds them by it, wherever they were moved)."""

    def __init__(self, args: list[str], **env_vars: str):
        self.job_id = uuid.uuid4().hex
        env = {**os.environ, "PYTHONPATH": str(REPO), "HFLOW_TEST_JOB": self.job_id, **env_vars}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "controller.cli", *args], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self._out: list[str] = []
        self._err: list[str] = []
        self._readers = [threading.Thread(target=lambda s=stream, b=buf: b.extend(iter(s.readline, "")), daemon=True)
                         for stream, buf in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))]
        for reader in self._readers:
            reader.start()

    def out(self) -> str:
        return "".join(self._out)

    def err(self) -> str:
        return "".join(self._err)

    def running(self) -> list[str]:
        """``PID NAME`` of every live process (zombies have ended) that carries this job's ``HFLOW_TEST_JOB``."""
        tag = f"HFLOW_TEST_JOB={self.job_id}".encode()
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if tag in (proc / "environ").read_bytes().split(b"\0"):
                    stat = (proc / "stat").read_text()
                    if stat.rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(f"{proc.name} {stat[stat.index('(') + 1:stat.rindex(')')]}")
            except (OSError, ValueError, IndexError):  # ended while we looked, or not ours to read
                continue
        return found

    def close(self, kill_group: bool) -> None:
        """Kill the job if it still runs, and (``kill_group``, or when it had to be killed) every process it
        started (its process group, and what carries its ``HFLOW_TEST_JOB``), as after a crash of the node;
        then wait for the readers."""
        if self.proc.poll() is None:
            kill_group = True
            self.proc.kill()
            self.proc.wait(timeout=30)
        if kill_group:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for pid in [int(p.split()[0]) for p in self.running()]:  # in process groups of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for reader in self._readers:
            reader.join(timeout=10)
