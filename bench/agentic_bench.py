"""Agentic benchmark: ``sync`` vs ``fully-async`` on multi-turn trajectories with a long-tail number of turns.

The work: ``--preset smollm2-calculator`` (SmolLM2-135M-Instruct, multi-digit chain_sum, 4 prompts × 4 samples
per step) with its environment replaced by ``bench.agentic_env:longtail_turns``: each trajectory takes K model
turns, K drawn per sample from ``--turns`` (default ``7:1-2,2:3-4,1:8-12``: 70% of the trajectories take 1-2
turns, 10% take 8-12), the first K−1 turns are tool calls that each wait ``--tool-latency-s`` seconds (a tool or
sandbox latency), and every model turn decodes a length drawn from ``--turn-lengths`` (EOS ignored,
``rollout.forced_response_lengths`` per turn). K and every length derive from (``rollout.seed``, uid, sample
index, turn), so both modes do exactly the same work: the same prompts, seeds, turns, tokens and number of
trained samples; only ``--mode`` and the split differ. Forced lengths measure throughput, not learning.

Reused from ``bench/modes_bench.py`` (imported, one implementation): the splits and their sweep
(``candidate_splits``, ``--sweep``, ``--split``), running one ``hflow-async`` subprocess per run (``run_one``,
``--reuse-runs``), the steady-state window and its metrics (``bench/modes_runs.py``: updates after
``--warmup-steps`` up to the last ``--tail-steps``), the best split by samples/s repeated to ``--reps`` runs
and the median (``bench_workload``, ``summarize``). Added per run (``agentic_metrics``):

* ``turns_per_s``: model turns of the window's trained samples / window (their K, from the seeds);
  ``turns_per_sample``; ``truncated_share``: trained samples cut by the length budget (0 when the budget
  ``rollout.max_response_length`` = max K × (max turn length + ``OBSERVATION_TOKENS``) holds, as it should);
* ``tool_wait_share``: seconds trajectories spent waiting on tools / their wall time (reset → close), over the
  trajectories that ended inside the window (each trajectory logs itself: ``bench/agentic_env.py``). A tool
  call's seconds are its wall time: with the torch engine, whose decode steps run on the roller's event loop,
  that is its latency plus up to one decode step (the loop wakes the call when the step in progress ends).

Where the time goes, per mode: the trainer updating (``1 − trainer_idle − sync``), waiting for data
(``trainer_idle_share``), syncing weights (``sync_share``); rollers with no request in flight
(``roller_idle_share``: in ``sync`` the update phase and the tail of long trajectories, including all
trajectories waiting on tools at once) and the share of trajectory time spent on tools.

Outputs in ``--out`` (default ``bench/results/agentic``, git-ignored): ``agentic_bench.json``, ``agentic_bench.md``,
the run directories under ``runs/``, the trajectory logs under ``env_log/``, and the last line::

    RESULT sync_sps=… fully_async_sps=… speedup=… speedup_turns=… max_staleness=…

``--quick`` (4 steps, 1 warm-up, 1 tail: window updates 2-3; 1 run per mode, no sweep: 2 SmolLM2 runs) is
sized to finish in under 15 minutes on 2 cores: 3-5 minutes a run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from modes_bench import (  # noqa: E402
    add_run_args,
    bench_workload,
    candidate_splits,
    check_mode_sets,
    check_run_args,
    log,
)
from schedule_sim import parse_lengths  # noqa: E402

from bench.agentic_env import DEFAULT_TURNS, num_turns  # noqa: E402

MODES = ("sync", "fully-async")
PRESET = "smollm2-calculator"
ENVIRONMENT = "bench.agentic_env:longtail_turns"
TURN_LENGTHS = "1:8-16"
OBSERVATION_TOKENS = 32  # an observation turn in the chat template, with room to spare (SmolLM2: ~20)
WORKLOAD = "agentic"


def workload_overrides(args) -> list[str]:
    """The config overrides that make the preset's job the long-tail multi-turn workload (module docstring)."""
    max_turns = max(high for _, _, high in parse_lengths(args.turns))
    max_turn = max(high for _, _, high in parse_lengths(args.turn_lengths))
    options = {"turns": args.turns, "tool_latency_s": args.tool_latency_s, "log_dir": str(args.out / "env_log")}
    lengths = [list(b) for b in parse_lengths(args.turn_lengths)]
    return [f"rollout.environment={ENVIRONMENT}", f"rollout.env_kwargs={json.dumps(options)}",
            f"rollout.max_turns={max_turns}", f"rollout.max_response_length={max_turns * (max_turn + OBSERVATION_TOKENS)}",
            f"rollout.forced_response_lengths={json.dumps(lengths).replace(' ', '')}"]


