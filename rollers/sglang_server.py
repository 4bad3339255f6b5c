"""Any ``rollers.engine.Engine`` (in practice the torch engine) behind SGLang's native HTTP endpoints.

So the client path that talks to real SGLang servers on GPUs (``rollers.sglang_engine``) runs on every
machine. Field names and answers follow SGLang 0.5.x (``rollers.sglang_protocol``); what differs:

* ``/generate`` takes one request of token ids (no ``text``, no batches, no top-logprobs);
* ``/update_weights_from_tensor`` is absent: its payload is pickled and this server accepts no pickle.
  Weights come through ``/update_weights_from_distributed`` (gloo on CPU) or ``/update_weights_from_disk``
  (a directory of safetensors files);
* ``/get_weight_version`` (older SGLang) is served beside ``/get_model_info``'s ``weight_version``.

::

    HTTP client ──/generate──> admission gate ──> engine.generate / engine.stream ──> JSON or SSE
                 ──/pause_generation, /continue_generation, /flush_cache──> engine
                 ──/update_weights_from_distributed──> (drain if not paused) ──> receive broadcasts
                                                        (thread) ──> engine.load_weights ──> flush

A weight update on an engine that is not paused waits for in-flight requests to finish while holding
new ones back (SGLang's writer lock), then loads; after ``/pause_generation`` it loads at once.
Bad requests get HTTP 400 with ``{"success": false, "message": ...}`` (plus SGLang's ``error`` object),
and fail alone: every field is typed, sampling values must be finite and in range, and ``/generate`` is
checked against the model (``Engine.check_request``: vocabulary, context length) before a stream answers
200; ``/flush_cache?timeout=`` takes seconds in ``[0, drain_timeout_s]``.
The weight-update endpoints live in ``rollers.sglang_server_weights``, the shared HTTP pieces in
``rollers.sglang_http``. Run it with ``python -m rollers.sglang_server --model tiny --port 30000``; it binds
127.0.0.1 by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from rollers import sglang_protocol as proto
from rollers.engine import PAUSE_MODES, Engine, EngineError
from rollers.sglang_http import BadRequest, error, read_json, result
from rollers.sglang_server_weights import WeightEndpoints

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024**2


class SGLangServer:
    """Serves ``engine`` over HTTP with SGLang's endpoint and field names.

    ``vocab_size``: token ids in ``[0, vocab_size)`` are accepted; ``model_path``: reported by
    ``/get_model_info``; ``tokenizer``: optional, fills ``text`` and logprob texts; ``max_body_bytes``:
    larger bodies get 400; ``group_timeout_s``: limit of every rendezvous/broadcast of a weight update;
    ``drain_timeout_s``: how long an update on an unpaused engine waits for requests to finish;
    ``allow_remote_master``: accept a non-loopback ``master_address`` (off: loopback only);
    ``max_queued_requests``: ``/generate`` requests held at once (running or waiting); one more gets 503
    (SGLang's ``--max-queued-requests``). Raises ValueError for bad sizes.
    """

    def __init__(
        self, engine: Engine, *, vocab_size: int, model_path: str = "", tokenizer=None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, group_timeout_s: float = 120.0,
        drain_timeout_s: float = 300.0, allow_remote_master: bool = False, max_queued_requests: int = 4096,
    ):
        if vocab_size < 1 or max_body_bytes < 1024 or max_queued_requests < 1:
            raise ValueError(f"vocab_size and max_queued_requests must be >= 1 and max_body_bytes >= 1024, got "
                             f"{vocab_size}, {max_queued_requests}, {max_body_bytes}")
        self.engine = engine
        self.vocab_size = vocab_size
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.max_body_bytes = max_body_bytes
        self.group_timeout_s = group_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.allow_remote_master = allow_remote_master
        self.max_queued_requests = max_queued_requests
        self.weights = WeightEndpoints(self)
        self._paused = False
        self._num_in_flight = 0  # admitted /generate requests (a weight update waits for them)
        self._num_queued = 0  # /generate requests held, admitted or waiting for admission
        self._idle = asyncio.Condition()
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._update_lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_routes(self.weights.routes())
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind and serve; returns the port (a free one for ``port`` 0)."""
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        logger.info("SGLang-API server for %s on http://%s:%d", type(self.engine).__name__, host, self.port)
        return self.port

    async def stop(self) -> None:
        """Stop serving, destroy weight-update groups, shut the engine down. Idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self.weights.destroy_all()
        await self.engine.shutdown()

    # ------------------------------------------------------------------------------------- helpers

    async def read_json(self, request: web.Request, fields: tuple[str, ...], required: tuple[str, ...] = ()) -> dict:
        """The request's JSON object body, checked against ``fields``/``required``; raises BadRequest."""
        return await read_json(request, self.max_body_bytes, fields, required)

    @asynccontextmanager
    async def exclusive(self, abort_all: bool) -> AsyncIterator[None]:
        """Hold the engine for a weight update: at once when paused, else stop admitting, wait (at most
        ``drain_timeout_s``) for in-flight requests to finish (or abort them) and pause in place."""
        async with self._update_lock:
            if self._paused:
                yield
                return
            self._admitting.clear()
            try:
                if abort_all:
                    await self.engine.pause("abort")
                async with self._idle:
                    try:
                        await asyncio.wait_for(self._idle.wait_for(lambda: self._num_in_flight == 0),
                                               self.drain_timeout_s)
                    except TimeoutError as exc:
                        raise BadRequest(
                            f"{self._num_in_flight} requests still running after {self.drain_timeout_s} s; "
                            "pause generation first") from exc
                if not abort_all:
                    await self.engine.pause("in_place")
                try:
                    yield
                finally:
                    await self.engine.resume()
            finally:
                self._admitting.set()

    # ------------------------------------------------------------------------------------ generation

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self.read_json(request, ())
            parsed = proto.parse_generate_body(body, self.vocab_size, default_rid=uuid.uuid4().hex,
                                               max_input_len=self.engine.max_seq_len)
            self.engine.check_request(parsed.request)  # before a stream answers 200
        except (BadRequest, ValueError) as exc:
            return error(str(exc))
        if self._num_queued >= self.max_queued_requests:
            return error(f"The request queue is full ({self.max_queued_requests} requests; "
                          "max_queued_requests).", status=503)
        self._num_queued += 1
        try:
            await self._admitting.wait()
            return await self._run_generate(request, parsed)
        finally:
            self._num_queued -= 1

    async def _run_generate(self, request: web.Request, parsed: proto.ParsedGenerate) -> web.StreamResponse:
        self._num_in_flight += 1
        try:
            if parsed.stream:
                return await self._generate_stream(request, parsed)
            started = time.perf_counter()
            out = await self.engine.generate(parsed.request)
            return web.json_response(self._answer(out, parsed, time.perf_counter() - started))
        except ValueError as exc:
            return error(str(exc))
        except EngineError as exc:
            return error(str(exc), status=503)
        finally:
            async with self._idle:
                self._num_in_flight -= 1
                self._idle.notify_all()

    def _answer(self, out, parsed: proto.ParsedGenerate, latency_s: float | None) -> dict:
        texts = None
        if self.tokenizer is not None and parsed.return_text_in_logprobs:
            texts = [self.tokenizer.decode([t]) for t in out.output_ids]
        answer = proto.output_to_sglang(out, self.engine.weight_version, parsed.return_logprob, texts, latency_s)
        if self.tokenizer is not None:
            answer["text"] = self.tokenizer.decode(out.output_ids)
        return answer

    async def _generate_stream(self, request: web.Request, parsed: proto.ParsedGenerate) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        started = time.perf_counter()
        stream = self.engine.stream(parsed.request)
        try:
            async for out in stream:
                latency = time.perf_counter() - started if out.finish_reason else None
                event = json.dumps(self._answer(out, parsed, latency))
                await response.write(b"data: " + event.encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
        except (ValueError, EngineError) as exc:
            error = {"error": {"message": str(exc), "type": "invalid_request_error", "code": 400}}
            await response.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
        except ConnectionResetError:  # the client went away: closing the stream aborts the request
            return response
        finally:
            await stream.aclose()
        await response.write_eof()
        return response

    # ------------------------------------------------------------------------------------- control

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if await self.engine.health() else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": str(self.engine.weight_version),
            "served_model_name": self.model_path,
        })

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.weight_version)})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "POST"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
        raw = request.query.get("timeout", "0")
        try:
            timeout_s = float(raw)
        except ValueError:
            timeout_s = math.nan
        if not 0 <= timeout_s <= self.drain_timeout_s:  # NaN fails too: a deadline that never comes
            return web.Response(status=400, text=f"timeout must be a number of seconds in [0, "
                                                 f"{self.drain_timeout_s}] (drain_timeout_s), got {raw!r}\n")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.engine.flush_cache()
                return web.Response(text="Cache flushed.\n")
            except EngineError as exc:
                if time.monotonic() >= deadline:
                    return web.Response(status=400, text=f"Cache not flushed: {exc}\n")
            await asyncio.sleep(0.05)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await self.read_json(request, proto.PAUSE_FIELDS)
        except BadRequest as exc:
            return error(str(exc))
        mode = body.get("mode", "abort")  # SGLang's default
        if mode not in PAUSE_MODES:
            return error(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        try:
            await self.engine.pause(mode)
        except EngineError as exc:
            return error(str(exc), status=503)
        self._paused = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        try:
            await self.read_json(request, proto.CONTINUE_FIELDS)
        except BadRequest as exc:
            return error(str(exc))
        try:
            await self.engine.resume()
        except EngineError as exc:
            return error(str(exc), status=503)
        self._paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        try:
            body = await self.read_json(request, proto.BEGIN_UPDATE_FIELDS)
        except BadRequest as exc:
            return error(str(exc))
        if body.get("selector", "all") not in ("all", "target"):
            return error(f"selector must be 'all' or 'target' (no draft model here), got {body['selector']!r}")
        return result(True, "Weight-update session opened (no-op for this engine).")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        try:
            await self.read_json(request, proto.END_UPDATE_FIELDS)
        except BadRequest as exc:
            return error(str(exc))
        return result(True, "Weight-update session closed (no-op for this engine).")

# ------------------------------------------------------------------------------------------------ CLI


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Serve the torch engine behind SGLang's HTTP API.")
    p.add_argument("--model", default="tiny", help="tiny | smollm2-135m-instruct | a local HF model directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-batch-slots", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--allow-remote-master", action="store_true")
    p.add_argument("--max-queued-requests", type=int, default=4096)
    return p.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    from common.models import ModelConfig, load_model, load_tokenizer
    from rollers.torch_engine import TorchEngine

    model_cfg = ModelConfig(path=args.model, dtype=args.dtype)
    model, tokenizer = load_model(model_cfg), load_tokenizer(model_cfg)
    engine = TorchEngine(model, tokenizer, max_batch_slots=args.max_batch_slots,
                         weight_version=args.weight_version, seed=args.seed)
    server = SGLangServer(engine, vocab_size=int(model.get_output_embeddings().weight.shape[0]),
                          model_path=args.model, tokenizer=tokenizer, max_body_bytes=args.max_body_bytes,
                          allow_remote_master=args.allow_remote_master,
                          max_queued_requests=args.max_queued_requests)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start(args.host, args.port)
    print(f"SGLANG_SERVER_READY port={server.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    from common.env import setup_process_env

    args = _parse_args(argv)
    setup_process_env(num_threads=args.num_threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
