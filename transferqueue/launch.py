"""Starting a TransferQueue: one index process plus N storage-unit processes, as plain subprocesses; it
gives back a ``TQHandle`` (addresses, routing, keys) for every worker's ``TQClient``.

::

    controller: servers = start_transferqueue(cfg)
                handle = servers.handle  -> passed to every Ray actor -> TQClient(handle)
                servers.check()                             # ServerLost if a server process exited
                servers.shutdown()                          # stops the loops, unlinks shared memory

The servers bind ``transferqueue.host`` (``node``: the launcher's Ray node address, resolved here, since
the servers are subprocesses of the launcher on its node and not Ray processes); clients connect to the
endpoints the servers publish, which the handle carries.

Subprocesses get their settings (including CURVE secrets) as JSON on stdin, never on the command line,
and publish their bound endpoint in a file the launcher waits for (``start_timeout_s``).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from common.curve import CurveKeys, make_job_keys
from common.net import resolve_bind_host
from common.node import adopt_node_id, node_id
from transferqueue.config import TransferQueueConfig
from transferqueue.records import ServerLost, TQError, TQHandle
from transferqueue.shm_layout import BLOCK_NAME, SHM_DIR

logger = logging.getLogger(__name__)


def build_server(spec: dict):
    """The server object described by ``spec`` (``role`` index|unit, ``address``, ``curve``, ...)."""
    curve = CurveKeys(**spec["curve"]) if spec.get("curve") else None
    limits = TransferQueueConfig(**spec.get("limits", {}))  # validated again in the server's process
    if spec["role"] == "index":
        from transferqueue.index_server import IndexServer

        return IndexServer(spec["address"], curve, tuple(spec.get("sampler_modules", ())),
                           local_address=spec.get("local_address", ""), limits=limits)
    if spec["role"] == "unit":
        from transferqueue.storage import StorageUnit

        return StorageUnit(spec["address"], spec["capacity_bytes"], curve, lease_s=spec.get("lease_s", 60.0),
                           p2p=spec.get("p2p"), local_address=spec.get("local_address", ""),
                           max_request_ids=limits.max_request_ids, max_name_chars=limits.max_name_chars)
    raise ValueError(f"unknown server role {spec['role']!r}")


def local_address(directory: str, i: int) -> str:
    """The ``ipc://`` endpoint of server ``i`` inside ``directory`` (a private temp dir), or ``""`` when the
    path would exceed the Unix socket path limit (that server is then reached over TCP only)."""
    path = os.path.join(directory, f"server{i}.sock")
    return f"ipc://{path}" if len(path) < 100 else ""


def _info(server) -> dict[str, Any]:
    return {"endpoint": server.endpoint, "local_endpoint": server.local_endpoint, "node": node_id(),
            "pid": os.getpid()}


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this server when the process that launched it dies (even by SIGKILL), so a
    killed controller leaves no orphan servers; exit at once if that already happened. (Linux ties this
    to the launching *thread*: call ``start_transferqueue`` from a thread that outlives the servers.)"""
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's shutdown() is the only stop
        logger.warning("cannot tie the server's life to its launcher (no prctl); stop it with shutdown()")
    if os.getppid() != parent:
        sys.exit(0)


def _server_main() -> None:
    """Entry of a server subprocess: read the spec from stdin, bind, publish the endpoint, serve."""
    _die_with_parent()
    raw = sys.stdin.read()
    if not raw:  # the launcher stopped (e.g. a stop signal while pools start) before it sent the spec
        sys.exit(0)
    spec = json.loads(raw)
    from transferqueue.server import write_endpoint_file

    adopt_node_id(spec["node"])  # the launcher's node (its Ray node id in a Ray cluster)

    server = build_server(spec)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    write_endpoint_file(spec["endpoint_file"], _info(server))
    try:
        server.serve_forever()
    finally:  # also when the launcher died (PDEATHSIG) and nobody else cleans the run directory
        try:
            os.unlink(spec["endpoint_file"])
            os.rmdir(os.path.dirname(spec["endpoint_file"]))  # succeeds for the last server out
        except OSError:
            pass


def _specs(cfg: TransferQueueConfig, curve: CurveKeys | None, host: str) -> list[dict]:
    base = {"address": f"tcp://{host}:0", "curve": asdict(curve) if curve else None,
            "lease_s": cfg.request_timeout_s, "limits": cfg.limits()}
    specs = [dict(base, role="index", sampler_modules=list(cfg.sampler_modules))]
    for i in range(cfg.num_storage_units):
        p2p = None
        if cfg.p2p_backend:
            p2p = {"backend": cfg.p2p_backend, "device": "cpu" if cfg.p2p_device == "cpu" else f"cuda:{i}",
                   "max_links": cfg.max_p2p_links}
        specs.append(dict(base, role="unit", capacity_bytes=cfg.capacity_bytes, p2p=p2p))
    return specs


