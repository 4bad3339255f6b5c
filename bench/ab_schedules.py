"""A/B of two checkouts on the schedules benchmark's main workload: interleaved pairs per mode, each mode at
its best split, the median of the paired samples/s ratios.

Why: a change to the controller's core (issue 45's group ledger) must leave every schedule's throughput
where it was. Runs of one sitting drift (the VM's other tenants, thermal state), so each pair runs the
baseline and the candidate back to back, alternating which goes first, and the verdict is the median of the
per-pair ratios candidate / baseline — not a ratio of medians taken at different times.

Each run is ``python -m controller.cli`` of that checkout (its own code on ``PYTHONPATH``, this
environment's packages), ``bench/modes_bench.py``'s ``MAIN_WORKLOAD`` at the split ``--split`` gives the mode
(default: the best splits recorded in bench/README.md), ``--steps`` steps, samples/s over the steady-state
window of ``bench/modes_runs.read_run``. Usage::

    git worktree add /tmp/base 8a54b85
    python bench/ab_schedules.py --baseline /tmp/base --pairs 3

Last line::

    RESULT ratio_sync=… ratio_one_step_off=… ratio_fully_async=… min_ratio=… (each the median of the paired
    candidate/baseline samples/s ratios; spread in the JSON and the log)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from modes_bench import MAIN_WORKLOAD, MODES, PRESET, Split  # noqa: E402
from modes_runs import read_run  # noqa: E402

BEST = {"sync": Split(1, 2, 2), "one-step-off": Split(1, 1, 2), "fully-async": Split(1, 1, 2)}


def run(tree: Path, mode: str, split: Split, run_dir: Path, args) -> float:
    """One run of ``tree``'s code; its steady-state samples/s. Raises RuntimeError when it fails."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "controller.cli", "--mode", mode, "--preset", PRESET, *MAIN_WORKLOAD,
           *split.overrides(), f"trainer.total_steps={args.steps}", f"run_dir={run_dir}", "metrics.progress=false"]
    env = dict(os.environ, PYTHONPATH=str(tree))
    with open(f"{run_dir}.log", "w") as out:
        code = subprocess.run(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=args.run_timeout).returncode
    if code != 0:
        raise RuntimeError(f"{tree} {mode}: exit {code}, log {run_dir}.log")
    return read_run(run_dir, args.warmup_steps, args.tail_steps)["samples_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="a checkout of the baseline commit")
    p.add_argument("--candidate", type=Path, default=ROOT, help="the checkout under test (default: this one)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--tail-steps", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--run-timeout", type=float, default=1200.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ab_schedules")
    args = p.parse_args()
    trees = {"baseline": args.baseline.resolve(), "candidate": args.candidate.resolve()}
    results: dict[str, dict] = {}
    for mode in args.modes.split(","):
        pairs = []
        for i in range(args.pairs):
            order = ("baseline", "candidate") if i % 2 == 0 else ("candidate", "baseline")
            sps = {}
            for side in order:
                started = time.monotonic()
                sps[side] = run(trees[side], mode, BEST[mode], args.out / mode / f"{side}-{i}", args)
                print(f"{mode} pair {i} {side}: {sps[side]:.3f} samples/s ({time.monotonic() - started:.0f} s)",
                      file=sys.stderr, flush=True)
            pairs.append(sps | {"ratio": sps["candidate"] / sps["baseline"]})
        ratios = [r["ratio"] for r in pairs]
        results[mode] = {"split": BEST[mode].key, "pairs": pairs, "median_ratio": statistics.median(ratios),
                         "min_ratio": min(ratios), "max_ratio": max(ratios)}
        print(f"{mode}: median ratio {results[mode]['median_ratio']:.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
              file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab_schedules.json").write_text(json.dumps(results, indent=1) + "\n")
    keys = " ".join(f"ratio_{m.replace('-', '_')}={r['median_ratio']:.3f}" for m, r in results.items())
    print(f"RESULT {keys} min_ratio={min(r['median_ratio'] for r in results.values()):.3f}")


if __name__ == "__main__":
    main()
