import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import env, net
from tests.listening import listening_on


def test_process_env_is_offline_and_loopback():
    env.setup_process_env()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert os.environ["HF_HOME"].startswith(str(env.cache_dir()))


@pytest.mark.parametrize("address, pinned", [("", True), (None, True), ("10.0.0.5:6379", False), ("auto", False)])
def test_ray_is_pinned_to_loopback_only_for_a_local_cluster(monkeypatch, address, pinned):
    """A job that starts its own cluster pins Ray to 127.0.0.1; a driver joining ray.address must not be
    pinned (it would register at 127.0.0.1, which the cluster's other nodes cannot reach)."""
    assert env.pins_ray_to_loopback(address) is pinned
    assert ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in env.process_env(address)) is pinned
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    env.setup_process_env(ray_address=address)
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == ("0" if pinned else None)
    assert os.environ["RAY_AUTH_MODE"] == "token"  # token auth either way


@pytest.mark.parametrize("address", ["", "10.0.0.5:6379"])
def test_run_job_sets_up_the_environment_for_its_ray_address(monkeypatch, address):
    """run_job hands ``ray.address`` to setup_process_env, first thing (before Ray is imported)."""
    from controller.config import load_config
    from controller.job import run_job

    seen = []

    class Stop(Exception):
        pass

    def fake_setup(num_threads=None, ray_address=None):
        seen.append(ray_address)
        raise Stop

    monkeypatch.setattr(env, "setup_process_env", fake_setup)
    cfg = load_config(mode="sync", preset="tiny", overrides=[f"ray.address={address}"] if address else [])
    with pytest.raises(Stop):
        run_job(cfg)
    assert seen == [address]


def test_thread_count_validation():
    with pytest.raises(ValueError, match="num_threads"):
        env.set_torch_threads(0)


def test_logical_cpus_exceed_physical():
    assert env.default_logical_cpus() >= 4 * (os.cpu_count() or 1)


def test_ray_cluster_on_loopback(ray_cluster):
    ray = ray_cluster
    nodes = ray.nodes()
    assert nodes and all(n["NodeManagerAddress"] == env.LOOPBACK for n in nodes)
    assert ray.cluster_resources()["CPU"] >= 32

    @ray.remote(num_cpus=1)
    def remote_env():
        return os.environ.get("HF_HUB_OFFLINE"), os.environ.get("RAY_AUTH_MODE")

    assert ray.get(remote_env.remote()) == ("1", "token")


def test_session_dir_of_a_cluster_started_elsewhere_is_not_ours(ray_cluster):
    """The test session's cluster was started by this process: its session directory is ours; one that a
    job would only join is not (Ray names a session after the pid that started it)."""
    ours = env.ray_session_dir()
    assert ours is not None and ours.parent == env.ray_temp_dir() and ours.name.endswith(f"_{os.getpid()}")


def test_remove_ray_session_dir_removes_only_session_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("HFLOW_CACHE_DIR", str(tmp_path))
    root = env.ray_temp_dir()
    session = root / "session_2026-01-01_00-00-00_000000_1"
    (session / "logs").mkdir(parents=True)
    (session / "logs" / "raylet.out").write_text("x")
    other = root / "session_2026-01-01_00-00-01_000000_2"
    other.mkdir()
    (root / "session_latest").symlink_to(session)
    env.remove_ray_session_dir(session)
    assert sorted(p.name for p in root.iterdir()) == [other.name]  # the link to it went too
    (root / "session_latest").symlink_to(other)
    with pytest.raises(ValueError, match="not a Ray session directory"):
        env.remove_ray_session_dir(tmp_path)
    env.remove_ray_session_dir(root / "session_gone")  # already gone: nothing to do
    assert (root / "session_latest").resolve() == other  # another cluster's link is left alone


def test_token_auth_cannot_be_switched_off(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    env.setup_process_env()
    assert os.environ["RAY_AUTH_MODE"] == "token"


def _run(code: str, *args: str, drop: tuple[str, ...] = ("RAY_",), add: dict | None = None
         ) -> subprocess.CompletedProcess:
    """``python -c code *args`` from the repository root, without the variables starting with ``drop``."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith(drop)} | (add or {})
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2], env=variables)


def test_ray_imported_before_the_environment_is_refused():
    # Ray reads its bind settings at import: imported first, a local cluster would listen on every interface.
    out = _run("import ray\nfrom common import env\nenv.init_ray()")
    assert out.returncode != 0 and "imported before common.env.setup_process_env" in out.stderr


def test_unreachable_cluster_is_a_clear_error_not_a_hang():
    start = time.monotonic()
    with pytest.raises(env.RayConnectError, match=r"ray.address='127.0.0.1:1'"):
        env.check_ray_address("127.0.0.1:1", timeout_s=5)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_tcp_store_listens_on_its_host_only(host):
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        store = net.tcp_store(host, 0, 2, True, timeout_s=10, wait_for_workers=False)
    except OSError as exc:  # a machine without IPv6 loopback
        pytest.skip(f"cannot bind {host}: {exc}")
    client = net.tcp_store(host, store.port, 2, False, timeout_s=10)
    client.set("k", "v")
    assert store.get("k") == b"v"
    mine = listening_on(store.port)
    assert mine == [f"{host}:{store.port}"], mine



_RETAINED = """
import os, sys
from common import env
if sys.argv[1] == "call":
    assert env.keep_freed_memory()
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
size = 24 * 2**20
before = rss()
buffer = b"x" * size  # malloc'd and written
held = rss()
del buffer
print((rss() - before) / size, (held - before) / size)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and /proc")
@pytest.mark.parametrize("how, kept", [("default", False), ("environment", True), ("call", True)])
def test_freed_buffers_stay_with_the_process(how, kept):
    """A freed 24 MiB buffer goes back to the OS by default (glibc mmaps it) and stays with a process set up
    by ``keep_freed_memory`` or started with the ``MALLOC_*_`` variables of ``process_env`` (``MALLOC_ENV``; a Ray
    worker)."""
    out = _run(_RETAINED, how, drop=("RAY_", "MALLOC_"), add=env.MALLOC_ENV if how == "environment" else None)
    assert out.returncode == 0, out.stderr
    retained, touched = map(float, out.stdout.split())
    assert touched > 0.9  # the buffer really was in memory
    assert (retained > 0.8) if kept else (retained < 0.2), retained