def _trained_rows(run_dir: Path, warmup_steps: int, tail_steps: int) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if not r.get("validation")]
    return steps[warmup_steps: len(steps) - tail_steps]


def agentic_metrics(run: dict, turns: str, rollout_seed: int, n: int, env_log: list[dict]) -> dict:
    """The agentic metrics of one run (``run``: ``modes_runs.read_run``'s dict; see the module docstring);
    ``env_log``: every trajectory record of the benchmark (those inside the run's window are used)."""
    from rollers.agent_loop import environment_seed

    rows = _trained_rows(Path(run["run_dir"]), run["warmup_steps"], run["tail_steps"])
    per_sample = [num_turns(turns, environment_seed(rollout_seed, uid, i)) for r in rows for uid in r["uids"]
                  for i in range(n)]
    num_samples = sum(r["num_samples"] for r in rows)
    truncated = sum(r["response_clip_ratio"] * r["num_samples"] for r in rows)
    t0, t1 = run["timeline"]["t0"], run["timeline"]["t1"]
    inside = [e for e in env_log if t0 <= e["end"] <= t1]
    traj_s = sum(e["end"] - e["start"] for e in inside)
    return {"turns_per_s": sum(per_sample) / run["window_s"],
            "turns_per_sample": statistics.fmean(per_sample) if per_sample else 0.0,
            "truncated_share": truncated / num_samples if num_samples else 0.0,
            "tool_wait_share": sum(e["tool_wait_s"] for e in inside) / traj_s if traj_s > 0 else math.nan,
            "num_logged_trajectories": len(inside)}


def read_env_log(log_dir: Path) -> list[dict]:
    """Every trajectory record under ``log_dir`` (``bench/agentic_env.py``'s JSON lines); [] when absent."""
    records = []
    for path in sorted(log_dir.glob("*.jsonl")) if log_dir.is_dir() else []:
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


AGENTIC_KEYS = ("turns_per_s", "turns_per_sample", "truncated_share", "tool_wait_share")


def add_agentic(result: dict, args, rollout_seed: int, n: int) -> None:
    """Add ``agentic_metrics`` to every completed run of ``result`` (``bench_workload``'s) and their medians
    over each mode's best-split runs to its summary."""
    env_log = read_env_log(args.out / "env_log")
    for run in result["runs"]:
        if "error" not in run:
            run.update(agentic_metrics(run, args.turns, rollout_seed, n, env_log))
    for mode, best in result["best"].items():
        if "error" in best:
            continue
        runs = [r for r in result["runs"] if r["mode"] == mode and "error" not in r
                and r["split"]["key"] == best["split"]["key"]]
        for key in AGENTIC_KEYS:
            values = [r[key] for r in runs if not math.isnan(r[key])]
            best[key] = statistics.median(values) if values else math.nan
        best["update_share"] = 1 - best["trainer_idle_share"] - best["sync_share"]


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def result_line(best: dict) -> str:
    """The last line: samples/s of both modes' best splits (medians), their ratio, the ratio of their turns/s
    (``speedup_turns``) and fully-async's max staleness.

    ``speedup_turns`` is the work-normalised ratio: the samples a window trains differ between the modes in
    their number of turns (``fully-async`` trains a step's short trajectories while its long ones still run, so
    its window holds fewer turns per sample than ``sync``'s; over a whole run both train the same samples),
    which ``speedup`` counts in ``fully-async``'s favour."""
    sync, fa = best.get("sync", {}), best.get("fully-async", {})
    sync_sps, fa_sps = sync.get("samples_per_s", math.nan), fa.get("samples_per_s", math.nan)
    speedup = _ratio(fa_sps, sync_sps)
    speedup_turns = _ratio(fa.get("turns_per_s", math.nan), sync.get("turns_per_s", math.nan))
    return (f"RESULT sync_sps={sync_sps:.4f} fully_async_sps={fa_sps:.4f} speedup={speedup:.3f} "
            f"speedup_turns={speedup_turns:.3f} max_staleness={fa.get('staleness_max', math.nan)}")


