"""Every field our client sends and our server accepts is one SGLang's own request structures define.

The structures are read from the real ``sglang`` 0.5.x wheel (``pip download --no-deps`` into the cache
dir, then ``srt/managers/io_struct.py`` and ``srt/sampling/sampling_params.py`` parsed with ``ast``
straight from the zip: importing SGLang needs CUDA). A renamed or misspelled field fails here. Skipped
(with the pip error) only when the wheel cannot be fetched.
"""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import aiohttp
import pytest

from common.env import cache_dir
from common.models import ModelConfig, load_model
from rollers import sglang_protocol as proto
from rollers.engine import GenerationRequest, SamplingParams
from rollers.sglang_engine import SGLangEngine
from rollers.sglang_launcher import SGLangLauncher
from rollers.weight_update import paused_update

WHEEL_SPEC = "sglang>=0.5,<0.6"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
# Request structure of each POST endpoint (sglang/srt/entrypoints/http_proto.py).
ENDPOINT_STRUCTS = {
    "/generate": "GenerateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/flush_cache": "FlushCacheReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
}
GET_ENDPOINTS = {"/health", "/model_info"}


def _fetch_wheel() -> Path:
    target = cache_dir() / "sglang-wheel"
    found = sorted(target.glob("sglang-0.5.*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL_SPEC, "-d", str(target)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            error = result.stderr.strip()[-500:]
        except subprocess.TimeoutExpired:
            error = "pip download timed out after 300 s"
        found = sorted(target.glob("sglang-0.5.*.whl"))
        if not found:
            pytest.skip(f"cannot fetch the {WHEEL_SPEC!r} wheel with pip download: {error}")
    return found[-1]


def _class_fields(source: str) -> dict[str, set[str]]:
    """Annotated fields of every top-level class, inherited ones included (dataclasses and msgspec)."""
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> set[str]:
        node, out = classes[name], set()
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out |= fields(base.id)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out.add(stmt.target.id)
        return out

    return {name: fields(name) for name in classes}


@pytest.fixture(scope="module")
def sglang_fields() -> dict[str, set[str]]:
    wheel = _fetch_wheel()
    with zipfile.ZipFile(wheel) as zf:
        io_struct = _class_fields(zf.read(IO_STRUCT).decode())
        sampling = _class_fields(zf.read(SAMPLING).decode())
    structs = {name: io_struct[name] for name in ENDPOINT_STRUCTS.values()}
    structs["SamplingParams"] = sampling["SamplingParams"]
    assert {"input_ids", "sampling_params", "return_logprob", "stream"} <= structs["GenerateReqInput"]
    assert {"max_new_tokens", "temperature"} <= structs["SamplingParams"]
    return structs


def violations(path: str, body: dict | None, structs: dict[str, set[str]]) -> list[str]:
    """Field names in ``body`` (sent to ``path``) that SGLang's request structure does not define."""
    if path not in ENDPOINT_STRUCTS:
        return [f"{path}: not an endpoint this check knows"]
    allowed = structs[ENDPOINT_STRUCTS[path]]
    bad = [f"{path}: {key}" for key in (body or {}) if key not in allowed]
    sampling = (body or {}).get("sampling_params") or {}
    bad += [f"{path}: sampling_params.{k}" for k in sampling if k not in structs["SamplingParams"]]
    return bad


def test_the_check_catches_misspelled_fields(sglang_fields):
    assert violations("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}, sglang_fields) == []
    assert violations("/generate", {"input_idz": [1]}, sglang_fields) == ["/generate: input_idz"]
    assert violations("/generate", {"sampling_params": {"seed": 1}}, sglang_fields) == [
        "/generate: sampling_params.seed"]
    assert violations("/pause_generation", {"mode": "abort", "modes": 1}, sglang_fields) == [
        "/pause_generation: modes"]


def test_server_accepts_only_sglang_fields(sglang_fields):
    accepted = {
        "/generate": proto.GENERATE_FIELDS,
        "/pause_generation": proto.PAUSE_FIELDS,
        "/continue_generation": proto.CONTINUE_FIELDS,
        "/begin_weight_update": proto.BEGIN_UPDATE_FIELDS,
        "/end_weight_update": proto.END_UPDATE_FIELDS,
        "/init_weights_update_group": proto.INIT_GROUP_FIELDS,
        "/destroy_weights_update_group": proto.DESTROY_GROUP_FIELDS,
        "/update_weights_from_distributed": proto.UPDATE_DISTRIBUTED_FIELDS,
        "/update_weights_from_disk": proto.UPDATE_DISK_FIELDS,
    }
    for path, fields in accepted.items():
        assert violations(path, dict.fromkeys(fields), sglang_fields) == []
    assert set(proto.SAMPLING_FIELDS) <= sglang_fields["SamplingParams"]


class RecordingEngine(SGLangEngine):
    """An SGLangEngine whose HTTP session records (method, path, JSON body) of every request it sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[str, str, dict | None]] = []

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None and not self._closed:
            trace = aiohttp.TraceConfig()

            async def start(session, ctx, params):
                ctx.request, ctx.chunks = (params.method, params.url.path), []

            async def chunk(session, ctx, params):
                ctx.chunks.append(params.chunk)

            async def end(session, ctx, params):
                raw = b"".join(ctx.chunks)
                self.sent.append((*ctx.request, json.loads(raw) if raw else None))

            trace.on_request_start.append(start)
            trace.on_request_chunk_sent.append(chunk)
            trace.on_request_end.append(end)
            trace.on_request_exception.append(end)
            self._session = aiohttp.ClientSession(trace_configs=[trace])
        return super()._http()


async def _exercise(url: str, model: ModelConfig, tmp_path: Path) -> list[tuple[str, str, dict | None]]:
    """Every call the client makes: generation, pauses, flush, both weight-update paths, shutdown."""
    from safetensors.torch import save_file

    weights = {n: p.detach() + 0.01 for n, p in load_model(model).named_parameters()}
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "model.safetensors")
    client = RecordingEngine(url)
    try:
        await client.connect(timeout_s=30)
        request = GenerationRequest("fields", (1, 5, 6), SamplingParams(
            max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=5, seed=1, stop_token_ids=(2,), ignore_eos=True))
        await client.generate(request)
        _ = [o async for o in client.stream(request)]
        for mode in ("abort", "retract", "in_place"):
            await client.pause(mode)
            await client.resume()
        await client.flush_cache()
        version = await client.get_weight_version()
        await paused_update(client, lambda: client.load_weights(weights.items(), version + 1), "abort")
        await paused_update(client, lambda: client.update_weights_from_disk(str(tmp_path), version + 2))
    finally:
        await client.shutdown()
    return client.sent


def test_client_sends_only_sglang_fields(sglang_fields, tmp_path):
    model = ModelConfig(path="tiny")
    launcher = SGLangLauncher("torch", model, max_batch_slots=4, startup_timeout_s=90)

    async def main():
        try:
            await launcher.start()
            return await asyncio.wait_for(_exercise(launcher.url, model, tmp_path), 90)
        finally:
            await launcher.stop()

    sent = asyncio.run(main())
    posted = {path for method, path, _ in sent if method == "POST"}
    assert posted == set(ENDPOINT_STRUCTS), f"the exercise no longer covers {set(ENDPOINT_STRUCTS) - posted}"
    assert {path for method, path, _ in sent if method == "GET"} == GET_ENDPOINTS
    bad = [v for method, path, body in sent if method == "POST" for v in violations(path, body, sglang_fields)]
    assert bad == [], f"fields SGLang does not define: {bad}"
    assert any(body and body.get("sampling_params", {}).get("sampling_seed") == 1 for _, _, body in sent)
