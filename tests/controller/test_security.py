"""A running job listens on loopback only, and its Ray cluster refuses a client without the job's token.

The job runs as a real ``hflow-async`` process (its own Ray cluster, pools, TransferQueue and trainer
rendezvous); its whole process tree is walked through ``/proc``, Ray's daemons, agents and actors included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.listening import is_loopback, listening_sockets

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(420)


_CLIENT = """
import sys
import ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
else:
    print("CONNECTED")
"""


def _ray_client(address: str, **token_env: str) -> tuple[str, str]:
    """(the client's verdict: CONNECTED or REFUSED ..., its log) for ``ray.init(address)`` with ``token_env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    env.update({"RAY_AUTH_MODE": "token", **token_env})
    out = subprocess.run([sys.executable, "-c", _CLIENT, address], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    return out.stdout.strip(), out.stderr


def test_job_listens_on_loopback_only_and_ray_requires_its_token(tmp_path):
    run_dir = tmp_path / "run"
    # Without the test session's own loopback pin: the job must pin Ray itself (it starts its own cluster).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    job = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "--mode", "fully-async", "--preset", "tiny",
         "trainer.num_ranks=2", "rollers.num_replicas=2", "metrics.progress=false", f"run_dir={run_dir}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and job.poll() is None:  # sample while the pools start and train
            seen.update(listening_sockets(job.pid))
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.5)
        assert job.poll() is None, "the job ended before it trained 3 steps"
        seen.update(listening_sockets(job.pid))
        names = set(seen.values())
        assert {"gcs_server", "raylet"} <= names, names  # Ray's daemons are in the tree we looked at
        assert any(n.startswith("ray::Trainer") for n in names) and any(n.startswith("ray::Roller") for n in names)
        assert json.loads((run_dir / "metrics_endpoint.json").read_text())["host"] == "127.0.0.1"
        exposed = {addr: name for addr, name in seen.items() if not is_loopback(addr)}
        assert not exposed, f"listening beyond loopback: {exposed}"

        gcs_ports = [addr.rsplit(":", 1)[1] for addr, name in seen.items() if name == "gcs_server"]
        assert len(gcs_ports) == 1, seen  # the GCS's one RPC port
        address = f"127.0.0.1:{gcs_ports[0]}"
        verdict, log = _ray_client(address, RAY_AUTH_TOKEN="0" * 32)
        assert verdict.startswith("REFUSED") and "InvalidAuthToken" in log, (verdict, log[-2000:])
        verdict, log = _ray_client(address)  # the job's own token (Ray's default token file) is let in
        assert verdict == "CONNECTED", (verdict, log[-2000:])
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()



def test_joining_an_unreachable_cluster_is_a_start_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "controller.cli", "--preset", "tiny", "ray.address=127.0.0.1:1",
                          "ray.connect_timeout_s=3", f"run_dir={tmp_path / 'run'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "cannot reach a Ray cluster at ray.address='127.0.0.1:1'" in out.stderr
    assert time.monotonic() - start < 100  # not Ray's endless retries
