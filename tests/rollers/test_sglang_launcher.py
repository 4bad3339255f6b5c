"""The launcher: command lines, start/health/stop of a real server process, failures, connect-to-URL."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.models import ModelConfig
from rollers import sglang_launcher
from rollers.config import RollersConfig
from rollers.engine import EngineError, GenerationRequest, SamplingParams
from rollers.sglang_engine import SGLangEngine
from rollers.sglang_launcher import SGLangLauncher, launch_sglang_engine
from tests.rollers.engine_helpers import TIMEOUT_S, run


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def _pretend_sglang_installed(monkeypatch, installed: bool):
    real = sglang_launcher.importlib.util.find_spec
    monkeypatch.setattr(sglang_launcher.importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "sglang" else real(name, *a))


def test_sglang_command_has_the_flags_a_roller_needs(monkeypatch, tmp_path):
    _pretend_sglang_installed(monkeypatch, True)
    model = ModelConfig(path=str(tmp_path), dtype="bfloat16")
    cmd = SGLangLauncher("sglang", model, mem_fraction=0.45, weight_version=3).command()
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert _flag(cmd, "--model-path") == str(tmp_path) and _flag(cmd, "--host") == "127.0.0.1"
    assert _flag(cmd, "--mem-fraction-static") == "0.45" and _flag(cmd, "--weight-version") == "3"
    assert _flag(cmd, "--dtype") == "bfloat16" and int(_flag(cmd, "--port")) > 0
    assert "--enable-memory-saver" not in cmd and "--skip-tokenizer-init" in cmd and "--enable-metrics" in cmd
    colocated = SGLangLauncher("sglang", model, colocated=True).command()
    assert "--enable-memory-saver" in colocated


def test_sglang_kind_needs_sglang_and_a_model_directory(monkeypatch, tmp_path):
    _pretend_sglang_installed(monkeypatch, False)
    with pytest.raises(EngineError, match="needs SGLang"):
        SGLangLauncher("sglang", ModelConfig(path=str(tmp_path))).command()
    _pretend_sglang_installed(monkeypatch, True)
    with pytest.raises(ValueError, match="sglang_launch=torch"):
        SGLangLauncher("sglang", ModelConfig(path="tiny")).command()
    with pytest.raises(ValueError, match="server kind"):
        SGLangLauncher("vllm", ModelConfig(path="tiny"))


def test_torch_command_serves_our_engine_on_loopback():
    launcher = SGLangLauncher("torch", ModelConfig(path="tiny"), port=31234, max_batch_slots=3, num_threads=2)
    cmd = launcher.command()
    assert cmd[:3] == [sys.executable, "-m", "rollers.sglang_server"]
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "31234"
    assert _flag(cmd, "--max-batch-slots") == "3" and _flag(cmd, "--num-threads") == "2"
    assert launcher.url == "http://127.0.0.1:31234"


def test_a_server_that_fails_to_start_raises_with_its_log():
    launcher = SGLangLauncher("torch", ModelConfig(path="tiny"), startup_timeout_s=60, extra_args=("--no-such-flag",))
    with pytest.raises(EngineError, match="unrecognized arguments: --no-such-flag"):
        run(launcher.start())
    assert launcher._proc is None


def test_stop_kills_a_server_that_ignores_sigterm():
    launcher = SGLangLauncher("torch", ModelConfig(path="tiny"))
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"up"  # the handler is installed
    launcher._proc = proc
    run(launcher.stop(grace_s=0.5))
    assert proc.poll() is not None and proc.returncode < 0
    run(launcher.stop())  # idempotent


def test_launch_engine_launches_serves_and_stops_and_connects_to_a_url():
    model = ModelConfig(path="tiny")
    cfg = RollersConfig(engine="sglang", sglang_launch="torch", max_batch_slots=2, sglang_startup_timeout_s=TIMEOUT_S)
    request = GenerationRequest("launch", (1, 5, 6), SamplingParams(max_new_tokens=3, ignore_eos=True, seed=0))

    async def main():
        engine = await launch_sglang_engine(cfg, model, weight_version=4)
        try:
            assert engine.weight_version == 4
            out = await engine.generate(request)
            by_url = await launch_sglang_engine(RollersConfig(engine="sglang", sglang_url=engine.url), model)
            assert (await by_url.generate(request)).output_ids == out.output_ids
            await by_url.shutdown()  # a connected engine leaves the server running
            assert await engine.health()
        finally:
            await engine.shutdown()  # a launched engine stops its server
        probe = SGLangEngine(engine.url, control_timeout_s=2)
        try:
            return out, await probe.health()
        finally:
            await probe.shutdown()

    out, healthy_after = run(main())
    assert out.finish_reason == "length" and out.weight_versions == [4, 4, 4]
    assert not healthy_after


def test_config_validates_sglang_fields():
    with pytest.raises(ValueError, match="rollers.sglang_launch"):
        RollersConfig(sglang_launch="vllm")
    with pytest.raises(ValueError, match="rollers.sglang_mem_fraction"):
        RollersConfig(sglang_mem_fraction=0)
    with pytest.raises(ValueError, match="rollers.sglang_url"):
        RollersConfig(sglang_url="127.0.0.1:30000")
    with pytest.raises(ValueError, match="rollers.sglang_max_retries"):
        RollersConfig(sglang_max_retries=-1)
