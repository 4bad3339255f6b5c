"""The ``Engine`` interface as a client of an SGLang server's native HTTP API.

Works against a real SGLang 0.5.x server and against ``rollers.sglang_server`` (our torch engine behind
the same endpoints) alike; ``rollers.sglang_launcher`` starts either. Field names are SGLang's
(``rollers.sglang_protocol``).

Weight updates, the sequence a roller runs (``rollers.weight_update.paused_update``, one implementation for
every engine)::

    /pause_generation {mode} ──> apply(): /begin_weight_update (newer SGLang; skipped where 404)
                                         /update_weights_from_distributed or /update_weights_from_disk
                                         /end_weight_update
                             ──> /flush_cache: after ``abort`` retried with exponential backoff while it
                                 answers 400 (aborted requests still draining), at most ``max_retries``
                                 times; after ``retract`` once (refused while retracted requests wait:
                                 logged); none after ``in_place``
                             ──> /continue_generation (also after a failure: the old weights stay)

``load_weights`` (the ``Engine`` method) sends tensors from this process: it makes this client rank 0
of a two-rank gloo group with the server (rank 1) and broadcasts them through
``/update_weights_from_distributed``; it needs the server on this node. The trainer-to-roller path
uses ``init_weights_update_group``/``update_weights_from_distributed`` with the checkpoint engine's
broadcast sender as rank 0 instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import aiohttp
import torch
from aiohttp.http_exceptions import LineTooLong

from checkpointengine import broadcast as bc
from rollers import sglang_protocol as proto
from rollers.engine import PAUSE_MODES, Engine, EngineError, GenerationOutput, GenerationRequest

logger = logging.getLogger(__name__)


class SGLangHTTPError(EngineError):
    """A non-2xx answer from the server: ``status`` (HTTP code), ``path`` and the server's message."""

    def __init__(self, path: str, status: int, message: str):
        super().__init__(f"{path} answered HTTP {status}: {message}")
        self.path, self.status, self.message = path, status, message


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may still take it before it is bound)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class SGLangEngine(Engine):
    """HTTP client of one SGLang server at ``url`` (e.g. ``http://127.0.0.1:30000``).

    ``request_timeout_s``: limit of one ``/generate``; ``control_timeout_s``: other calls;
    ``group_timeout_s``: rendezvous and broadcasts of a weight update; ``max_retries``/``backoff_s``/
    ``max_backoff_s``: ``/flush_cache`` retries while the server answers 400 (delays ``backoff_s``,
    doubled each time up to ``max_backoff_s``); ``max_event_bytes``: longest SSE line accepted (SGLang
    streams the cumulative output, so long responses make long lines); ``on_shutdown``: awaited by
    ``shutdown`` (the launcher
    stops its server there). Create and use it on one event loop.
    """

    def __init__(
        self, url: str, *, request_timeout_s: float = 600.0, control_timeout_s: float = 120.0,
        group_timeout_s: float = 120.0, max_retries: int = 8, backoff_s: float = 0.1, max_backoff_s: float = 5.0,
        max_event_bytes: int = 256 * 1024**2, on_shutdown: Callable[[], Awaitable[None]] | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if min(request_timeout_s, control_timeout_s, group_timeout_s, backoff_s, max_backoff_s) <= 0 or max_retries < 0:
            raise ValueError("timeouts and backoffs must be > 0 and max_retries >= 0")
        self.url = url.rstrip("/")
        self.request_timeout_s, self.control_timeout_s, self.group_timeout_s = (
            request_timeout_s, control_timeout_s, group_timeout_s)
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.max_event_bytes = max_event_bytes
        self._on_shutdown = on_shutdown
        self._session: aiohttp.ClientSession | None = None
        self._weight_version = 0
        self._own_group: tuple[str, Any] | None = None  # (group_name, WeightUpdateGroup) of load_weights
        self._model_info_path = "/model_info"
        self._has_update_session: bool | None = None  # server knows /begin_weight_update (None: not asked)
        self._closed = False

    # --------------------------------------------------------------------------------------- HTTP

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise EngineError(f"SGLangEngine({self.url}) is shut down")
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
        return self._session

    async def _call(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None,
                    params: dict | None = None) -> Any:
        """One request; the decoded JSON answer (or text). Raises SGLangHTTPError for non-2xx answers,
        EngineError when the server cannot be reached or times out."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.control_timeout_s)
        try:
            async with self._http().request(method, self.url + path, json=body, params=params, timeout=timeout) as r:
                text = await r.text()
                if r.status >= 400:
                    raise SGLangHTTPError(path, r.status, _message(text))
                return json.loads(text) if r.content_type == "application/json" else text
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            raise EngineError(f"{method} {self.url}{path} failed: {exc!r}") from exc

    async def _post_ok(self, path: str, body: dict, timeout_s: float | None = None) -> str:
        """POST expecting SGLang's ``{success, message}``; raises SGLangHTTPError unless successful."""
        answer = await self._call("POST", path, body, timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise SGLangHTTPError(path, 200, answer.get("message", ""))
        return answer.get("message", "") if isinstance(answer, dict) else str(answer)

    # ------------------------------------------------------------------------------- Engine API

    @property
    def weight_version(self) -> int:
        """The last weight version this client saw: at ``connect``, after its updates, in answers."""
        return self._weight_version

    async def connect(self, timeout_s: float = 60.0) -> None:
        """Wait (at most ``timeout_s``) until ``/health`` answers 200, then read the weight version.
        Raises EngineError on timeout."""
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise EngineError(f"SGLang server at {self.url} not healthy after {timeout_s} s")
            await asyncio.sleep(0.2)
        self._weight_version = await self.get_weight_version()

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        """``/generate`` without streaming. Raises ValueError when the server refuses the request (400),
        EngineError for other failures; cancelling the caller closes the connection (server aborts)."""
        try:
            answer = await self._call("POST", "/generate", proto.generate_body(request, stream=False),
                                      self.request_timeout_s)
        except SGLangHTTPError as exc:
            if exc.status == 400:
                raise ValueError(f"request {request.request_id!r} refused: {exc.message}") from exc
            raise
        return self._seen(proto.parse_generate_output(answer, request.request_id, None))

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """``/generate`` with ``stream: true``: yields the growing output per SSE event until
        ``data: [DONE]``. Same errors as ``generate``; closing the iterator early closes the connection."""
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        body = proto.generate_body(request, stream=True)
        out: GenerationOutput | None = None
        try:
            async with self._http().post(self.url + "/generate", json=body, timeout=timeout) as r:
                if r.status >= 400:
                    message = _message(await r.text())
                    if r.status == 400:
                        raise ValueError(f"request {request.request_id!r} refused: {message}")
                    raise SGLangHTTPError("/generate", r.status, message)
                while raw := await r.content.readline(max_line_length=self.max_event_bytes):
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise EngineError(f"/generate stream of {request.request_id!r} failed: {event['error']}")
                    out = self._seen(proto.parse_generate_output(event, request.request_id, out))
                    yield out
        except (aiohttp.ClientError, TimeoutError, LineTooLong) as exc:
            raise EngineError(f"/generate stream of {request.request_id!r} failed: {exc!r}") from exc
        if out is None or out.finish_reason is None:
            raise EngineError(f"/generate stream of {request.request_id!r} ended before the request finished")

    def _seen(self, out: GenerationOutput) -> GenerationOutput:
        if out.weight_versions:
            self._weight_version = max(self._weight_version, out.weight_versions[-1])
        return out

    async def pause(self, mode: str = "retract") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {list(PAUSE_MODES)}")
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        """``/flush_cache`` once. Raises SGLangHTTPError (an EngineError) while requests are running."""
        await self._call("POST", "/flush_cache")

    async def flush_cache_with_retry(self) -> None:
        """``/flush_cache``, retried with exponential backoff while it answers 400 (requests draining: SGLang
        ends the requests of an ``abort`` pause asynchronously). Raises EngineError after ``max_retries``
        retries, with the server's last message."""
        delay = self.backoff_s
        for attempt in range(self.max_retries + 1):
            try:
                return await self.flush_cache()
            except SGLangHTTPError as exc:
                if exc.status != 400 or attempt == self.max_retries:
                    raise EngineError(
                        f"/flush_cache still refused after {attempt + 1} attempts: {exc.message}") from exc
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.max_backoff_s)

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health", timeout_s=min(self.control_timeout_s, 10.0))
            return True
        except EngineError:
            return False

    async def get_model_info(self) -> dict[str, Any]:
        """``/model_info`` (SGLang ≥ 0.5.2x; ``/get_model_info`` there is deprecated), falling back to
        ``/get_model_info`` on servers that answer 404."""
        if self._model_info_path == "/model_info":
            try:
                return await self._call("GET", "/model_info")
            except SGLangHTTPError as exc:
                if exc.status != 404:
                    raise
                self._model_info_path = "/get_model_info"
        return await self._call("GET", self._model_info_path)

    async def get_weight_version(self) -> int:
        """The server's weight version (from the model info; SGLang's string read as an int)."""
        info = await self.get_model_info()
        return proto.parse_weight_version(info["weight_version"], f"{self._model_info_path} weight_version")

    # ---------------------------------------------------------------------------- weight updates

    async def _in_update_session(self, path: str, body: dict[str, Any]) -> str:
        """POST ``body`` to ``path`` inside SGLang's ``/begin_weight_update`` … ``/end_weight_update``
        (servers ≥ 0.5.2x refuse weight loads outside one; older servers answer 404 and need none)."""
        if self._has_update_session is not False:
            try:
                await self._post_ok("/begin_weight_update", {})
                self._has_update_session = True
            except SGLangHTTPError as exc:
                if exc.status != 404:
                    raise
                self._has_update_session = False
        try:
            return await self._post_ok(path, body, self.group_timeout_s)
        finally:
            if self._has_update_session:
                await self._post_ok("/end_weight_update", {})

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = proto.DEFAULT_GROUP_NAME, backend: str = "gloo",
    ) -> str:
        """Make the server join a weight-update group (it blocks until rank 0 and all ranks join)."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return await self._post_ok("/init_weights_update_group", body, self.group_timeout_s)

    async def destroy_weights_update_group(self, group_name: str = proto.DEFAULT_GROUP_NAME) -> str:
        return await self._post_ok("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], weight_version: int,
        group_name: str = proto.DEFAULT_GROUP_NAME, load_format: str | None = None, flush_cache: bool = False,
    ) -> str:
        """Tell the server to receive ``names`` (each broadcast from rank 0, in order; or one
        ``flattened_bucket``) and commit ``weight_version``. Rank 0 must broadcast meanwhile. Raises
        SGLangHTTPError with the server's message on failure."""
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": flush_cache, "weight_version": str(weight_version)}
        if load_format is not None:
            body["load_format"] = load_format
        message = await self._in_update_session("/update_weights_from_distributed", body)
        self._weight_version = max(self._weight_version, weight_version)
        return message

    async def update_weights_from_disk(self, model_path: str, weight_version: int, flush_cache: bool = False) -> str:
        """Load the weights under ``model_path`` (safetensors) and commit ``weight_version``."""
        body = {"model_path": model_path, "weight_version": str(weight_version), "flush_cache": flush_cache}
        message = await self._in_update_session("/update_weights_from_disk", body)
        self._weight_version = max(self._weight_version, weight_version)
        return message

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        """Send ``named_tensors`` from this process (rank 0 of a two-rank gloo group with the server) and
        commit ``weight_version``; call it while paused. Raises ValueError for a version that does not
        increase or no tensors, EngineError (the server's message) for unknown names or bad shapes."""
        tensors = [(name, t.detach().cpu()) for name, t in named_tensors]
        if not tensors:
            raise ValueError("load_weights: no tensors")
        if weight_version <= self._weight_version:
            raise ValueError(f"weight_version must increase: got {weight_version}, server has {self._weight_version}")
        group_name, group = await self._ensure_own_group()
        update = asyncio.ensure_future(self.update_weights_from_distributed(
            [n for n, _ in tensors], [proto.dtype_to_sglang(t.dtype) for _, t in tensors],
            [list(t.shape) for _, t in tensors], weight_version, group_name=group_name))
        send = asyncio.ensure_future(asyncio.to_thread(proto.send_weights, tensors, group, None))
        await asyncio.wait({update, send}, return_when=asyncio.FIRST_EXCEPTION)
        if send.done() and send.exception() is None:
            await update  # the server's verdict (raises with its message)
            return
        # The server refused before receiving (or the broadcast broke): this group is out of step; a
        # send still blocked in gloo ends at its timeout. The next load_weights makes a new group.
        self._own_group = None
        send.add_done_callback(lambda f: f.exception())  # retrieve it: no "never retrieved" warning
        if update.done() and update.exception() is not None:
            raise update.exception()
        update.cancel()
        raise EngineError(f"load_weights: broadcast to {self.url} failed: {send.exception()!r}")

    async def _ensure_own_group(self) -> tuple[str, Any]:
        if self._own_group is None:
            name = f"hflow-{uuid.uuid4().hex[:12]}"
            store = bc.create_sender_store("127.0.0.1", 0, 2, self.group_timeout_s)  # listens on loopback only
            join = asyncio.ensure_future(asyncio.to_thread(
                bc.create_sender_group, store, 2, name, "gloo", self.group_timeout_s))
            try:
                await self.init_weights_update_group("127.0.0.1", store.port, 1, 2, name, "gloo")
            except BaseException:
                join.cancel()  # the thread ends at its rendezvous timeout
                raise
            self._own_group = (name, await join)
        return self._own_group

    async def shutdown(self) -> None:
        """Destroy this client's group, close the HTTP session, run ``on_shutdown``. Idempotent."""
        if self._closed:
            return
        if self._own_group is not None:
            name, group = self._own_group
            self._own_group = None
            try:
                await self.destroy_weights_update_group(name)
            except EngineError as exc:
                logger.warning("could not destroy weight-update group %s on %s: %s", name, self.url, exc)
            bc.destroy_group(group)
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        if self._on_shutdown is not None:
            await self._on_shutdown()


def _message(text: str) -> str:
    """The human message of an error answer: SGLang's ``message``/``error.message`` or the text."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()
    if isinstance(body, dict):
        if isinstance(body.get("message"), str):
            return body["message"]
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
    return text.strip()
