"""The TransferQueue servers as Ray actors (test-only: runs start them as subprocesses,
``transferqueue.launch.start_transferqueue``): each actor runs one server loop in a thread."""

from __future__ import annotations

import shutil
import tempfile
import threading
from typing import Any

from transferqueue.config import TransferQueueConfig
from transferqueue.launch import _handle, _info, _keys, _specs, build_server, local_address
from transferqueue.records import TQError, TQHandle


class _ServerActor:
    """A Ray actor running one TransferQueue server loop in a thread; it answers on its own ZMQ socket."""

    def __init__(self, spec: dict):
        from common.env import set_torch_threads

        set_torch_threads(1)
        self.dir = tempfile.mkdtemp(prefix="hflow-tq-")  # for the ipc endpoint
        self.server = build_server(dict(spec, local_address=local_address(self.dir, 0)))
        self.thread = threading.Thread(target=self.server.serve_forever, name=f"tq-{spec['role']}", daemon=True)
        self.thread.start()

    def info(self) -> dict[str, Any]:
        return _info(self.server)

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


class TQRayServers:
    """Running servers as Ray actors and their handle. ``shutdown()`` stops loops, then kills actors."""

    def __init__(self, handle: TQHandle, actors: list):
        self.handle, self.actors = handle, actors

    def shutdown(self, timeout_s: float = 10.0) -> None:
        import ray

        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=timeout_s)
        finally:
            for a in self.actors:
                ray.kill(a)
        self.actors = []


def start_transferqueue_ray(cfg: TransferQueueConfig, num_cpus: float = 0.1) -> TQRayServers:
    """Start the index and units as Ray actors (``num_cpus`` each); needs ``ray.init`` done. Raises
    TQError when they do not answer within ``cfg.start_timeout_s``."""
    import ray

    curve = _keys(cfg)
    actor_cls = ray.remote(num_cpus=num_cpus)(_ServerActor)
    actors = [actor_cls.remote(spec) for spec in _specs(cfg, curve, cfg.host)]
    try:
        infos = ray.get([a.info.remote() for a in actors], timeout=cfg.start_timeout_s)
    except Exception as exc:
        for a in actors:
            ray.kill(a)
        raise TQError(f"TransferQueue Ray actors did not start: {exc}") from exc
    return TQRayServers(_handle(cfg, infos, curve), actors)
