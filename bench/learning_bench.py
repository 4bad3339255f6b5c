"""Learning benchmark: held-out accuracy over wall time and over trained samples, per schedule.

Every mode (``sync``, ``one-step-off``, ``fully-async``) runs ``hflow-async`` (a subprocess, as a user runs
it) with the same preset, data, seeds and hyper-parameters; only ``--mode`` differs. Each run validates
(``controller.validation``) on the same ``--val-size`` held-out prompts — the rows after the training ones,
so never trained on — every ``--val-every`` steps, before the first step and after the last: sampled
accuracy (pass@1 at the training temperature, ``val.n`` samples per prompt) and greedy accuracy.

Time axis: seconds from the run's first generation (the earliest roller busy interval of
``timeline.json``) to the end of the update that produced the evaluated ``weight_version`` (0 s for the
initial weights), less the time the trainer waited while a validation round ran (``validation_wait_s``):
validation is measurement, not training, and rollers take its prompts first, so in every mode a round
delays the data of the next update; in ``fully-async`` the trainer keeps training from its buffer meanwhile
and only its starved part is taken out. Start-up is not counted either. Sample axis: samples trained up to
that version. **Time to accuracy** (how PipelineRL and AReaL compare schedules): the first evaluated
version whose sampled held-out accuracy reaches ``--target`` (default: twice the initial accuracy, 0.5
when that is 0); ``nan`` when a mode never gets there.

``--reps`` runs of every mode (default 3, ``--quick`` 1), in rounds (each round runs every mode once, so a
drift of the machine touches all modes alike); the RESULT keys are medians over the runs: ``acc0`` over every
run's initial round (the same weights), ``acc_*`` and ``tta_s_*`` per mode (a run that never reaches the target
counts as slower than any that does; ``nan`` when the median one does not).

Outputs in ``--out`` (default ``bench/results/``, git-ignored): ``learning_bench.json`` (per mode: each run's
curve, final accuracy and time to accuracy, and their median and range), ``learning_bench.png`` (accuracy over
wall time and over trained samples, one line per run, a colour per mode), the run directories
``learning_runs/rep<i>/<mode>``, and the last line::

    RESULT acc0=… acc_sync=… acc_one_step_off=… acc_fully_async=… tta_s_sync=… tta_s_one_step_off=…
           tta_s_fully_async=… target=… reps=…

``--quick``: fewer steps and held-out prompts and one run per mode (a first look, not a result: a result needs
the median of at least three runs on a quiet machine). ``--reuse-runs``: a completed run in ``--out`` is read,
not run again (to rerun one, delete its run directory).
Smoke-test with the tiny preset: ``python bench/learning_bench.py --quick --preset tiny --steps 4
--val-every 2 --val-size 8 --set data.size=64 data.train_batch_size=8 trainer.ppo_mini_batch_size=8
data.val_disjoint=false`` (tiny_repeat's few prompts cannot be held out by text: its validation repeats them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from modes_runs import overlap_s  # noqa: E402

MODES = ("sync", "one-step-off", "fully-async")
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def run_mode(mode: str, rep: int, args) -> Path:
    """Run ``mode``'s ``rep``-th run; its run directory. Raises RuntimeError naming the log when the run fails."""
    run_dir = args.out / "learning_runs" / f"rep{rep}" / mode
    summary = run_dir / "summary.json"
    if args.reuse_runs and summary.exists() and json.loads(summary.read_text()).get("status") == "completed":
        log(f"{mode} rep{rep}: reusing the completed run in {run_dir}")
        return run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "controller.cli", "--mode", mode, "--preset", args.preset,
           f"trainer.total_steps={args.steps}", f"data.val_size={args.val_size}",
           f"trainer.val_every={args.val_every}", f"val.n={args.val_n}", f"run_dir={run_dir}",
           "metrics.progress=false", *args.set]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log(f"{mode} rep{rep}: running")
    log_path = run_dir.parent / f"{mode}.log"
    with open(log_path, "w") as out:
        try:
            code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=args.run_timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0:
        raise RuntimeError(f"{mode} rep{rep} run failed ({code}); log: {log_path}")
    return run_dir


