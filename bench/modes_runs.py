"""What ``bench/modes_bench.py`` reads from one finished run directory, and the decode-cost calibration.

A run directory (``hflow-async ... run_dir=DIR``) holds ``metrics.jsonl`` (one record per trainer step),
``summary.json`` and ``timeline.json`` (``[start, end]`` wall-clock seconds of every trainer update, every
weight sync, and every roller's busy intervals, >= 1 request in flight). Everything here is measured over
the **steady-state window**: from the end of update ``warmup_steps`` to the end of update
``num_steps - tail_steps``, so start-up, model loading and the first steps are left out, and so is the
drain at the end (the last ``tail_steps`` updates: one-step-off's last update has no generation to overlap,
and fully-async's last ``max_staleness`` updates train the backlog while admission has stopped at the
run's total); every mode is measured over the same number of trained samples, whose generation falls
inside the window as much as their training does.

Metric definitions (all shares are of the window's wall time):

* ``samples_per_s``: samples trained in the window's updates / window;
* ``tokens_per_s``: response tokens of those samples / window (tokens that were trained; a fully-async
  run's generated-but-untrained tail is not counted);
* ``trainer_idle_share``: the trainer neither updating nor syncing weights = waiting for data;
* ``roller_idle_share``: mean over rollers of the time with no request in flight;
* ``sync_share``: weight syncs (pause → every roller loaded and resumed);
* ``staleness_mean`` / ``_max``: trainer version − sample ``min_weight_version``, window steps.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def overlap_s(intervals, t0: float, t1: float) -> float:
    """Seconds of ``intervals`` (``[start, end]`` pairs, possibly overlapping) inside ``[t0, t1]``."""
    clipped = sorted((max(s, t0), min(e, t1)) for s, e in intervals if e > t0 and s < t1)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in clipped:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def read_run(run_dir: Path, warmup_steps: int, tail_steps: int) -> dict:
    """The steady-state metrics of one completed run (see the module docstring), plus the phase timings
    the limit and the simulator need: ``gen_phase_s`` (sync only: sync end → next update start, per step),
    ``update_s`` and ``sync_s`` (per event, window). Raises ValueError when the run did not complete or
    has no step after ``warmup_steps``."""
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("status") != "completed":
        raise ValueError(f"{run_dir}: run {summary.get('status')}: {summary.get('error')}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if not r.get("validation")]  # validation rounds are rows of their own
    timeline = json.loads((run_dir / "timeline.json").read_text())
    updates, syncs = timeline["update"], timeline["sync"]
    last = len(steps) - tail_steps
    if last <= warmup_steps or len(updates) != len(steps):
        raise ValueError(f"{run_dir}: {len(steps)} steps ({len(updates)} updates timed), need > "
                         f"{warmup_steps} + {tail_steps}")
    t0 = updates[warmup_steps - 1][1] if warmup_steps else updates[0][0]
    t1 = updates[last - 1][1]
    window = max(t1 - t0, 1e-9)
    kept = steps[warmup_steps:last]
    samples = sum(s["num_samples"] for s in kept)
    tokens = sum(s["num_samples"] * s["response_length_mean"] for s in kept)
    sync_t = overlap_s(syncs, t0, t1)
    rollers = timeline["rollers"]
    roller_busy = [overlap_s(iv, t0, t1) / window for iv in rollers.values()]
    gen_phases = []
    if summary.get("mode") == "sync":  # the phases alternate: generation is sync end → next update start
        for k in range(max(warmup_steps, 1), last):
            gen_phases.append(updates[k][0] - syncs[k - 1][1])
    return {
        "run_dir": str(run_dir),
        "num_steps": len(steps),
        "warmup_steps": warmup_steps,
        "tail_steps": tail_steps,
        "window_s": window,
        "wall_s": summary.get("wall_s"),
        "num_samples": samples,
        "samples_per_s": samples / window,
        "tokens_per_s": tokens / window,
        "trainer_idle_share": 1 - (overlap_s(updates, t0, t1) + sync_t) / window,
        "roller_idle_share": 1 - sum(roller_busy) / len(roller_busy) if roller_busy else None,
        "sync_share": sync_t / window,
        "staleness_mean": statistics.fmean(s["staleness_mean"] for s in kept),
        "staleness_max": max(s["staleness_max"] for s in kept),
        "num_dropped_groups": summary.get("num_dropped_groups"),
        "response_length_mean": tokens / samples if samples else 0.0,
        "samples_per_step": samples / len(kept),
        "gen_phase_s": gen_phases,
        "update_s": [e - s for s, e in updates[warmup_steps:last]],
        "sync_s": [e - s for s, e in syncs if t0 - 1e-6 <= s <= t1],
        "timeline": {"t0": t0, "t1": t1, **timeline},
    }


def decode_calibration(model: str, num_threads: int, occupancies: list[int], num_tokens: int,
                       dtype: str = "float32") -> dict:
    """Measure one decode step of the torch engine at each batch occupancy (``num_threads`` torch threads,
    ``num_tokens`` tokens per request, EOS ignored) and fit ``step_s = decode_base_s + decode_per_seq_s·b``
    by least squares; returns the fit and the raw points (seconds). The model in ``dtype`` (the rollers'
    compute dtype). Runs in its own process (threads)."""
    import asyncio

    from common.env import set_torch_threads
    from common.models import ModelConfig, apply_chat_template, load_model, load_tokenizer
    from rollers.engine import GenerationRequest, SamplingParams
    from rollers.torch_engine import TorchEngine

    set_torch_threads(num_threads)
    cfg = ModelConfig(path=model, dtype=dtype)
    tok = load_tokenizer(cfg)
    prompt = tuple(apply_chat_template(tok, "What is 3 + 4?"))
    engine = TorchEngine(load_model(cfg), tok, max_batch_slots=max(occupancies), seed=0)

    async def one(b: int) -> float:
        reqs = [GenerationRequest(f"cal{b}-{i}", prompt, SamplingParams(max_new_tokens=num_tokens, seed=i,
                                                                       ignore_eos=True)) for i in range(b)]
        start = time.perf_counter()
        await asyncio.gather(*(engine.generate(r) for r in reqs))
        return (time.perf_counter() - start) / num_tokens

    async def main() -> list[float]:
        try:
            await one(1)  # warm-up
            return [await one(b) for b in occupancies]
        finally:
            await engine.shutdown()

    points = asyncio.run(main())
    xs, ys = occupancies, points
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var) if var else 0.0
    return {"decode_base_s": max(0.0, my - slope * mx), "decode_per_seq_s": slope,
            "points": dict(zip(map(str, xs), ys, strict=True))}
