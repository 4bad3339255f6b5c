"""The main job: environment, Ray, pools, the chosen schedule, and what the run leaves behind.

Exit codes: 0 after exactly ``trainer.total_steps`` steps (the policy is then written as a Hugging Face
model directory, ``RUN_DIR/model``); 1 when a pool fails (the original error is printed); 2 for a config
or data error found at start (nothing was trained), an existing run directory included; 130 / 143 when
stopped by SIGINT (Ctrl-C) / SIGTERM (one line, no traceback; pools stopped; ``controller/stop.py``).

While it runs, ``RUN_DIR/prometheus_targets.json`` lists its metrics endpoint (and SGLang servers) for
Prometheus' file-based service discovery (``controller.prometheus_sd``); emptied when it ends.

Every run that created its directory leaves ``summary.json`` with the same keys (``report.SUMMARY_KEYS``,
null where unknown) and its ``status``: ``completed``, ``interrupted`` or ``failed``; ``startup_s`` (start
to pools up) with its parts in ``startup_breakdown_s`` (``checks_s``: config and reward checks; ``ray_s``;
``feeder_s``: the prompt feeder's start, the run's one load of the data and its check; then
``controller.runtime.Runtime.startup_s``) and the pools' torch ``threads``
(``controller.resources.plan_threads``); ``shutdown_s`` and ``wall_s`` (start through shutdown) are added
after shutdown.

``hflow-async --resume RUN_DIR [--resume-step N]`` continues a run from its latest job checkpoint (or step
N's; ``controller/job_checkpoint.py``) in the same directory: ``metrics.jsonl`` keeps the rows up to that
step and grows from there, ``weight_version`` continues, the samples buffered at the checkpoint are
trained and the groups in flight re-issued. A changed config key that would break the run's promises is
refused (exit 2, naming the keys); a checkpoint with nothing left to train (``trainer.total_steps``
reached, or the data exhausted with nothing buffered) exits 0 at once.

Start-up prints one line per thing it starts (Ray; the prompt feeder, which loads and checks the data
before the run directory is made, and a line on the data; then each pool: ``Runtime(on_stage=...)``). A
local Ray cluster this job started is shut down with it and its session directory removed, except after a
failed run, whose Ray logs are kept and named.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from controller.config import HFlowConfig, to_dict, to_yaml
from controller.schedules import SCHEDULES
from controller.stop import STOP, close_all, install_handlers, interrupted

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
# A job that started its own Ray cluster leaves without it when stopping the pools and Ray takes longer than
# this: its own processes were stopped too (SIGTERM to every process of the job, as systemd's and Slurm's
# default stops send), so each call to Ray waits on a GCS that no longer answers, until Ray ends the process
# after 60 s with exit 1. A healthy shutdown takes 3-5 s (and one cut short loses nothing: the summary is
# written, the model exported, and the cluster's processes are killed as after a SIGKILL).
SHUTDOWN_DEADLINE_S = 10.0
GAUGE_PERIOD_S = 2.0
MODEL_DIR = "model"  # RUN_DIR/model: the trained policy as a Hugging Face model directory


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


async def _run_schedule(cfg: HFlowConfig, rt, metrics, report, counts: dict, resume_from: Path | None = None) -> None:
    """Run the schedule of ``cfg.mode`` (after restoring the job checkpoint ``resume_from``); fills ``counts``
    with the run's counters however it ends (a stop signal cancels this task: see ``controller.stop``; a job
    checkpoint is written then, and at the end)."""
    from controller.admin import AdminServer
    from controller.report import group_reward_stats
    from controller.stages import Stages
    from controller.trainer_restart import run_with_restarts

    STOP.attach(asyncio.current_task())
    stages = Stages(cfg, rt, metrics, report)
    gauges = asyncio.ensure_future(_gauges(stages))
    stages.keeper.start()
    admin = AdminServer(stages.keeper, Path(cfg.run_dir))
    restored = resume_from is None
    try:
        port = await admin.start()
        print(f"hflow-async: admin endpoint at http://127.0.0.1:{port} (hflow-async scale --rollers N "
              f"--run-dir {cfg.run_dir})", flush=True)
        if resume_from is not None:
            await stages.checkpointer.restore(stages, resume_from)
            restored = True
        # the version the rollers hold, before the first step (val.before_train; on resume: if it is due)
        await stages.validator.maybe_start(stages.ledger.synced_weight_version)
        # a dead TransferQueue server ends it (ServerLost); a lost trainer rank restarts the trainer alone
        await rt.watch(run_with_restarts(stages, counts))
        await stages.validator.wait()  # the round of the last version
        await stages.checkpointer.save(stages, "end of the run")
        await stages.refresh_gauges()
        try:
            await stages.write_timeline()
        except Exception as exc:  # noqa: BLE001 - a benchmark aid must never fail a run that completed
            logger.warning("could not write timeline.json: %s", exc)
    except asyncio.CancelledError:
        if STOP.signum is not None and restored and stages.ledger.step > 0:
            _save_on_stop(stages)
        raise
    finally:
        gauges.cancel()
        ledger = stages.ledger
        counts.update({
            "num_syncs": ledger.num_syncs,
            "num_groups_admitted": ledger.num_started,
            "num_groups_generated": stages.num_groups_generated,  # as of the last gauge refresh
            **ledger.counts(),  # num_failed_groups, num_dropped_groups, num_zero_variance_groups, num_reissued_groups
            "weight_version": ledger.weight_version,
            "num_rollers_lost": stages.keeper.num_lost,
            "num_roller_restarts": stages.keeper.num_restarts,
            "roller_joins": stages.keeper.joins,  # the same list: keeper.stop() below completes its last rows
            **group_reward_stats(stages.rewards_by_uid),
        })
        STOP.attach(None)
        # Last: a stop signal re-cancels this task each second, and an await here may take that cancellation:
        # every closer still runs, and the cancellation is raised after them.
        await close_all(stages.validator.close(), asyncio.gather(gauges, return_exceptions=True),
                         stages.keeper.stop(), admin.close())


def _save_on_stop(stages) -> None:
    """A job checkpoint once a stop signal has unwound every stage (blocking: no stage runs meanwhile)."""
    try:
        stages.checkpointer.save_now(stages, f"stopped by {signal.Signals(STOP.signum).name}")
    except Exception as exc:  # noqa: BLE001 - the previous checkpoint stays whole; the stop goes on
        print(f"hflow-async: could not write a job checkpoint at the stop: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)


def _start_feeder(cfg: HFlowConfig, context_length: int):
    """Start the prompt feeder (``controller.runtime.start_feeder``): the run's one load of the data, checked
    there; returns the actor. A data error is a StartError (see ``check_config``)."""
    from controller.runtime import start_feeder

    print(f"hflow-async: starting the prompt feeder (task {cfg.data.task}): loading and checking the data",
          flush=True)
    try:
        feeder, facts = start_feeder(cfg, num_batches(cfg), context_length)
    except ValueError as exc:
        raise StartError(str(exc)) from exc
    held_out = ""
    if facts.num_val_prompts and facts.num_val_seen:
        held_out = (f", {facts.num_val_prompts} for validation, {facts.num_val_seen} of them also trained on "
                    "(data.val_disjoint=false: not held out)")
    elif facts.num_val_prompts:
        held_out = (f", {facts.num_val_prompts} held out for validation (no training prompt's text; "
                    f"{facts.num_val_skipped} rows passed over that had one)")
    print(f"hflow-async: data: {facts.num_prompts} training prompts{held_out}, the longest "
          f"{facts.max_prompt_tokens} tokens; {facts.num_available_steps} steps available for "
          f"trainer.total_steps={cfg.trainer.total_steps}", flush=True)
    return feeder


def _start_runtime(cfg: HFlowConfig, feeder):
    """Start every pool around ``feeder`` (``controller.runtime.Runtime``, which owns it from here on); a
    ValueError raised in a pool, or by the controller's own set-up of them (e.g. ``transferqueue.max_samples``
    below what the run needs, on a config changed since its checks), is a StartError."""
    import ray

    from controller.runtime import Runtime

    try:
        return Runtime(cfg, feeder, on_stage=lambda what: print(f"hflow-async: {what}", flush=True))
    except ray.exceptions.RayTaskError as err:
        cause = _unwrap(err)
        if isinstance(cause, ValueError):
            raise StartError(str(cause)) from cause
        raise cause from None
    except ValueError as exc:  # Runtime closed what it had started
        raise StartError(str(exc)) from exc


def _add_sglang_targets(targets, cfg: HFlowConfig, rt) -> None:
    """Add the SGLang servers' /metrics of ``rt``'s rollers to the scrape ``targets`` (when there are any)."""
    import ray

    if targets is not None and cfg.rollers.engine == "sglang":
        members = rt.pool.live()
        urls = ray.get([m.actor.metrics_url.remote() for m in members])
        targets.update(sglang={m.name: u for m, u in zip(members, urls, strict=True) if u})


def _prepare_resume(cfg: HFlowConfig, step: int | None):
    """``job_checkpoint.prepare_resume`` with its ValueError as a StartError."""
    from controller.job_checkpoint import prepare_resume

    try:
        return prepare_resume(cfg, step, Path(cfg.run_dir) / MODEL_DIR)
    except ValueError as exc:
        raise StartError(str(exc)) from exc


def num_batches(cfg: HFlowConfig) -> int:
    """Prompt batches (of ``data.train_batch_size``) the run consumes."""
    return cfg.trainer.total_steps * SCHEDULES.get(cfg.mode).batches_per_step(cfg.algorithm)


def user_module_dirs(cfg: HFlowConfig) -> list[str]:
    """Where a user's ``rollout.reward=module:function`` is imported from, besides the installed packages:
    the current directory and the directory of a ``data.task`` file."""
    dirs = [os.getcwd()]
    task = Path(cfg.data.task)
    if task.suffix == ".jsonl" and task.parent != Path():
        dirs.append(str(task.resolve().parent))
    return dirs


def make_user_modules_importable(cfg: HFlowConfig) -> None:
    """Put ``user_module_dirs`` on this process's ``sys.path`` and on ``PYTHONPATH``, which the Ray workers
    of a local cluster inherit (call before the cluster starts)."""
    dirs = [d for d in user_module_dirs(cfg) if d not in sys.path]
    sys.path[:0] = dirs
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([*dirs, *([old] if old else [])])


def check_config(cfg: HFlowConfig) -> int:
    """The start checks that need no data: ``metrics`` trackers, ``rollout.top_k`` against the model's
    vocabulary (its config only, no weights) and ``rollout.reward`` (loaded as the rollers will); returns the
    model's context length (tokens), against which the prompt feeder checks the data (``_start_feeder``:
    the dataset size against ``data.train_batch_size``, ``data.epochs`` and ``trainer.total_steps``; a row
    too long, or leaving no room for a response). Raises StartError naming the key and why."""
    from common.models import load_hf_config
    from controller.tasks import resolve_reward
    from controller.trackers import check_trackers
    from rollers.model_limits import context_length
    from rollers.rewards import build_reward_fn

    try:
        check_trackers(cfg.metrics)
        hf_config = load_hf_config(cfg.model)
        cfg.rollout.check_model(int(hf_config.vocab_size))
        build_reward_fn(resolve_reward(cfg.rollout.reward, cfg.data.task))
    except ValueError as exc:
        raise StartError(str(exc)) from exc
    return context_length(hf_config)


def check_run_dir(run_dir: Path) -> None:
    """Refuse a ``run_dir`` that is a file or already holds anything (a second run would mix its
    ``metrics.jsonl`` with the first's and replace the rest): StartError naming the choices."""
    if run_dir.exists() and not run_dir.is_dir():
        raise StartError(f"run_dir={str(run_dir)!r} exists and is not a directory")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        held = sorted(p.name for p in run_dir.iterdir())
        raise StartError(
            f"run_dir={str(run_dir)!r} already holds a run ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); "
            "name a new directory (run_dir=runs/NAME, or no run_dir for runs/<timestamp>) or remove the old "
            "one (or continue it: hflow-async --resume RUN_DIR)")


def _failed(summary: dict, exc: BaseException) -> int:
    """Print the original error of a failed run and note it in ``summary``; EXIT_FAILED."""
    cause = _unwrap(exc)
    print(f"hflow-async: run failed: {type(cause).__name__}: {cause}", file=sys.stderr)
    logger.debug("failure", exc_info=True)
    summary.update(status="failed", error=f"{type(cause).__name__}: {cause}")
    return EXIT_FAILED


def _open_report(cfg: HFlowConfig, run_dir: Path, kept_rows: list[dict]):
    """The run's ``controller.report.RunReport`` (with its trackers), holding the ``metrics.jsonl`` rows
    kept from before a resume or a restart (``kept_rows``; empty for a new run)."""
    from controller.report import RunReport
    from controller.trackers import Trackers

    report = RunReport(run_dir, cfg.trainer.total_steps, progress=cfg.metrics.progress,
                       trackers=Trackers(cfg.metrics, run_dir, to_dict(cfg)))
    report.restore(kept_rows)
    return report


def _write_summary(report, summary: dict) -> None:
    try:
        report.finish(summary)
    except Exception:  # noqa: BLE001 - never mask the run's own outcome
        logger.warning("could not write the summary of the %s run", summary["status"], exc_info=True)
    finally:
        report.close()


def _complete_summary(report, **keys) -> None:
    """Add ``keys`` (known only after shutdown) to the written summary, then print it in one line."""
    try:
        report.amend(**keys)
        report.announce()
    except Exception:  # noqa: BLE001 - never mask the run's own outcome
        logger.warning("could not add %s to the summary", sorted(keys), exc_info=True)


def _scrape_targets(cfg: HFlowConfig, run_dir: Path, port: int):
    """Write the job's Prometheus file_sd targets (``controller.prometheus_sd``): its metrics endpoint,
    labelled with the run's name and mode; the ``TargetsFile`` (SGLang servers are added once rollers run)."""
    from controller.prometheus_sd import TargetsFile, scrape_address

    targets = TargetsFile(run_dir, cfg.metrics.sd_dir, {"run": run_dir.resolve().name, "mode": cfg.mode})
    targets.update(controller=scrape_address(cfg.metrics.host, port))
    return targets


def _start_ray(cfg: HFlowConfig, owns_ray: bool) -> Path | None:
    """Start (or join) the Ray cluster of ``cfg.ray``; the session directory to remove at shutdown when
    this job started a local cluster (None when it joined one, or runs inside a caller's). Raises
    StartError when ``ray.address`` does not answer."""
    from common.env import RayConnectError, init_ray, ray_session_dir

    local = owns_ray and not cfg.ray.address
    print(f"hflow-async: {'starting a local Ray cluster' if local else 'joining the Ray cluster'}"
          f"{'' if local or not cfg.ray.address else ' at ' + cfg.ray.address}", flush=True)
    try:
        init_ray(cfg.ray.address or None, cfg.ray.num_cpus or None, cfg.ray.object_store_bytes,
                 cfg.ray.connect_timeout_s)
    except RayConnectError as exc:
        raise StartError(str(exc)) from exc
    return ray_session_dir() if local else None


def _shut_down(rt, feeder, metrics, owns_ray: bool, session_dir: Path | None, keep_logs: bool) -> None:
    """Stop the pools (``rt``), a prompt ``feeder`` no ``Runtime`` took yet, the metrics endpoint and (when
    this job started it) Ray; remove the Ray session directory of a cluster this job started, unless
    ``keep_logs`` (a failed run: its logs say why)."""
    import ray

    from common.env import remove_ray_session_dir, shutdown_ray

    if rt is not None:
        rt.close()
    if feeder is not None:
        ray.kill(feeder, no_restart=True)
    metrics.close()
    if owns_ray and ray.is_initialized():
        shutdown_ray()
    if session_dir is not None:
        if keep_logs:
            print(f"hflow-async: Ray's logs of this run are in {session_dir}", file=sys.stderr, flush=True)
        else:
            remove_ray_session_dir(session_dir)


def _shut_down_within(deadline_s: float, *args, **kwargs) -> bool:
    """``_shut_down(*args, **kwargs)`` in a thread of its own; returns False when it has not ended within
    ``deadline_s`` seconds (it goes on meanwhile: the caller leaves with ``os._exit``), and re-raises what it
    raised."""
    raised: list[BaseException] = []

    def shut_down() -> None:
        try:
            _shut_down(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            raised.append(exc)

    thread = threading.Thread(target=shut_down, name="hflow-shutdown", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if raised:
        raise raised[0]
    return not thread.is_alive()


def _leave_without_ray(code: int, session_dir: Path | None) -> None:
    """End this process with ``code`` now, output flushed, after killing the local cluster it started
    (``common.env.kill_local_cluster``) and removing its ``session_dir`` (None: kept): interpreter exit
    would run Ray's exit hook, which waits on the cluster too."""
    from common.env import kill_local_cluster, remove_ray_session_dir

    kill_local_cluster()
    if session_dir is not None:
        remove_ray_session_dir(session_dir)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run_job(cfg: HFlowConfig, resume: bool = False, resume_step: int | None = None) -> int:
    """Run ``cfg`` to completion; returns the process exit code (see the module docstring). ``resume``:
    continue the run in ``cfg.run_dir`` from its job checkpoint of step ``resume_step`` (None: the latest)."""
    from common.env import setup_process_env

    started = time.monotonic()

    # Before ray is imported (Ray reads its bind settings at import); pinned to loopback only for a local
    # cluster: a driver joining ray.address must register at its real address (common.env's docstring).
    setup_process_env(num_threads=1, ray_address=cfg.ray.address)
    import ray

    from controller.job_checkpoint import truncate_metrics
    from controller.metrics import JobMetrics
    from controller.trainer_restart import restart_point
    from trainers.group import TrainerRankLost

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not cfg.run_dir:  # resolved here, not in the config: a saved config starts a new run each time
        cfg.run_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    run_dir = Path(cfg.run_dir)
    metrics = JobMetrics()
    rt = feeder = report = session_dir = targets = None
    failed_run = False  # a pool or the algorithm raised: the Ray logs of a cluster this job started are kept
    summary = {"mode": cfg.mode, "model": cfg.model.path, "task": cfg.data.task}
    owns_ray = not ray.is_initialized()  # tests may run jobs inside their session's cluster
    STOP.reset()
    previous_handlers = install_handlers()
    resume_from, kept_rows = None, []
    try:
        if resume:
            prepared = _prepare_resume(cfg, resume_step)
            if prepared is None:
                return EXIT_OK
            resume_from, _, kept_rows = prepared
        else:
            check_run_dir(run_dir)
        make_user_modules_importable(cfg)
        context_length = check_config(cfg)
        if cfg.metrics.enabled:  # before the run directory exists: a port in use is a start error like the rest
            try:
                port = metrics.serve(cfg.metrics.host, cfg.metrics.port)
            except OSError as exc:
                raise StartError(f"cannot serve metrics on metrics.host={cfg.metrics.host!r} "
                                 f"metrics.port={cfg.metrics.port}: {exc}") from exc
        ray_start = time.monotonic()
        session_dir = _start_ray(cfg, owns_ray)
        install_handlers()  # again: ray.init installs its own SIGTERM handler
        feeder_start = time.monotonic()
        feeder = _start_feeder(cfg, context_length)  # the data's one load, checked: no run directory yet
        t0 = time.monotonic()
        breakdown = {"checks_s": ray_start - started, "ray_s": feeder_start - ray_start, "feeder_s": t0 - feeder_start}
        run_dir.mkdir(parents=True, exist_ok=True)
        report = _open_report(cfg, run_dir, kept_rows)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        if cfg.metrics.enabled:
            (run_dir / "metrics_endpoint.json").write_text(json.dumps({"host": cfg.metrics.host, "port": port}))
            print(f"hflow-async: Prometheus metrics at http://{cfg.metrics.host}:{port}/metrics", flush=True)
            targets = _scrape_targets(cfg, run_dir, port)
        rt, feeder = _start_runtime(cfg, feeder), None  # the runtime owns the feeder from here on
        _add_sglang_targets(targets, cfg, rt)
        summary["startup_s"] = time.monotonic() - started
        summary["startup_breakdown_s"] = breakdown | rt.startup_s
        summary["threads"] = rt.threads.to_dict()
        print("hflow-async: start-up " + ", ".join(f"{k} {v:.1f}" for k, v in summary["startup_breakdown_s"].items()),
              flush=True)
        print(f"hflow-async: pools up in {time.monotonic() - t0:.1f}s ({summary['startup_s']:.1f}s since start); "
              f"mode {cfg.mode}, {cfg.trainer.total_steps} steps, {cfg.model.precision}, old_log_probs "
              f"{'from the rollers (bypass_mode)' if cfg.algorithm.bypass_mode else 'from the trainer'}, "
              f"run dir {run_dir}", flush=True)
        while True:  # restart_point re-raises once trainer.max_restarts are used up
            try:
                asyncio.run(_run_schedule(cfg, rt, metrics, report, summary, resume_from))
                break
            except TrainerRankLost as lost:  # outside the schedule: the trainer cannot restart alone
                resume_from = restart_point(cfg, lost, summary, "the pools")
                rt.close()
                rt = None
                report.close()
                kept_rows = truncate_metrics(run_dir, int(resume_from.name.removeprefix("step_")))
                report = _open_report(cfg, run_dir, kept_rows)
                rt = _start_runtime(cfg, _start_feeder(cfg, context_length))
                _add_sglang_targets(targets, cfg, rt)
        rt.trainer.export_model(str(run_dir / MODEL_DIR))
        summary.update(status="completed", model_dir=str(run_dir / MODEL_DIR))
        print(f"hflow-async: trained model in {run_dir / MODEL_DIR} (a Hugging Face model directory: "
              f"model.path={run_dir / MODEL_DIR} trains on from it)", flush=True)
        code = EXIT_OK
    except StartError as exc:
        print(f"hflow-async: cannot start: {exc}", file=sys.stderr)
        summary.update(status="failed", error=f"cannot start: {exc}")
        code = EXIT_CONFIG
    except KeyboardInterrupt:
        code = interrupted(summary)
    except asyncio.CancelledError as exc:  # the schedule's task, cancelled by a stop signal (else a bug)
        failed_run = STOP.signum is None
        code = _failed(summary, exc) if failed_run else interrupted(summary)
    except BaseException as exc:  # noqa: BLE001 - report the original error, exit non-zero
        failed_run = True
        code = _failed(summary, exc)
    finally:
        STOP.tear_down()  # from here on a stop signal is noted, not raised
        if report is not None:  # this run created its directory: a summary, whatever the outcome
            _write_summary(report, {**summary, "wall_s": time.monotonic() - started, "config": to_dict(cfg)})
        stopping = time.monotonic()
        if targets is not None:
            targets.close()
        # Bounded only where this job started Ray: the deadline ends the process (and a test's in-process
        # job shares the session's cluster).
        if owns_ray:
            shut = _shut_down_within(SHUTDOWN_DEADLINE_S, rt, feeder, metrics, owns_ray, session_dir,
                                     keep_logs=failed_run)
        else:
            _shut_down(rt, feeder, metrics, owns_ray, session_dir, keep_logs=failed_run)
            shut = True
        if report is not None:  # known only now: the summary's shutdown time, and wall time through it
            _complete_summary(report, shutdown_s=time.monotonic() - stopping, wall_s=time.monotonic() - started)
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
    pools = ("pools stopped" if shut else
             f"Ray did not answer within {SHUTDOWN_DEADLINE_S:.0f} s (a stop sent to every process of the job "
             "stops Ray's too), so its pools were killed")
    if summary["status"] == "interrupted":
        done = f"after {len(report.steps)} of {cfg.trainer.total_steps} steps" if report else "during start-up"
        print(f"hflow-async: {summary['error']} {done}; {pools}", file=sys.stderr, flush=True)
    elif not shut:
        print(f"hflow-async: {pools}", file=sys.stderr, flush=True)
    if not shut:
        _leave_without_ray(code, None if failed_run else session_dir)
    return code