def table(best: dict) -> str:
    """A markdown table of the per-mode summaries (where the time goes)."""
    cols = [("split", lambda b: b["split"]["key"]), ("samples/s", lambda b: f"{b['samples_per_s']:.3f}"),
            ("spread", lambda b: "{:.3f}-{:.3f}".format(*b["spread_sps"])),
            ("turns/s", lambda b: f"{b['turns_per_s']:.2f}"), ("turns/sample", lambda b: f"{b['turns_per_sample']:.2f}"),
            ("trainer update", lambda b: f"{b['update_share']:.0%}"),
            ("trainer idle", lambda b: f"{b['trainer_idle_share']:.0%}"), ("sync", lambda b: f"{b['sync_share']:.0%}"),
            ("roller idle", lambda b: f"{b['roller_idle_share']:.0%}"),
            ("tool wait", lambda b: f"{b['tool_wait_share']:.0%}"),
            ("staleness mean/max", lambda b: f"{b['staleness_mean']:.2f}/{b['staleness_max']}"),
            ("runs", lambda b: str(b["num_runs"]))]
    lines = ["| mode | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for mode, b in best.items():
        cells = [f(b) for _, f in cols] if "error" not in b else [b["error"]] + [""] * (len(cols) - 1)
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 steps (1 warm-up, 1 tail), 1 run per mode, no sweep")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--turns", default=DEFAULT_TURNS, help="turns per trajectory, weight:min-max,... (long tail)")
    p.add_argument("--turn-lengths", default=TURN_LENGTHS, help="tokens per model turn, weight:min-max,...")
    p.add_argument("--tool-latency-s", type=float, default=0.2, help="seconds each tool call waits")
    add_run_args(p, PRESET, ROOT / "bench" / "results" / "agentic")
    args = p.parse_args(argv)
    check_run_args(p, args, quick_reps=1)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes: {m!r} is not one of {list(MODES)}")
    for flag, spec in (("--turns", args.turns), ("--turn-lengths", args.turn_lengths)):
        try:
            parse_lengths(spec)
        except ValueError as exc:
            p.error(f"{flag}: {exc}")
    if args.tool_latency_s < 0:
        p.error(f"--tool-latency-s must be >= 0, got {args.tool_latency_s}")
    args.longtail_modes, args.longtail_reps = [], args.reps  # bench_workload's knobs of another workload
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from controller.config import load_config

    cores = os.cpu_count() or 1
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.reuse_runs:
        shutil.rmtree(args.out / "env_log", ignore_errors=True)
    overrides = workload_overrides(args)
    cfg = load_config(preset=args.preset, overrides=overrides + list(args.set))  # a bad override fails here
    check_mode_sets(args, overrides)
    log(f"workload: {' '.join(overrides)}; splits "
        + ", ".join(f"{m} {[s.key for s in candidate_splits(m, args, cores)]}" for m in args.modes))
    result = bench_workload(WORKLOAD, args, cores, overrides)
    add_agentic(result, args, cfg.rollout.seed, cfg.rollout.n)
    line = result_line(result["best"])
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "split"},
               "cores": cores, "overrides": overrides, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "best": result["best"], "runs": [{k: v for k, v in r.items() if k != "timeline"} for r in result["runs"]],
               "result": line}
    (args.out / "agentic_bench.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "agentic_bench.md").write_text(table(result["best"]) + "\n" + line + "\n")
    print(table(result["best"]), file=sys.stderr)
    print(line, flush=True)


if __name__ == "__main__":
    main()