def read_curve(run_dir: Path) -> dict:
    """The held-out curve of one run: points ``{weight_version, time_s, samples, accuracy,
    accuracy_greedy}`` in version order (see the module docstring for the axes)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = {r["step"]: r for r in rows if not r.get("validation")}
    timeline = json.loads((run_dir / "timeline.json").read_text())
    busy = [start for intervals in timeline["rollers"].values() for start, _ in intervals]
    origin = min(busy) if busy else timeline["update"][0][0]
    vals = sorted((r for r in rows if r.get("validation")), key=lambda r: r["weight_version"])
    rounds = []
    for r in vals:  # a round starts with the sync that made its version current (version 0: the first generation)
        v = r["weight_version"]
        start = 0.0 if v == 0 else timeline["sync"][v - 1][1] - origin
        rounds.append((start, start + r["val/duration_s"]))
    trainer_busy = [(a - origin, b - origin) for a, b in timeline["update"] + timeline["sync"]]
    points = []
    for r in vals:
        v = r["weight_version"]
        end = 0.0 if v == 0 else timeline["update"][v - 1][1] - origin
        waited = validation_wait_s(rounds, trainer_busy, end)
        points.append({
            "weight_version": v,
            "time_s": end - waited,
            "validation_wait_s": waited,
            "samples": sum(steps[s]["num_samples"] for s in range(1, v + 1)),
            "accuracy": r.get("val/accuracy"),
            "accuracy_greedy": r.get("val/accuracy_greedy"),
        })
    return {"points": points, "wall_s": json.loads((run_dir / "summary.json").read_text())["wall_s"]}


def validation_wait_s(rounds: list[tuple[float, float]], busy: list[tuple[float, float]], until: float) -> float:
    """Seconds before ``until`` that lie in a validation round (``rounds``: ``[start, end]``, overlapping rounds
    count once) and outside every trainer busy interval (``busy``: updates and weight syncs); one clock."""
    return overlap_s(rounds + busy, -math.inf, until) - overlap_s(busy, -math.inf, until)


def time_to_accuracy(points: list[dict], target: float) -> float:
    """Seconds to the first point whose sampled accuracy reaches ``target``; nan if none does."""
    return next((p["time_s"] for p in points if p["accuracy"] is not None and p["accuracy"] >= target), math.nan)


def median_spread(values: list[float]) -> dict:
    """``{median, min, max}`` of ``values``. ``nan`` (a run that never reached the target) counts as slower than
    any number, so the median is ``nan`` when a middle run is one; ``min``/``max`` are over the numbers."""
    ordered = sorted(math.inf if math.isnan(v) else v for v in values)
    mid = statistics.median(ordered) if ordered else math.inf
    numbers = [v for v in ordered if v != math.inf]
    return {"median": math.nan if mid == math.inf else mid,
            "min": min(numbers, default=math.nan), "max": max(numbers, default=math.nan)}


def plot(curves: dict[str, list[dict]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, (mode, runs) in enumerate(curves.items()):
        for rep, curve in enumerate(runs):
            pts = curve["points"]
            style = {"marker": "o", "markersize": 3, "color": f"C{i}", "alpha": 0.8 if len(runs) == 1 else 0.6,
                     "label": mode if rep == 0 else None}
            ax_t.plot([p["time_s"] for p in pts], [p["accuracy"] for p in pts], **style)
            ax_s.plot([p["samples"] for p in pts], [p["accuracy"] for p in pts], **style)
    for ax, xlabel in ((ax_t, "wall time from first generation (s)"), (ax_s, "trained samples")):
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    ax_t.set_ylabel("held-out accuracy (sampled pass@1)")
    ax_t.set_ylim(-0.02, 1.02)
    ax_s.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-reasoning")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per run (default 60, --quick 12: the main job's)")
    p.add_argument("--val-every", type=int, default=None, help="steps between rounds (default 10, --quick 4)")
    p.add_argument("--val-size", type=int, default=None, help="held-out prompts (default 64, --quick 32)")
    p.add_argument("--val-n", type=int, default=4, help="samples per held-out prompt (val.n)")
    p.add_argument("--target", type=float, default=None, help="time-to-accuracy target (default 2 x acc0)")
    p.add_argument("--reps", type=int, default=None, help="runs per mode (default 3, --quick 1)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--quick", action="store_true", help="fewer steps and held-out prompts, one run per mode: a first look")
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides for every run (key=value)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--reuse-runs", action="store_true",
                   help="read a completed run in --out instead of running it again (to rerun one: delete its run directory)")
    args = p.parse_args(argv)
    for key, full, quick in (("steps", 60, 12), ("val_every", 10, 4), ("val_size", 64, 32), ("reps", 3, 1)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.reps < 1:
        p.error(f"--reps must be at least 1, got {args.reps}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for rep in range(args.reps):  # rounds: every mode once per round
        for mode in args.modes:
            curves[mode].append(read_curve(run_mode(mode, rep, args)))
    initial = [run["points"][0]["accuracy"] for runs in curves.values() for run in runs
               if run["points"] and run["points"][0]["weight_version"] == 0]
    acc0 = median_spread(initial)["median"]  # nan without an initial round
    target = args.target if args.target is not None else min(1.0, 2 * acc0) if acc0 > 0 else 0.5
    results = {"acc0": acc0, "acc0_runs": initial, "target": target, "reps": args.reps,
               "args": {k: str(v) for k, v in vars(args).items()}, "modes": {}}
    for mode, runs in curves.items():
        for run in runs:
            pts = run["points"]
            run["final_accuracy"] = pts[-1]["accuracy"] if pts else math.nan
            run["tta_s"] = time_to_accuracy(pts, target)
        results["modes"][mode] = {"final_accuracy": median_spread([r["final_accuracy"] for r in runs]),
                                  "tta_s": median_spread([r["tta_s"] for r in runs]), "runs": runs}
        m = results["modes"][mode]
        log(f"{mode}: final accuracy {m['final_accuracy']['median']:.3f} ({m['final_accuracy']['min']:.3f}-"
            f"{m['final_accuracy']['max']:.3f}), time to {target:.3f}: {m['tta_s']['median']:.1f} s "
            f"({m['tta_s']['min']:.1f}-{m['tta_s']['max']:.1f}) over {len(runs)} run(s)")
    (args.out / "learning_bench.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
    plot(curves, target, args.out / "learning_bench.png")
    key = {m: m.replace("-", "_") for m in args.modes}
    fields = [f"acc0={acc0:.4f}"]
    fields += [f"acc_{key[m]}={results['modes'][m]['final_accuracy']['median']:.4f}" for m in args.modes]
    fields += [f"tta_s_{key[m]}={results['modes'][m]['tta_s']['median']:.1f}" for m in args.modes]
    print("RESULT " + " ".join(fields) + f" target={target:.4f} reps={args.reps}", flush=True)


if __name__ == "__main__":
    main()
