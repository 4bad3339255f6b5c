"""The main job: environment, Ray, pools, the chosen schedule, and what the run leaves behind.

Exit codes: 0 after exactly ``trainer.total_steps`` steps; 1 when a pool fails (the original error is
printed); 2 for a config or data error found at start (nothing was trained).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from controller.config import HFlowConfig, to_dict, to_yaml

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
GAUGE_PERIOD_S = 2.0


class StartError(ValueError):
    """The run cannot start (bad data for the config); nothing was trained."""


def _unwrap(err: BaseException) -> BaseException:
    """The user's own exception inside Ray's wrappers."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


async def _gauges(stages) -> None:
    while True:
        await asyncio.sleep(GAUGE_PERIOD_S)
        try:
            await stages.refresh_gauges()
        except Exception as exc:  # a gauge refresh must never take the run down
            logger.debug("gauge refresh failed: %s", exc)


async def _run_schedule(cfg: HFlowConfig, rt, metrics, report) -> dict:
    from controller.report import group_reward_stats
    from controller.schedules import SCHEDULES, Stages

    stages = Stages(cfg, rt, metrics, report)
    gauges = asyncio.ensure_future(_gauges(stages))
    try:
        await SCHEDULES[cfg.mode](stages)
        await stages.refresh_gauges()
    finally:
        gauges.cancel()
        await asyncio.gather(gauges, return_exceptions=True)
    return {
        "num_syncs": stages.num_syncs,
        "num_groups_admitted": stages.admission.started,
        "num_groups_generated": stages.num_groups_generated,
        "num_failed_groups": stages.num_failed_groups,
        "num_dropped_groups": stages.num_dropped_groups,
        "weight_version": stages.version,
        **group_reward_stats(stages.rewards_by_uid),
    }


def num_batches(cfg: HFlowConfig) -> int:
    """Prompt batches (of ``data.train_batch_size``) the run consumes."""
    return cfg.trainer.total_steps * (cfg.algorithm.require_batches if cfg.mode == "fully-async" else 1)


def check_data(cfg: HFlowConfig) -> int:
    """Load the dataset as the feeder will and check it provides the run's steps and fits the model;
    returns its size. Raises StartError naming the dataset size, ``data.train_batch_size``, ``data.epochs``
    and ``trainer.total_steps``, the offending row (too long, or no room left by the context length), or
    ``rollout.top_k`` beyond the vocabulary, before any pool starts."""
    from common.models import load_hf_config, load_tokenizer
    from controller.data import PromptDataset
    from rollers.model_limits import context_length

    try:
        hf_config = load_hf_config(cfg.model)
        cfg.rollout.check_model(int(hf_config.vocab_size))
        dataset = PromptDataset.from_config(cfg.data, load_tokenizer(cfg.model))
        dataset.check_context(context_length(hf_config))
        dataset.check_total_steps(num_batches(cfg))
    except ValueError as exc:
        raise StartError(str(exc)) from exc
    return len(dataset)


def _stop_on_sigterm():
    """SIGTERM stops the job like Ctrl-C: pools shut down, servers stopped. Main thread only; returns the
    previous handler (None elsewhere)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, interrupt)
    return None


def run_job(cfg: HFlowConfig) -> int:
    """Run ``cfg`` to completion; returns the process exit code (see the module docstring)."""
    import ray

    from common.env import init_ray, setup_process_env
    from controller.metrics import JobMetrics
    from controller.report import RunReport
    from controller.runtime import Runtime

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_process_env(num_threads=1)
    run_dir = Path(cfg.run_dir)
    metrics = JobMetrics()
    rt = None
    owns_ray = not ray.is_initialized()  # tests may run jobs inside their session's cluster
    previous_sigterm = _stop_on_sigterm()
    try:
        check_data(cfg)
        if run_dir.exists() and not run_dir.is_dir():
            raise StartError(f"run_dir={str(run_dir)!r} exists and is not a directory")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        if cfg.metrics.enabled:
            try:
                port = metrics.serve(cfg.metrics.host, cfg.metrics.port)
            except OSError as exc:
                raise StartError(f"cannot serve metrics on metrics.host={cfg.metrics.host!r} "
                                 f"metrics.port={cfg.metrics.port}: {exc}") from exc
            (run_dir / "metrics_endpoint.json").write_text(json.dumps({"host": cfg.metrics.host, "port": port}))
            print(f"hflow-async: Prometheus metrics at http://{cfg.metrics.host}:{port}/metrics", flush=True)
        init_ray(cfg.ray.address or None, cfg.ray.num_cpus or None, cfg.ray.object_store_bytes)
        _stop_on_sigterm()  # again: ray.init installs its own SIGTERM handler
        t0 = time.monotonic()
        try:
            rt = Runtime(cfg, num_batches(cfg))
        except ray.exceptions.RayTaskError as err:
            cause = _unwrap(err)
            if isinstance(cause, ValueError):
                raise StartError(str(cause)) from cause
            raise cause from None
        print(f"hflow-async: pools up in {time.monotonic() - t0:.1f}s; mode {cfg.mode}, "
              f"{cfg.trainer.total_steps} steps, run dir {run_dir}", flush=True)
        report = RunReport(run_dir, cfg.trainer.total_steps, progress=cfg.metrics.progress)
        about = {"mode": cfg.mode, "model": cfg.model.path, "task": cfg.data.task}
        status = "failed"
        try:
            extra = asyncio.run(_run_schedule(cfg, rt, metrics, report))
            status = "completed"
            report.finish({"status": status, **about, **extra, "config": to_dict(cfg)})
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            if status != "completed":  # the steps done so far still get their summary and plot
                try:
                    report.finish({"status": status, **about, "config": to_dict(cfg)})
                except Exception:  # noqa: BLE001 - never mask the run's own error
                    logger.warning("could not write the summary of the %s run", status, exc_info=True)
            report.close()
        return EXIT_OK
    except StartError as exc:
        print(f"hflow-async: cannot start: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("hflow-async: interrupted; pools stopped", file=sys.stderr)
        return EXIT_FAILED
    except BaseException as exc:  # noqa: BLE001 - report the original error, exit non-zero
        cause = _unwrap(exc)
        print(f"hflow-async: run failed: {type(cause).__name__}: {cause}", file=sys.stderr)
        logger.debug("failure", exc_info=True)
        return EXIT_FAILED
    finally:
        if rt is not None:
            rt.close()
        metrics.close()
        if owns_ray and ray.is_initialized():
            ray.shutdown()
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
