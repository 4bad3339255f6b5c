"""Broadcast (gloo) to our SGLang-API server in its own process, through SGLang's own HTTP protocol:
``/init_weights_update_group`` + ``/update_weights_from_distributed``; then the server's greedy decode
equals the trainer's, and a refused update names the server and keeps its version. Then the disk path
(safetensors files + ``/update_weights_from_disk``)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest
import torch

from checkpointengine import WeightSyncError
from checkpointengine.config import CheckpointEngineConfig
from common.models import ModelConfig, load_model
from rollers.engine import GenerationRequest, SamplingParams
from rollers.sglang_engine import SGLangEngine
from tests.checkpointengine.ce_procs import greedy_ids
from tests.checkpointengine.sglang_pusher import SGLangWeightPusher


def _start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "rollers.sglang_server", "--model", "tiny", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        match = re.search(r"SGLANG_SERVER_READY port=(\d+)", line)
        if match:
            return proc, f"http://127.0.0.1:{match.group(1)}"
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines[-20:]))


@pytest.mark.slow
def test_broadcast_and_disk_to_sglang_api_server(tmp_path):
    proc, url = _start_server()
    try:
        trainer = load_model(ModelConfig(path="tiny"))
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
        cfg = CheckpointEngineConfig(backend="broadcast", timeout_s=30.0, group_backend="gloo",
                                     disk_dir=str(tmp_path), bucket_bytes=64 * 1024)

        async def main():
            client = SGLangEngine(url)
            async with SGLangWeightPusher(cfg, [url]) as pusher:
                report = await pusher.push(trainer.named_parameters(), 1)
                assert report.acked == [url] and report.num_bytes > 0
                assert await client.get_weight_version() == 1
                prompt = (1, 16, 20, 30)
                req = GenerationRequest("q", prompt, SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                    ignore_eos=True))
                out = await client.generate(req)
                assert out.output_ids == greedy_ids(trainer, prompt, 10)
                assert set(out.weight_versions) == {1}
                # A tensor the server does not know: it refuses, names why, keeps version 1.
                with pytest.raises(WeightSyncError, match=re.escape(url) + ".*nope"):
                    await pusher.push([("model.nope", torch.ones(3))], 2)
                assert await client.get_weight_version() == 1
                report = await pusher.push(trainer.named_parameters(), 2)  # the group is re-formed
                assert report.acked == [url] and await client.get_weight_version() == 2
                # The disk path: safetensors files + /update_weights_from_disk.
                with torch.no_grad():
                    trainer.model.norm.weight.mul_(-1.0)
                report = await pusher.push_via_disk(trainer.named_parameters(), 3)
                assert report.acked == [url] and await client.get_weight_version() == 3
                out = await client.generate(req)
                assert out.output_ids == greedy_ids(trainer, prompt, 10) and set(out.weight_versions) == {3}
                assert (tmp_path / "v00000003" / "model.safetensors.index.json").is_file()
            await client.shutdown()

        asyncio.run(main())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
