"""Elastic roller pool benchmark: one ``fully-async`` job whose generation is the bottleneck, scaled from 1 to
2 rollers part-way through, then back to 1.

The job (``--preset``, default ``tiny``) runs in this process (its own local Ray cluster) with one roller,
``rollout.forced_response_lengths`` making every response ``--response-tokens`` long (default 128, EOS
ignored) and ``rollers.max_batch_slots=--batch-slots`` (default 4: a roller decodes 4 sequences at a time, as
a KV-cache budget bounds it on a GPU), so generation dominates: with the tiny model one update of 64 samples
takes ~0.4 s, their generation ~6.5 s on one roller. With the tiny model's own defaults (4 tokens, 128
slots) a step takes 0.1 s, and the job ends before a new roller (~8 s to join) could matter. After
``--scale-at`` steps the benchmark asks ``controller.admin.request_scale(run_dir, 2)`` (what ``hflow-async
scale --rollers 2`` does) and, ``--keep`` steps after the new roller joined, asks for 1 again (the oldest
roller, one the job started with, drains and leaves).

Reported (from ``metrics.jsonl`` and the requests' own timing):

* ``sps_1_roller`` / ``sps_2_rollers``: trained samples per second over the steps that ended before the
  scale-up request, and over those that ended between the join and the scale-down request;
* ``join_s``: from the scale-up request until the new roller is active (it holds the trainer's current
  weights and takes work) — the answer of the request;
* ``join_to_first_trained_s``: from the scale-up request (as the job received it) until the end of the first
  trainer step that trained a group the new roller generated (``summary.json``'s ``roller_joins``, see
  ``controller.pool_keeper``): the time until the new roller's work counts;
* ``drain_s``: from the scale-down request until the drained roller left (the answer);
* ``lost_samples`` / ``repeated_samples``: prompts (uid without its ``.r<k>`` re-issue suffix) of the run's
  steps never trained / trained more than once, times ``rollout.n``.

Last line::

    RESULT sps_1_roller=… sps_2_rollers=… join_s=… join_to_first_trained_s=… drain_s=… lost_samples=… repeated_samples=…

``--quick``: a few short steps, with roller0 paced to 1 s per group (``rollers.fault_injection``) so the
requests land mid-run on any machine: proves the script runs, measures nothing. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.admin import ADDRESS_FILE, request_scale  # noqa: E402
from controller.config import load_config  # noqa: E402
from controller.job import run_job  # noqa: E402


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait(what: str, until, job: threading.Thread, timeout_s: float = 1800.0) -> float:
    deadline = time.monotonic() + timeout_s
    while not until():
        if not job.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended (or {timeout_s:.0f} s passed) before {what}")
        time.sleep(0.2)
    return time.monotonic()


def _sps(steps: list[dict], t_from: float, t_to: float, ended: dict[int, float]) -> float:
    picked = [s for s in steps if t_from <= ended[s["step"]] <= t_to]
    if len(picked) < 2:
        return float("nan")
    first, last = picked[0]["step"], picked[-1]["step"]
    samples = sum(s["num_samples"] for s in picked[1:])
    return samples / max(ended[last] - ended[first], 1e-9)


def _first_trained_s(run_dir: Path) -> float:
    """``join_to_first_trained_s`` of the roller the scale-up request added (NaN when unknown)."""
    rows = json.loads((run_dir / "summary.json").read_text()).get("roller_joins") or []
    value = next((r["join_to_first_trained_s"] for r in rows if r["reason"] == "scale_up"), None)
    return float("nan") if value is None else float(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=44)
    parser.add_argument("--scale-at", type=int, default=16, help="steps before the scale-up request")
    parser.add_argument("--keep", type=int, default=20, help="steps with 2 rollers before the scale-down")
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--batch-slots", type=int, default=4,
                        help="rollers.max_batch_slots: sequences a roller decodes at once (as a KV cache bounds it)")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="a few short steps: proves the script runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.scale_at, args.keep, args.response_tokens = 8, 1, 1, 8
    run_dir = Path(args.run_dir or f"runs/elastic-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    L = args.response_tokens
    cfg = load_config(mode="fully-async", preset=args.preset, overrides=[
        f"run_dir={run_dir}", "metrics.progress=false", f"trainer.total_steps={args.steps}",
        "rollers.num_replicas=1", "rollers.max_replicas=2", f"rollers.max_batch_slots={args.batch_slots}",
        f"rollout.max_response_length={L}",
        f"rollout.forced_response_lengths=[[1,{L},{L}]]", "data.train_batch_size=8",
        "trainer.ppo_mini_batch_size=8", *(["rollers.fault_injection=[roller0:slow:group=1:1.0]"] * args.quick)])
    outcome: dict = {}
    job = threading.Thread(target=lambda: outcome.update(code=run_job(cfg)), name="job")
    ended: dict[int, float] = {}  # step -> when this script saw its record

    def seen(n: int):
        def check() -> bool:
            for s in _steps(run_dir):
                ended.setdefault(s["step"], time.monotonic())
            return len(ended) >= n
        return check

    job.start()
    try:
        _wait("the admin endpoint", lambda: (run_dir / ADDRESS_FILE).exists(), job)
        t_up = _wait(f"step {args.scale_at}", seen(args.scale_at), job)
        request_scale(run_dir, 2)
        seen(0)()  # steps that ended during the join are stamped now, before the 2-roller window opens
        t_joined = time.monotonic()
        t_down = _wait(f"{args.keep} steps with 2 rollers", seen(len(ended) + args.keep), job)
        request_scale(run_dir, 1)
        t_left = time.monotonic()
    finally:
        job.join()
    if outcome.get("code") != 0:
        print(f"the job failed (exit {outcome.get('code')}); see {run_dir}/summary.json", file=sys.stderr)
        return 1
    steps = _steps(run_dir)
    seen(len(steps))()
    prompts = Counter(uid.split(".r")[0] for s in steps for uid in s["uids"])
    n = cfg.rollout.n
    expected = args.steps * cfg.data.train_batch_size
    repeated = sum(c - 1 for c in prompts.values()) * n
    lost = (expected - len(prompts)) * n
    result = {"sps_1_roller": _sps(steps, 0.0, t_up, ended), "sps_2_rollers": _sps(steps, t_joined, t_down, ended),
              "join_s": t_joined - t_up, "join_to_first_trained_s": _first_trained_s(run_dir),
              "drain_s": t_left - t_down, "lost_samples": lost,
              "repeated_samples": repeated}
    (run_dir / "elastic_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print("RESULT " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
