"""A controller killed with SIGKILL leaves no TransferQueue server behind (they die with their launcher)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

LAUNCHER = """
import sys, time
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue
servers = start_transferqueue(TransferQueueConfig(num_storage_units=2, capacity_bytes=1 << 20))
print(" ".join(str(p.pid) for p in servers.procs), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_servers_exit_when_their_launcher_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids)  # index + 2 units
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], "servers outlived their launcher"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_server_whose_launcher_stopped_before_sending_its_spec_exits_quietly():
    """A stop signal while the pools start can end the launcher between starting a server and writing its spec:
    the server then reads an empty stdin and exits 0 without a traceback."""
    server = subprocess.run([sys.executable, "-c", "from transferqueue.launch import _server_main; _server_main()"],
                            input=b"", capture_output=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert server.returncode == 0, server.stderr.decode()[-2000:]
    assert b"Traceback" not in server.stderr
