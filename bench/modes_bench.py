"""Schedules benchmark: ``sync``, ``one-step-off`` and ``fully-async`` on identical work, each at its best
resource split, on two workloads, against the machine's limit and TRL's ``GRPOTrainer``.

Identical work: every run is ``hflow-async`` (a subprocess, as a user runs it) with the same preset, model,
prompts, seeds (``seed``, ``data.seed``, ``rollout.seed``: per-sample sampling seeds) and number of trained
samples (``--steps`` × B × n); only ``--mode`` and the split differ.

* **workloads**: ``main`` = the main job as recorded (``--preset smollm2-reasoning`` with ``MAIN_WORKLOAD``:
  SmolLM2-135M, chain_sum, 4 prompts × 4 samples, ≤ 32 tokens, natural lengths, no validation); ``longtail`` = the same job with
  ``rollout.forced_response_lengths`` (``--longtail``, default 8:2-8,2:56-64 with ≤ 64 tokens: 80% of the
  samples decode 2-8 tokens, 20% 56-64; EOS ignored, lengths drawn per sample from (seed, uid, index), so
  identical in every mode: forced lengths measure throughput, not learning).
* **splits** (``Split``: roller replicas × torch threads each, trainer threads): each mode runs every split
  of its list once (``--sweep small``) and the best by samples/s is repeated to ``--reps`` runs; ``sync``
  may give each phase every core (its phases alternate), the overlapping modes split the cores.
  ``--sweep none`` uses the first split of each list (what the small sweep picked on this machine);
  ``--split MODE=rRxT-tU`` (repeatable) makes those splits that mode's sweep. ``--reuse-runs`` reads runs
  already completed in ``--out`` instead of repeating them (add a split to a recorded sweep).
* **metrics** per run (``bench/modes_runs.py`` defines them; steady-state window: updates after
  ``--warmup-steps`` up to the last ``--tail-steps``, whose generation falls inside the window too):
  samples/s, trained tokens/s, trainer idle (waiting for data), roller idle, weight-sync share, staleness
  mean/max, wall time; per mode the median of its best split's runs and the spread (min-max).
* **limit_sps** = cores / (core-seconds per trained sample of generation + of training), each measured
  alone, what the machine could do if both kept every core busy (``limit``): generation at full batch
  occupancy (the decode curve measured alone × mean response tokens × the roller's threads, + the
  per-group overhead fitted to the sync runs, on one core); training from the sync runs' update phase (the
  rollers idle) × the trainer's threads; the cheapest split of each.
* **simulator calibration** (``calibration`` in the JSON, per split): the torch engine's decode step by
  batch occupancy (measured alone, ``decode_calibration``), per-sample training and weight-sync seconds
  (medians of that split's runs), per-group overhead (sync runs' generation phase minus the simulated
  decode time). ``python bench/schedule_sim.py validate bench/results/modes_bench.json`` compares.
* **TRL** (``bench/trl_peer.py``): each workload through ``GRPOTrainer`` in ``bench/.envs/trl``, one
  process with every core, as many runs as each mode there (median, spread); on the long tail HF
  ``generate`` is forced to our exact per-sample lengths; ``--no-trl`` skips it (``trl_sps=nan``).

Outputs in ``--out`` (default ``bench/results/``, git-ignored): ``modes_bench.json``, ``modes_bench.md``
(the table), ``modes_bench.png`` (samples/s per mode, and a timeline of trainer/roller busy intervals per
mode), the run directories under ``runs/``, and the last line printed::

    RESULT sync_sps=… one_step_off_sps=… fully_async_sps=… speedup_one_step_off=… speedup_fully_async=…
           longtail_speedup_fully_async=… max_staleness_fully_async=… limit_sps=… trl_sps=… longtail_trl_sps=…
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from modes_report import write_outputs  # noqa: E402
from modes_runs import decode_calibration, read_run  # noqa: E402
from schedule_sim import Costs, Workload, parse_lengths, simulate  # noqa: E402

MODES = ("sync", "one-step-off", "fully-async")
PRESET = "smollm2-reasoning"
# The main workload as recorded (bench/recorded/): the preset before it was tuned to learn (issue 17), without
# validation (held-out rounds would sit inside the measured window); pinned so re-runs stay comparable. Its
# task is chain_sum with two one-digit terms (the preset's until issue 44 widened it to one or two digits).
MAIN_TASK = ("data.task=chain_sum", "data.task_kwargs.min_terms=2", "data.task_kwargs.max_terms=2",
             "data.task_kwargs.min_digits=1", "data.task_kwargs.max_digits=1")
MAIN_WORKLOAD = (*MAIN_TASK, "rollout.n=4", "rollout.max_response_length=32", "trainer.ppo_mini_batch_size=4",
                 "trainer.lr=2e-6", "trainer.val_every=0", "data.val_size=0")
LONGTAIL = "8:2-8,2:56-64"
LONGTAIL_MAX = 64
T0 = time.monotonic()


@dataclass(frozen=True)
class Split:
    """``num_replicas`` rollers × ``roller_threads`` torch threads each; ``trainer_threads`` for the rank."""

    num_replicas: int
    roller_threads: int
    trainer_threads: int

    @property
    def key(self) -> str:
        return f"r{self.num_replicas}x{self.roller_threads}-t{self.trainer_threads}"

    def overrides(self) -> list[str]:
        return [f"rollers.num_replicas={self.num_replicas}", f"rollers.num_threads={self.roller_threads}",
                f"trainer.num_threads={self.trainer_threads}"]


def splits_for(mode: str, cores: int) -> list[Split]:
    """The small sweep of ``mode`` on ``cores`` cores, its usual best first."""
    if mode == "sync":  # the phases alternate: each may take every core
        splits = [Split(1, cores, cores), Split(1, 1, 1), Split(cores, 1, cores)]
    else:  # the phases overlap: split the cores, or the trainer every core with the roller half on top (training
        # scales with cores and CPU decoding hardly does, see bench/recorded/), or both every core; ``auto``'s
        # choice first (controller.resources: split for one-step-off, the trainer every core for fully-async)
        half = max(1, cores // 2)
        split, on_top = Split(1, half, max(1, cores - half)), Split(1, half, cores)
        splits = [*((on_top, split) if mode == "fully-async" else (split, on_top)), Split(1, cores, cores),
                  Split(max(2, cores - 1), 1, 1)]
    return list(dict.fromkeys(splits))


def parse_split(p: argparse.ArgumentParser, item: str) -> tuple[str, Split]:
    """``"one-step-off=r1x2-t2"`` → ``("one-step-off", Split(1, 2, 2))``; a malformed item is a usage error."""
    mode, _, key = item.partition("=")
    m = re.fullmatch(r"r(\d+)x(\d+)-t(\d+)", key)
    if mode not in MODES or not m or min(map(int, m.groups())) < 1:
        p.error(f"--split {item!r}: expected MODE=rRxT-tU with MODE one of {list(MODES)} and R, T, U >= 1")
    return mode, Split(*map(int, m.groups()))


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def workload_overrides(name: str, args) -> list[str]:
    pinned = list(MAIN_WORKLOAD) if args.preset == PRESET else []
    if name == "main":
        return pinned
    buckets = [list(b) for b in parse_lengths(args.longtail)]
    return [*pinned, f"rollout.max_response_length={args.longtail_max}",
            f"rollout.forced_response_lengths={json.dumps(buckets).replace(' ', '')}"]


def check_mode_sets(args, overrides: list[str]) -> None:
    """Load the config with each ``--mode-set`` mode's overrides added to ``overrides`` and ``--set``, so a bad
    one fails before any run does (as a bad ``--set`` does)."""
    from controller.config import load_config

    for mode_overrides in args.mode_set.values():
        load_config(preset=args.preset, overrides=overrides + list(args.set) + mode_overrides)


def run_one(workload: str, mode: str, split: Split, rep: int, args, overrides: list[str] | None = None) -> dict:
    """One ``hflow-async`` run; its steady-state metrics (``read_run``) or ``{"error": ...}``. ``overrides``:
    the workload's config overrides (default ``workload_overrides(workload, args)``)."""
    run_dir = args.out / "runs" / workload / f"{mode}-{split.key}-rep{rep}"
    summary = _completed_summary(run_dir, args.steps) if args.reuse_runs else None
    if summary is not None:
        return reuse_run(run_dir, summary, split, args)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "controller.cli", "--mode", mode, "--preset", args.preset,
           *(workload_overrides(workload, args) if overrides is None else overrides), *split.overrides(), f"trainer.total_steps={args.steps}",
           f"run_dir={run_dir}", "metrics.progress=false", *args.set, *args.mode_set.get(mode, [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log(f"{workload} {mode} {split.key} rep {rep}: running")
    start = time.monotonic()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as out:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=args.run_timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0:
        log(f"  failed ({code}); log: {out.name}")
        return {"error": f"exit {code}", "log": out.name, "split": asdict(split) | {"key": split.key}}
    try:
        res = read_run(run_dir, args.warmup_steps, args.tail_steps)
    except (OSError, ValueError, KeyError) as exc:
        log(f"  unreadable: {exc}")
        return {"error": f"unreadable run: {exc}", "log": out.name, "split": asdict(split) | {"key": split.key}}
    res["split"] = asdict(split) | {"key": split.key}
    res["process_s"] = time.monotonic() - start
    log(f"  {res['samples_per_s']:.3f} samples/s (window {res['window_s']:.0f} s, process {res['process_s']:.0f} s)")
    return res


def _completed_summary(run_dir: Path, num_steps: int) -> dict | None:
    """``run_dir``'s ``summary.json`` when that run completed ``num_steps`` steps, else None."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("status") == "completed" and summary.get("num_steps") == num_steps else None


def reuse_run(run_dir: Path, summary: dict, split: Split, args) -> dict:
    """A completed run's metrics, read again (``--reuse-runs``); ``process_s`` is the job's own ``wall_s``."""
    res = read_run(run_dir, args.warmup_steps, args.tail_steps)
    res["split"] = asdict(split) | {"key": split.key}
    res["process_s"] = summary["wall_s"]
    res["reused"] = True
    log(f"{run_dir.parent.name} {run_dir.name}: reused, {res['samples_per_s']:.3f} samples/s")
    return res


def summarize(runs: list[dict]) -> dict:
    """Median (and min-max spread) over the repeated runs of one mode's best split."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "no run"}
    keys = ("samples_per_s", "tokens_per_s", "trainer_idle_share", "roller_idle_share", "sync_share",
            "staleness_mean", "window_s", "wall_s")
    out = {k: statistics.median(r[k] for r in ok) for k in keys}
    out["spread_sps"] = [min(r["samples_per_s"] for r in ok), max(r["samples_per_s"] for r in ok)]
    out["staleness_max"] = max(r["staleness_max"] for r in ok)
    out["num_runs"], out["split"] = len(ok), ok[0]["split"]
    out["num_steps"], out["warmup_steps"], out["tail_steps"] = ok[0]["num_steps"], ok[0]["warmup_steps"], ok[0]["tail_steps"]
    out["num_samples"] = ok[0]["num_samples"]
    return out


def candidate_splits(mode: str, args, cores: int) -> list[Split]:
    """The splits ``mode`` runs first: ``--split``'s for it, else its small sweep (``--sweep none``: its first)."""
    return args.split.get(mode) or splits_for(mode, cores)[: 1 if args.sweep == "none" else None]


def bench_workload(name: str, args, cores: int, overrides: list[str] | None = None) -> dict:
    """Sweep and repeat every mode on one workload (``overrides``: as ``run_one``); returns
    ``{"best": {mode: summary}, "runs": [...]}``."""
    all_runs, best = [], {}
    for mode in (args.longtail_modes if name == "longtail" else args.modes):
        swept = [(s, run_one(name, mode, s, 0, args, overrides)) for s in candidate_splits(mode, args, cores)]
        all_runs += [dict(r, mode=mode) for _, r in swept]
        good = [(s, r) for s, r in swept if "error" not in r]
        if not good:
            best[mode] = {"error": swept[0][1]["error"]}
            continue
        split, first = max(good, key=lambda sr: sr[1]["samples_per_s"])
        num_reps = args.longtail_reps if name == "longtail" else args.reps
        reps = [first] + [run_one(name, mode, split, i, args, overrides) for i in range(1, num_reps)]
        all_runs += [dict(r, mode=mode) for r in reps[1:]]
        best[mode] = summarize(reps)
    return {"best": best, "runs": all_runs}


def mean_tokens(spec: dict) -> float:
    """Mean response tokens per sample of a ``sim_workload`` spec (observed lengths, or buckets' midpoints)."""
    if spec["empirical"]:
        return statistics.fmean(spec["lengths"])
    return sum(w * (lo + hi) / 2 for w, lo, hi in spec["lengths"]) / sum(w for w, _, _ in spec["lengths"])


def limit(name: str, wl: dict, calibration: dict, cores: int) -> dict:
    """``limit_sps`` of workload ``name`` (see the module docstring); nan without a sync run.

    Generation, core-seconds per sample: a roller's threads × the decode step at full occupancy ÷ the batch
    slots × mean response tokens, the decode curve measured alone (``calibrate``), the cheapest thread count;
    plus the per-group overhead ÷ n on one core: the overhead (prefill, scoring, data plane: what the sync
    runs' generation phase takes beyond the simulated decode) is mostly serial Python, and counting it at
    the roller's threads once put a measured ``fully-async`` run above the limit (109% on the long tail).
    Full occupancy, not the sync runs' generation phase, which on a long tail holds batch slots idle while
    its longest responses finish. Training: the sync runs' update phase (the rollers idle) × the trainer's
    threads, per sample; the cheapest split."""
    splits = {r["split"]["key"]: r["split"] for r in wl["runs"] if "error" not in r}
    sync_keys = sorted({r["split"]["key"] for r in wl["runs"] if "error" not in r and r["mode"] == "sync"})
    costs = {key.split("/", 1)[1]: c for key, c in calibration.items() if key.startswith(f"{name}/")}
    if not sync_keys or not costs:
        return {"limit_sps": math.nan}
    spec = wl["sim_workload"]
    tokens = mean_tokens(spec)
    decode = min(splits[k]["roller_threads"] * (c["decode_base_s"] / c["max_batch_slots"] + c["decode_per_seq_s"])
                 for k, c in costs.items())
    overhead = min(costs[k]["group_overhead_s"] / spec["n"] for k in sync_keys if k in costs)
    train = min(statistics.median(r["update_s"]) / r["samples_per_step"] * min(cores, r["split"]["trainer_threads"])
                for r in wl["runs"] if "error" not in r and r["mode"] == "sync" and r["update_s"])
    cs_gen = decode * tokens + overhead
    return {"limit_sps": cores / (cs_gen + train), "core_s_per_sample_gen": cs_gen,
            "core_s_per_sample_gen_decode": decode * tokens, "core_s_per_sample_gen_overhead": overhead,
            "core_s_per_sample_train": train, "mean_response_tokens": tokens, "cores": cores,
            "from_sync_splits": sync_keys}


def sim_workload(name: str, runs: list[dict], args, cfg) -> dict:
    """The simulator's workload: B, n and the length distribution (forced buckets, or the main workload's
    observed response lengths)."""
    if name == "longtail":
        lengths, empirical = [list(b) for b in parse_lengths(args.longtail)], False
    else:
        lengths = []
        for r in runs:
            if "error" not in r:
                for line in (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines():
                    lengths += json.loads(line).get("response_lengths", [])
        lengths, empirical = lengths or [cfg.rollout.max_response_length], True
    return {"prompts_per_step": cfg.data.train_batch_size, "n": cfg.rollout.n, "lengths": lengths,
            "max_staleness": cfg.algorithm.max_staleness, "empirical": empirical, "seed": 0}


def calibrate(results: dict, args, cfg) -> dict:
    """Per workload and split (``"main/r1x1-t1"``): decode curve (measured alone, in a subprocess with the
    split's roller threads), per-sample training, weight-sync and per-group overhead seconds from the runs
    of that split on that workload (a long-tail sample costs more to train than a main-workload one)."""
    out, decode_cache = {}, {}
    for wl_name, wl in results["workloads"].items():
        for r in wl["runs"]:
            if "error" in r:
                continue
            s = r["split"]
            t = s["roller_threads"]
            if t not in decode_cache:
                decode_cache[t] = run_calibration(cfg.model.path, t, cfg.rollers.max_batch_slots,
                                                  cfg.model.for_inference().dtype)
            entry = out.setdefault(f"{wl_name}/{s['key']}", {"update": [], "sync": [], "overhead": []})
            entry["update"] += [u / r["samples_per_step"] for u in r["update_s"]]
            entry["sync"] += r["sync_s"]
            entry["decode"] = decode_cache[t]
            entry["slots"] = cfg.rollers.max_batch_slots
            if r["mode"] == "sync" and r["gen_phase_s"]:
                entry["overhead"].append((wl_name, r["gen_phase_s"], s["num_replicas"]))
    calibration = {}
    for key, e in out.items():
        costs = Costs(decode_base_s=e["decode"]["decode_base_s"], decode_per_seq_s=e["decode"]["decode_per_seq_s"],
                      train_s_per_sample=statistics.median(e["update"]), max_batch_slots=e["slots"],
                      sync_s=statistics.median(e["sync"]) if e["sync"] else 0.0)
        overheads = []
        for wl_name, phases, replicas in e["overhead"]:
            spec = results["workloads"][wl_name]["sim_workload"]
            wl = Workload(**{**spec, "lengths": tuple(map(tuple, spec["lengths"])) if not spec["empirical"]
                             else tuple(spec["lengths"]), "num_steps": 4, "warmup_steps": 0, "tail_steps": 0})
            bare = Costs(**{**asdict(costs), "train_s_per_sample": 0.0, "sync_s": 0.0})
            sim_gen = simulate("sync", bare, wl, replicas).wall_s / 4
            overheads.append(max(0.0, (statistics.median(phases) - sim_gen) * replicas / spec["prompts_per_step"]))
        calibration[key] = asdict(Costs(**{**asdict(costs), "group_overhead_s": statistics.median(overheads)
                                           if overheads else 0.0}))
    return {"calibration": calibration, "decode_points": {str(t): d["points"] for t, d in decode_cache.items()}}


def run_calibration(model: str, threads: int, slots: int, dtype: str) -> dict:
    log(f"decode calibration: {model} in {dtype}, {threads} thread(s)")
    occupancies = sorted({1, max(1, slots // 4), slots})
    cmd = [sys.executable, str(Path(__file__)), "--calibrate-worker", model, str(threads), ",".join(map(str, occupancies)),
           dtype]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"decode calibration failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trl_peer(args, cfg, cores: int, workload: str = "main") -> dict:
    """TRL's runs on ``workload`` (``cfg``: its job config): the median, spread and every run, or the first
    run's ``{"error": ...}`` when none completed."""
    from trl_peer import run_trl

    from common.models import resolve_model_dir
    from controller.tasks import load_task_records, resolve_reward

    records = load_task_records(cfg.data.task, cfg.data.size, cfg.data.seed, cfg.data.task_kwargs,
                                cfg.data.prompt_key, cfg.data.answer_key)
    spec = {"model_dir": str(resolve_model_dir(cfg.model)), "task": cfg.data.task, "reward": resolve_reward(cfg.rollout.reward, cfg.data.task),
            "records": [{"prompt": r.prompt, "ground_truth": r.ground_truth} for r in records],
            "n": cfg.rollout.n, "prompts_per_step": cfg.data.train_batch_size,
            "max_response_length": cfg.rollout.max_response_length, "temperature": cfg.rollout.temperature,
            "lr": cfg.trainer.lr, "num_steps": args.steps, "warmup_steps": args.warmup_steps,
            "num_threads": cores, "seed": cfg.rollout.seed,
            "forced_response_lengths": cfg.rollout.forced_response_lengths,
            # Mixed precision on both sides: ours with model.compute_dtype=bfloat16, TRL's with bf16=True.
            "bf16": cfg.model.compute_dtype == "bfloat16"}
    runs = []
    for rep in range(args.longtail_reps if workload == "longtail" else args.reps):
        out_dir = args.out / "runs" / ("trl" if workload == "main" else f"trl-{workload}") / f"rep{rep}"
        done = out_dir / "trl_result.json"
        if args.reuse_runs and done.exists():
            res = json.loads(done.read_text())
        else:
            log(f"TRL GRPOTrainer {workload} rep {rep}: running")
            res = run_trl(spec, out_dir, args.run_timeout, log)
        log(f"  TRL {workload} rep {rep}: {res.get('samples_per_s', res.get('error'))}")
        runs.append(res)
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    out = {k: statistics.median(r[k] for r in ok) for k in ("samples_per_s", "tokens_per_s", "window_s", "wall_s")
           if all(r.get(k) is not None for r in ok)}
    return dict(out, spread_sps=[min(r["samples_per_s"] for r in ok), max(r["samples_per_s"] for r in ok)],
                num_runs=len(ok), runs=runs)


def add_run_args(p: argparse.ArgumentParser, preset: str, out: Path) -> None:
    """The arguments of every benchmark that runs jobs through ``bench_workload`` (this one, ``agentic_bench``):
    steps, window, reps, sweep, splits, preset, overrides, output folder, run timeout, reuse."""
    p.add_argument("--steps", type=int, default=8, help="trainer steps per run (same trained samples per mode)")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the steady-state window")
    p.add_argument("--tail-steps", type=int, default=1,
                   help="last steps left out (the drain; >= algorithm.max_staleness of the preset, 1)")
    p.add_argument("--reps", type=int, default=3, help="runs of each mode's best split (median, spread)")
    p.add_argument("--sweep", choices=("small", "none"), default="small")
    p.add_argument("--preset", default=preset, help="the job's preset (tiny: a smoke test of the benchmark)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    p.add_argument("--mode-set", action="append", default=[], metavar="MODE:KEY=VALUE",
                   help="an override for MODE's hflow-async runs only (e.g. fully-async:algorithm.max_staleness=2); "
                        "repeatable. The TRL peer and the machine limit's decode calibration are no mode's: they "
                        "take --set alone")
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--run-timeout", type=float, default=1200.0, help="seconds per run before it is killed")
    p.add_argument("--split", action="append", default=[], metavar="MODE=rRxT-tU",
                   help="MODE's sweep is these splits (R rollers x T threads, U trainer threads); repeatable")
    p.add_argument("--reuse-runs", action="store_true",
                   help="read a run whose directory in --out holds a completed summary.json instead of running it")


def check_run_args(p: argparse.ArgumentParser, args, quick_reps: int = 2) -> None:
    """``add_run_args``' values: ``--split`` items into ``{mode: [Split]}``, ``--mode-set`` items into
    ``{mode: [override]}``, ``--quick`` (4 steps, 1 warm-up, 1
    tail: the window is updates 2-3, without the drain, where ``fully-async``'s last update trains a backlog
    with the roller idle and runs faster than in steady state; ``quick_reps`` runs, no sweep), the window's
    bounds; a bad value is a usage error (exit 2)."""
    splits: dict[str, list[Split]] = {}
    for item in args.split:
        mode, split = parse_split(p, item)
        splits.setdefault(mode, []).append(split)
    args.split = splits
    mode_sets: dict[str, list[str]] = {}
    for item in args.mode_set:
        mode, _, override = item.partition(":")
        if mode not in MODES or "=" not in override:
            p.error(f"--mode-set {item!r}: expected MODE:KEY=VALUE with MODE one of {list(MODES)}")
        mode_sets.setdefault(mode, []).append(override)
    args.mode_set = mode_sets
    if args.quick:
        args.steps, args.warmup_steps, args.tail_steps, args.reps, args.sweep = 4, 1, 1, quick_reps, "none"
    if not (1 <= args.warmup_steps and 0 <= args.tail_steps and args.warmup_steps + args.tail_steps < args.steps):
        p.error(f"need --warmup-steps >= 1, --tail-steps >= 0 and their sum < --steps={args.steps}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="4 steps (1 warm-up, 1 tail), 2 runs per mode, no sweep (the sweep's usual best splits); "
                        "long-tail workload: sync and fully-async, 1 run each")
    p.add_argument("--workloads", default="main,longtail")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--longtail-modes", default=None, help="modes on the long-tail workload (default: --modes)")
    p.add_argument("--longtail-reps", type=int, default=None, help="runs per mode there (default: --reps)")
    p.add_argument("--longtail", default=LONGTAIL, help="forced lengths weight:min-max,... (long-tail workload)")
    p.add_argument("--longtail-max", type=int, default=LONGTAIL_MAX, help="rollout.max_response_length there")
    p.add_argument("--no-trl", action="store_true", help="skip the TRL peer (and its install)")
    add_run_args(p, PRESET, ROOT / "bench" / "results")
    args = p.parse_args(argv)
    check_run_args(p, args)
    if args.quick:
        args.longtail_modes = args.longtail_modes or "sync,fully-async"
        args.longtail_reps = args.longtail_reps or 1
    args.longtail_reps = args.longtail_reps or args.reps
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.longtail_modes = ([m.strip() for m in args.longtail_modes.split(",") if m.strip()]
                           if args.longtail_modes else list(args.modes))
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for m in args.modes + args.longtail_modes:
        if m not in MODES:
            p.error(f"--modes: {m!r} is not one of {list(MODES)}")
    for w in args.workloads:
        if w not in ("main", "longtail"):
            p.error(f"--workloads: {w!r} is not one of ['main', 'longtail']")
    parse_lengths(args.longtail)
    return args


def main(argv=None) -> None:
    if argv is None and len(sys.argv) == 6 and sys.argv[1] == "--calibrate-worker":
        _, _, model, threads, occ, dtype = sys.argv
        print(json.dumps(decode_calibration(model, int(threads), [int(x) for x in occ.split(",")], 16, dtype)))
        return
    args = parse_args(argv)
    from controller.config import load_config

    cores = os.cpu_count() or 1
    args.out.mkdir(parents=True, exist_ok=True)
    arg_values = dict(vars(args), split={m: [s.key for s in ss] for m, ss in args.split.items()})
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in arg_values.items()},
               "cores": cores, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "workloads": {}}
    configs = {name: load_config(preset=args.preset, overrides=workload_overrides(name, args) + list(args.set))
               for name in args.workloads}
    for name in configs:
        check_mode_sets(args, workload_overrides(name, args))
    for name, cfg in configs.items():
        wl = bench_workload(name, args, cores)
        wl["sim_workload"] = sim_workload(name, wl["runs"], args, cfg)
        results["workloads"][name] = wl
    cfg = configs["main"] if "main" in configs else load_config(
        preset=args.preset, overrides=workload_overrides("main", args) + list(args.set))
    results.update(calibrate(results, args, cfg))
    for name, wl in results["workloads"].items():
        wl["limit"] = limit(name, wl, results["calibration"], cores)
        wl["trl"] = {"error": "skipped (--no-trl)"} if args.no_trl else trl_peer(args, configs[name], cores, name)
    results["elapsed_s"] = time.monotonic() - T0
    line = write_outputs(results, args.out)
    log(f"wrote {args.out / 'modes_bench.json'}, .md and .png in {results['elapsed_s']:.0f} s")
    print(line, flush=True)


if __name__ == "__main__":
    main()
