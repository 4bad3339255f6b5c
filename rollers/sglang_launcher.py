"""Start (or connect to) the SGLang-API server a roller's ``SGLangEngine`` talks to.

Two kinds of server, one client: ``sglang`` runs ``python -m sglang.launch_server`` (GPUs; SGLang must
be installed), ``torch`` runs ``python -m rollers.sglang_server`` (our torch engine behind SGLang's API,
any machine). Either is bound to 127.0.0.1 on a free port, watched until ``/health`` answers, and
stopped (SIGTERM to its own process group, SIGKILL after a grace period) on ``stop``; its output goes
to a log file whose tail is quoted when it fails to start. With ``rollers.sglang_url`` set nothing is
launched: the engine connects to that URL.

``launch_sglang_engine(rollers_cfg, model_cfg)`` is what a roller calls for ``rollers.engine=sglang``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.env import cache_dir, resolve_num_threads
from common.models import ModelConfig, resolve_model_dir
from rollers.config import SGLANG_LAUNCH, RollersConfig
from rollers.engine import EngineError
from rollers.sglang_engine import SGLangEngine, free_port

logger = logging.getLogger(__name__)


class SGLangLauncher:
    """One server process. ``kind``: ``sglang`` | ``torch``; ``model``: the model to serve;
    ``mem_fraction``: SGLang's ``--mem-fraction-static``; ``colocated``: add ``--enable-memory-saver``
    (the trainer shares the GPU); ``weight_version``: the initial version (int; SGLang gets it as
    ``--weight-version``); ``startup_timeout_s``: wait for ``/health``; ``num_threads``/
    ``max_batch_slots``: the torch server's threads and batch slots; ``extra_args``: appended verbatim."""

    def __init__(
        self, kind: str, model: ModelConfig, *, host: str = "127.0.0.1", port: int = 0, mem_fraction: float = 0.7,
        colocated: bool = False, weight_version: int = 0, seed: int = 0, startup_timeout_s: float = 600.0,
        num_threads: int = 1, max_batch_slots: int = 16, extra_args: tuple[str, ...] = (),
        log_path: str | Path | None = None,
    ):
        if kind not in SGLANG_LAUNCH:
            raise ValueError(f"server kind {kind!r} is not one of {list(SGLANG_LAUNCH)}")
        self.kind, self.model, self.host = kind, model, host
        self.port = port or free_port(host)
        self.mem_fraction, self.colocated, self.weight_version, self.seed = mem_fraction, colocated, weight_version, seed
        self.startup_timeout_s, self.num_threads, self.max_batch_slots = startup_timeout_s, num_threads, max_batch_slots
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path else cache_dir() / "logs" / f"{kind}-server-{os.getpid()}-{self.port}.log"
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line. Raises EngineError when SGLang is needed but not installed, and
        ValueError for the in-memory ``tiny`` model, which real SGLang cannot load."""
        if self.kind == "torch":
            return [sys.executable, "-m", "rollers.sglang_server", "--model", self.model.path,
                    "--dtype", self.model.dtype, "--host", self.host, "--port", str(self.port),
                    "--max-batch-slots", str(self.max_batch_slots), "--num-threads", str(self.num_threads),
                    "--weight-version", str(self.weight_version), "--seed", str(self.seed), *self.extra_args]
        if importlib.util.find_spec("sglang") is None:
            raise EngineError(
                "rollers.sglang_launch=sglang needs SGLang: pip install 'sglang>=0.5,<0.6' (CUDA), or set "
                "rollers.sglang_url to a running server, or rollers.sglang_launch=torch"
            )
        model_dir = resolve_model_dir(self.model)
        if model_dir is None:
            raise ValueError(f"model.path={self.model.path!r} has no directory for SGLang to load; "
                             "use rollers.sglang_launch=torch")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
               "--host", self.host, "--port", str(self.port), "--mem-fraction-static", str(self.mem_fraction),
               "--dtype", self.model.dtype, "--tp-size", "1", "--random-seed", str(self.seed),
               "--weight-version", str(self.weight_version), "--skip-tokenizer-init", "--log-level", "warning",
               "--enable-metrics"]  # /metrics: listed in the job's Prometheus targets (controller.prometheus_sd)
        if self.colocated:
            cmd.append("--enable-memory-saver")
        return [*cmd, *self.extra_args]

    async def start(self) -> str:
        """Launch and wait for ``/health`` (at most ``startup_timeout_s``); returns the URL. Raises
        EngineError (with the log's tail) when the process exits or does not get healthy in time."""
        if self._proc is not None:
            raise EngineError(f"{self.kind} server already started at {self.url}")
        cmd = self.command()
        logger.info("launching %s server: %s (log %s)", self.kind, " ".join(cmd), self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env=os.environ.copy())
        probe = SGLangEngine(self.url, control_timeout_s=5.0)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while not await probe.health():
                if self._proc.poll() is not None:
                    raise EngineError(f"{self.kind} server exited with code {self._proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.kind} server not healthy after {self.startup_timeout_s} s:\n{self.log_tail()}")
                await asyncio.sleep(0.25)
        except BaseException:
            await probe.shutdown()
            await self.stop()
            raise
        await probe.shutdown()
        return self.url

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-num_bytes:].decode(errors="replace")

    async def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL after ``grace_s``; waits for it. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            await asyncio.to_thread(proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s server pid %d ignored SIGTERM for %.0f s: killing it", self.kind, proc.pid, grace_s)
            os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait, grace_s)
        except ProcessLookupError:
            pass


async def launch_sglang_engine(rollers: RollersConfig, model: ModelConfig, *, weight_version: int = 0,
                               seed: int = 0) -> SGLangEngine:
    """The ``SGLangEngine`` for ``rollers.engine=sglang``: connected to ``rollers.sglang_url`` when set,
    else to a server launched here (stopped by the engine's ``shutdown``). Raises EngineError when the
    server cannot be launched or reached."""
    timeouts = dict(request_timeout_s=rollers.sglang_request_timeout_s, max_retries=rollers.sglang_max_retries)
    if rollers.sglang_url:
        engine = SGLangEngine(rollers.sglang_url, **timeouts)
    else:
        launcher = SGLangLauncher(
            rollers.sglang_launch, model, mem_fraction=rollers.sglang_mem_fraction,
            colocated=rollers.sglang_colocated, weight_version=weight_version, seed=seed,
            startup_timeout_s=rollers.sglang_startup_timeout_s,
            num_threads=resolve_num_threads(rollers.num_threads),
            max_batch_slots=rollers.max_batch_slots,
        )
        url = await launcher.start()
        engine = SGLangEngine(url, on_shutdown=launcher.stop, **timeouts)
    try:
        await engine.connect(timeout_s=rollers.sglang_startup_timeout_s)
    except BaseException:
        await engine.shutdown()
        raise
    return engine