def _handle(cfg: TransferQueueConfig, infos: list[dict], curve: CurveKeys | None) -> TQHandle:
    return TQHandle(index_address=infos[0]["endpoint"], unit_addresses=[i["endpoint"] for i in infos[1:]],
                    unit_nodes=[i["node"] for i in infos[1:]], index_node=infos[0]["node"],
                    index_local_address=infos[0]["local_endpoint"],
                    unit_local_addresses=[i["local_endpoint"] for i in infos[1:]], route_block=cfg.route_block,
                    shared_memory=cfg.shared_memory, shm_min_bytes=cfg.shm_min_bytes,
                    request_timeout_s=cfg.request_timeout_s, curve=curve.for_clients() if curve else None,
                    p2p_backend=cfg.p2p_backend)


def _keys(cfg: TransferQueueConfig) -> CurveKeys | None:
    if not cfg.curve:
        return None
    return make_job_keys()


def _unlink_blocks(pid: int) -> None:
    """Remove the shared-memory blocks storage unit ``pid`` left behind (``shm_layout``: its blocks are named
    after its pid); a unit that exits normally removes its own."""
    for path in glob.glob(os.path.join(SHM_DIR, f"hflow-tq-{pid}-*")):
        if BLOCK_NAME.fullmatch(os.path.basename(path)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def how_it_ended(code: int) -> str:
    """``killed by SIGKILL`` or ``exited with code 1``, from a ``Popen.returncode``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class TQServers:
    """Running servers (subprocesses) and their handle. ``shutdown()`` is idempotent."""

    def __init__(self, handle: TQHandle, procs: list[subprocess.Popen], run_dir: str):
        self.handle, self.procs, self.run_dir = handle, procs, run_dir

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def check(self) -> None:
        """Raise ServerLost naming the first server process that has exited (the index or storage unit K,
        its pid and endpoint, and how it ended); return when all run. Cheap: one ``waitpid`` per server."""
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is None:
                continue
            name = "index" if i == 0 else f"storage unit {i - 1}"
            where = self.handle.index_address if i == 0 else self.handle.unit_addresses[i - 1]
            raise ServerLost(name, f"TransferQueue {name} (pid {p.pid}, {where}) died: {how_it_ended(code)}")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("TransferQueue server %d ignored SIGTERM; killing it", p.pid)
                p.kill()
                p.wait(timeout=5)
        for p in self.procs:
            if p.returncode:  # died (or was killed) without unlinking its shared-memory blocks
                _unlink_blocks(p.pid)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> TQServers:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def start_transferqueue(cfg: TransferQueueConfig) -> TQServers:
    """Start the index and ``cfg.num_storage_units`` units as subprocesses; returns once all are bound.

    Raises TQError when a server exits or does not publish its endpoint within ``cfg.start_timeout_s``
    (every started process is stopped first); RuntimeError for ``transferqueue.host=node`` outside a Ray
    cluster (``common.net.resolve_bind_host``).
    """
    host = resolve_bind_host("transferqueue.host", cfg.host)
    curve = _keys(cfg)
    run_dir = tempfile.mkdtemp(prefix="hflow-tq-")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs, files = [], []
    try:
        for i, spec in enumerate(_specs(cfg, curve, host)):
            spec["endpoint_file"] = files_i = os.path.join(run_dir, f"server{i}.json")
            spec["local_address"] = local_address(run_dir, i)
            spec["node"] = node_id()
            files.append(files_i)
            p = subprocess.Popen([sys.executable, "-c", "from transferqueue.launch import _server_main; _server_main()"],
                                 stdin=subprocess.PIPE, env=env, start_new_session=True)
            procs.append(p)
            p.stdin.write(json.dumps(spec).encode())
            p.stdin.close()
        infos = _wait_files(files, procs, cfg.start_timeout_s)
    except BaseException:
        TQServers(None, procs, run_dir).shutdown()  # type: ignore[arg-type]
        raise
    return TQServers(_handle(cfg, infos, curve), procs, run_dir)


def _wait_files(files: list[str], procs: list[subprocess.Popen], timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    infos: list[dict | None] = [None] * len(files)
    while None in infos:
        for i, path in enumerate(files):
            if infos[i] is None and os.path.exists(path):
                with open(path) as f:
                    infos[i] = json.load(f)
            if procs[i].poll() is not None:
                raise TQError(f"TransferQueue server {i} exited with code {procs[i].returncode} during start")
        if time.monotonic() > deadline:
            raise TQError(f"TransferQueue servers did not start within {timeout_s} s")
        time.sleep(0.02)
    return infos  # type: ignore[return-value]
