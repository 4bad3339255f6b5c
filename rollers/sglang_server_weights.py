"""The weight-update endpoints of ``rollers.sglang_server``: SGLang's custom process groups
(``/init_weights_update_group``, ``/destroy_weights_update_group``), ``/update_weights_from_distributed``
(gloo broadcasts on CPU) and ``/update_weights_from_disk`` (a directory of safetensors files).

An update holds the engine through the server's ``exclusive`` (drain or abort in-flight requests unless
paused), receives or reads the tensors, loads them with the new ``weight_version`` and flushes the cache.
A failed receive keeps the old weights and version.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from checkpointengine import broadcast as bc
from rollers import sglang_protocol as proto
from rollers.engine import Engine, EngineError
from rollers.sglang_http import BadRequest, error, is_loopback, result

logger = logging.getLogger(__name__)


class WeightServer(Protocol):
    """What the weight endpoints use of their server (``rollers.sglang_server.SGLangServer``): its ``engine``,
    the limit of every rendezvous and broadcast (``group_timeout_s``), whether a non-loopback master is
    accepted, the ``model_path`` it reports (set by a successful ``/update_weights_from_disk``), its body
    reader and its ``exclusive`` hold of the engine for an update."""

    engine: Engine
    group_timeout_s: float
    allow_remote_master: bool
    model_path: str

    async def read_json(self, request: web.Request, fields: tuple[str, ...], required: tuple[str, ...] = ()
                        ) -> dict: ...

    def exclusive(self, abort_all: bool) -> AbstractAsyncContextManager[None]: ...


class WeightEndpoints:
    """The weight-update routes of one ``WeightServer``, and the custom process groups they opened."""

    def __init__(self, server: WeightServer):
        self.server = server
        self.groups: dict[str, Any] = {}

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/init_weights_update_group", self.init_weights_update_group),
                web.post("/destroy_weights_update_group", self.destroy_weights_update_group),
                web.post("/update_weights_from_distributed", self.update_weights_from_distributed),
                web.post("/update_weights_from_disk", self.update_weights_from_disk)]

    def destroy_all(self) -> None:
        for name in list(self.groups):
            bc.destroy_group(self.groups.pop(name))

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        required = ("master_address", "master_port", "rank_offset", "world_size")
        try:
            body = await self.server.read_json(request, proto.INIT_GROUP_FIELDS, required)
            group_name = proto.body_group_name(body)
        except (BadRequest, proto.SGLangAPIError) as exc:
            return error(str(exc))
        backend = body.get("backend", "nccl")
        address, port, rank, world = (body[k] for k in required)
        if backend != "gloo":
            return error(f"backend must be 'gloo' on this CPU server, got {backend!r}")
        if not isinstance(address, str) or not (self.server.allow_remote_master or is_loopback(address)):
            return error(f"master_address {address!r} is not a loopback address (allow_remote_master is off)")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (port, rank, world)) or not (
            0 < port < 65536 and 0 < rank < world
        ):
            return error(f"need 0 < master_port < 65536 and 0 < rank_offset < world_size, got {port}, {rank}, {world}")
        if group_name in self.groups:
            return error(f"group_name {group_name!r} is already initialised")
        try:
            self.groups[group_name] = await asyncio.to_thread(
                bc.init_weights_update_group, address, port, rank, world, group_name, backend,
                self.server.group_timeout_s)
        except Exception as exc:  # torch raises RuntimeError/DistStoreError/DistNetworkError subclasses
            return result(False, f"Failed to initialize custom process group: {exc}.")
        return result(True, "Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = await self.server.read_json(request, proto.DESTROY_GROUP_FIELDS)
            name = proto.body_group_name(body)
        except (BadRequest, proto.SGLangAPIError) as exc:
            return error(str(exc))
        if name not in self.groups:
            return result(False, "The group to be destroyed does not exist.")
        bc.destroy_group(self.groups.pop(name))
        return result(True, "Succeeded to destroy custom process group.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await self.server.read_json(request, proto.UPDATE_DISTRIBUTED_FIELDS, ("names", "dtypes", "shapes"))
            specs = proto.parse_tensor_specs(body["names"], body["dtypes"], body["shapes"])
            group_name = proto.body_group_name(body)
            if group_name not in self.groups:
                raise BadRequest(f"group {group_name!r} is not initialised: call /init_weights_update_group first")
            if body.get("selector", "all") not in ("all", "target"):
                raise BadRequest(f"selector must be 'all' or 'target' (no draft model here), got {body['selector']!r}")
            load_format = body.get("load_format")
            if load_format not in (None, proto.FLATTENED_BUCKET):
                raise BadRequest(f"load_format must be null or {proto.FLATTENED_BUCKET!r}, got {load_format!r}")
            weight_version = self._weight_version(body.get("weight_version"))
            abort_all, flush = _update_flags(body)
            async with self.server.exclusive(abort_all):
                try:
                    tensors = await asyncio.wait_for(asyncio.to_thread(
                        proto.receive_weights, specs, self.groups[group_name], load_format),
                        self.server.group_timeout_s)
                except Exception as exc:  # a failed/timed-out broadcast: keep the old weights and version
                    return result(False, f"Failed to receive weights: {exc}")
                ok, message = await self._load(tensors, weight_version, flush)
        except (BadRequest, proto.SGLangAPIError) as exc:
            return error(str(exc))
        return result(ok, message)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self.server.read_json(request, proto.UPDATE_DISK_FIELDS, ("model_path",))
            if not isinstance(body["model_path"], str) or not body["model_path"]:
                raise BadRequest(f"model_path must be a non-empty string, got {body['model_path']!r}")
            files = sorted(Path(body["model_path"]).glob("*.safetensors"))
            if not files:
                raise BadRequest(f"model_path {body['model_path']!r} holds no *.safetensors files")
            if body.get("load_format") not in (None, "auto", "safetensors"):
                raise BadRequest(f"load_format must be null, 'auto' or 'safetensors', got {body['load_format']!r}")
            weight_version = self._weight_version(body.get("weight_version"))
            abort_all, flush = _update_flags(body)
            async with self.server.exclusive(abort_all):
                tensors = await asyncio.to_thread(_read_safetensors, files)
                ok, message = await self._load(tensors, weight_version, flush)
        except (BadRequest, proto.SGLangAPIError) as exc:
            return error(str(exc))
        if ok:
            self.server.model_path = str(body["model_path"])
        return result(ok, message, num_paused_requests=0)

    def _weight_version(self, value: Any) -> int:
        """The update's ``weight_version`` (SGLang sends a string); none given: the engine's + 1."""
        if value is None:
            weight_version = self.server.engine.weight_version + 1
            logger.warning("weight update without weight_version: committing %d (current + 1)", weight_version)
            return weight_version
        try:
            return proto.parse_weight_version(value)
        except proto.SGLangAPIError as exc:
            raise BadRequest(str(exc)) from exc

    async def _load(self, tensors, weight_version: int, flush: bool) -> tuple[bool, str]:
        engine = self.server.engine
        try:
            await engine.load_weights(tensors, weight_version)
        except (KeyError, ValueError, EngineError) as exc:
            return False, f"Failed to update weights: {exc}"
        message = f"Succeeded to update model weights. Weight version updated to {weight_version}."
        if flush:
            try:
                await engine.flush_cache()
            except EngineError as exc:
                return False, (f"Weights were updated, but the cache was not flushed because requests are "
                               f"still running or queued ({exc}). Retract or finish them, then call /flush_cache.")
        return True, message


def _update_flags(body: dict) -> tuple[bool, bool]:
    """``abort_all_requests`` (default false) and ``flush_cache`` (default true) of a weight update, typed;
    ``torch_empty_cache``/``recapture_cuda_graph`` are CUDA-only (no effect here) but must be booleans too."""
    for key in ("torch_empty_cache", "recapture_cuda_graph"):
        proto.body_flag(body, key, False)
    return proto.body_flag(body, "abort_all_requests", False), proto.body_flag(body, "flush_cache", True)


def _read_safetensors(files: list[Path]) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    return [item for f in files for item in load_file(f).items()]
