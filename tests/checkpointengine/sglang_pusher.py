"""Test helper: trainer rank 0 → SGLang servers (a real SGLang, or ``rollers.sglang_server``) over SGLang's
own weight-update API, as a trainer written against SGLang would push. Runs do not take this path (with
SGLang rollers the roller actor receives through the weight plane and loads into its server over a
broadcast group of its own, ``SGLangEngine.load_weights``); it lives here to check our server against
a sender that speaks only SGLang's API.

::

    pusher (rank 0)                                       every server (rank 1 + i)
      init_group: store on loopback ──POST /init_weights_update_group──> joins the group
      push(v):    cast, map names ──POST /update_weights_from_distributed {names, dtypes, shapes,
                                         group_name, weight_version: "v", flush_cache}──>
                  broadcast each tensor, in order, meanwhile ─────────────> receives, loads, commits v
                  <── 200 {"success": true} = the server's ack, else its message = the failure

``push_via_disk`` is the ``disk`` path: safetensors files + ``/update_weights_from_disk``.
One HTTP call carries a whole update, so each server commits ``v`` atomically (SGLang and our server
commit the call's ``weight_version`` per call). Pausing in-flight requests is the server's part: it
holds new requests back and waits for running ones (SGLang's writer lock) unless paused before.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterable

import aiohttp
import torch

from checkpointengine import broadcast as bc
from checkpointengine.bucket import dtype_name
from checkpointengine.config import CheckpointEngineConfig
from checkpointengine.naming import WeightNameMapper, to_engine_dtype
from checkpointengine.protocol import WeightSyncError
from checkpointengine.sender import SyncReport
from checkpointengine.storage import DiskVersions
from common.env import LOOPBACK


class SGLangWeightPusher:
    """Pushes weights to ``urls`` (``http://127.0.0.1:port`` each) through one broadcast group.

    ``cfg``: dtype, timeout and group backend (gloo on CPU); ``mapper``: names and coverage as for
    ``WeightSender``. Use as an async context manager or call ``close()``.
    """

    def __init__(self, cfg: CheckpointEngineConfig, urls: Iterable[str],
                 mapper: WeightNameMapper | None = None, host: str = LOOPBACK):
        self.cfg = cfg
        self.urls = [u.rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("SGLangWeightPusher needs at least one server url")
        self.mapper = mapper or WeightNameMapper()
        self.host = host
        self.engine_dtype = getattr(torch, cfg.dtype)
        self.backend = "nccl" if cfg.group_backend == "nccl" or (
            cfg.group_backend == "auto" and torch.cuda.is_available()) else "gloo"
        self.server_versions: dict[str, int] = {}
        self.weight_version = -1
        self._group: bc.WeightUpdateGroup | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stats = {"num_syncs": 0, "num_failed_syncs": 0, "last_sync_s": 0.0, "last_bytes": 0,
                       "total_bytes": 0}

    async def __aenter__(self) -> SGLangWeightPusher:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
        return self._session

    async def _post(self, url: str, path: str, body: dict) -> str | None:
        """None on success, else the failure (status and the server's message)."""
        try:
            async with self._http().post(url + path, json=body) as resp:
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return f"{path}: {type(exc).__name__}: {exc}"
        if resp.status == 200 and isinstance(data, dict) and data.get("success", False):
            return None
        message = data.get("message") if isinstance(data, dict) else data
        return f"{path}: HTTP {resp.status}: {message}"

    async def init_group(self) -> None:
        """Form the group of this process (rank 0) and every server. Raises WeightSyncError naming the
        servers that refused, TimeoutError/RuntimeError when the group does not form in time."""
        await self._destroy_group()
        world = len(self.urls) + 1
        name = f"hflow-sglang-{uuid.uuid4().hex[:12]}"
        store = bc.create_sender_store(self.host, 0, world, self.cfg.timeout_s)
        join = asyncio.ensure_future(asyncio.to_thread(
            bc.create_sender_group, store, world, name, self.backend, self.cfg.timeout_s))
        bodies = [{"master_address": self.host, "master_port": store.port, "rank_offset": i + 1,
                   "world_size": world, "group_name": name, "backend": self.backend}
                  for i in range(len(self.urls))]
        errors = await asyncio.gather(*(self._post(u, "/init_weights_update_group", b)
                                        for u, b in zip(self.urls, bodies, strict=True)))
        failures = {u: e for u, e in zip(self.urls, errors, strict=True) if e is not None}
        if failures:
            join.add_done_callback(lambda f: f.exception())  # ends at its rendezvous timeout
            raise WeightSyncError(self.weight_version, failures)
        self._group = await join

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int,
                   flush_cache: bool = True) -> SyncReport:
        """Send ``(trainer_name, tensor)`` as ``weight_version`` to every server (one call each, one broadcast
        per tensor). Raises ValueError for a weight_version below the last, MissingWeightsError before anything
        is sent, WeightSyncError naming the servers that failed (they keep their old weight_version; the group
        is re-formed on the next push)."""
        if weight_version < self.weight_version:
            raise ValueError(f"weight_version {weight_version} is below the last one sent ({self.weight_version})")
        tensors = []
        for name, tensor in self.mapper.route(named_tensors):
            tensor = to_engine_dtype(tensor.detach(), self.engine_dtype)
            tensors.append((name, tensor.cpu() if self.backend == "gloo" else tensor))
        self.mapper.check_coverage([n for n, _ in tensors])
        if not tensors:
            raise ValueError("push: no tensors")
        if self._group is None:
            await self.init_group()
        start = time.perf_counter()
        body = {"names": [n for n, _ in tensors], "dtypes": [dtype_name(t.dtype) for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors], "group_name": self._group.group_name,
                "weight_version": str(weight_version), "flush_cache": flush_cache}
        posts = asyncio.gather(*(self._post(u, "/update_weights_from_distributed", body) for u in self.urls))
        send = asyncio.ensure_future(asyncio.to_thread(self._broadcast_all, [t for _, t in tensors]))
        errors = await posts
        failures = {u: e for u, e in zip(self.urls, errors, strict=True) if e is not None}
        try:
            await asyncio.wait_for(asyncio.shield(send), timeout=self.cfg.timeout_s if not failures else 1.0)
        except (TimeoutError, RuntimeError) as exc:
            send.add_done_callback(lambda f: f.exception())
            failures.setdefault("broadcast", f"{type(exc).__name__}: {exc}")
        if failures:
            self._group = None  # out of step: re-form on the next push
        return self._conclude(weight_version, failures, time.perf_counter() - start,
                              sum(t.nbytes for _, t in tensors), 1)

    async def push_via_disk(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int,
                            flush_cache: bool = True) -> SyncReport:
        """The ``disk`` path: write ``weight_version`` as safetensors files (``DiskVersions`` under
        ``cfg.disk_dir``, a Hugging Face index beside them) and POST ``/update_weights_from_disk`` to every
        server. The directory holds weights only: a real SGLang server also wants the model's
        ``config.json`` there (copy it in). Raises as ``push``."""
        if weight_version < self.weight_version:
            raise ValueError(f"weight_version {weight_version} is below the last one sent ({self.weight_version})")
        if not self.cfg.disk_dir:
            raise ValueError("checkpointengine.disk_dir must name a directory the servers can read")
        tensors = [(n, to_engine_dtype(t.detach(), self.engine_dtype).cpu())
                   for n, t in self.mapper.route(named_tensors)]
        self.mapper.check_coverage([n for n, _ in tensors])
        start = time.perf_counter()
        disk = DiskVersions(self.cfg.disk_dir)
        disk.begin(weight_version)
        bucket, used, index = [], 0, 0
        for name, tensor in tensors:
            if bucket and used + tensor.nbytes > self.cfg.bucket_bytes:
                disk.write_bucket(weight_version, index, bucket)
                bucket, used, index = [], 0, index + 1
            bucket.append((name, tensor))
            used += tensor.nbytes
        if bucket:
            disk.write_bucket(weight_version, index, bucket)
        num_bytes = sum(t.nbytes for _, t in tensors)
        disk.finish(weight_version, num_bytes)
        body = {"model_path": str(disk.weight_version_dir(weight_version)), "weight_version": str(weight_version),
                "flush_cache": flush_cache}
        errors = await asyncio.gather(*(self._post(u, "/update_weights_from_disk", body) for u in self.urls))
        failures = {u: e for u, e in zip(self.urls, errors, strict=True) if e is not None}
        return self._conclude(weight_version, failures, time.perf_counter() - start, num_bytes, index + 1)

    def _conclude(self, weight_version: int, failures: dict[str, str], duration: float, num_bytes: int,
                  num_buckets: int) -> SyncReport:
        if failures:
            self._stats["num_failed_syncs"] += 1
            raise WeightSyncError(weight_version, failures)
        for u in self.urls:
            self.server_versions[u] = weight_version
        self.weight_version = weight_version
        self._stats.update(num_syncs=self._stats["num_syncs"] + 1, last_sync_s=duration, last_bytes=num_bytes,
                           total_bytes=self._stats["total_bytes"] + num_bytes)
        return SyncReport(weight_version, list(self.urls), duration, num_bytes, num_buckets)

    def _broadcast_all(self, tensors: list[torch.Tensor]) -> None:
        for work in bc.broadcast_tensors(self._group, tensors):
            work.wait()

    def stats(self) -> dict:
        return {**self._stats, "weight_version": self.weight_version, "roller_weight_versions": dict(self.server_versions)}

    async def _destroy_group(self) -> None:
        if self._group is not None:
            bc.destroy_group(self._group)
            self._group = None

    async def close(self) -> None:
        """Destroy the group and close the HTTP session. Idempotent."""
        await self._destroy_group()
        if self._session is not None:
            await self._session.close()
            self._session = None
