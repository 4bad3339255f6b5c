"""``python -m controller.cli ARGS`` as a user runs it, for the tests that signal or kill a job's process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class CliJob:
    """The job in its own process session (so its process group can be killed with everything it started),
    ``stdout``/``stderr`` collected by two reader threads (``out()``, ``err()``)."""

    def __init__(self, args: list[str], **env_vars: str):
        env = {**os.environ, "PYTHONPATH": str(REPO), **env_vars}
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

    def close(self, kill_group: bool) -> None:
        """Kill the job if it still runs, and (``kill_group``, or when it had to be killed) every process it
        started, as after a crash of the node; then wait for the readers."""
        if self.proc.poll() is None:
            kill_group = True
            self.proc.kill()
            self.proc.wait(timeout=30)
        if kill_group:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for reader in self._readers:
            reader.join(timeout=10)
