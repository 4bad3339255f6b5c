"""A discrete-event simulator of the three schedules, its validation against measured runs, and a planner.

Model (one process per roller, one trainer group of ``T`` ranks; every time in seconds)::

    roller r:   pulls whole prompt groups (up to max_batch_slots // n in flight) from the admitted queue;
                one decode step of b sequences takes decode_base_s + decode_per_seq_s·b and gives each one
                token; a sequence ends after its length (drawn from the workload's length distribution);
                a group that completes costs group_overhead_s more on its roller (prefill, reward, put)
    trainer:    one update of S samples takes train_step_overhead_s + S·train_s_per_sample / T
                (+ train_comm_s when T > 1)
    weight sync: sync_s + sync_s_per_roller·R; rollers generate nothing meanwhile (fully-async: in-flight
                sequences are paused and continue afterwards, partial rollout)

Schedules as in ``controller/schedules.py``: ``sync`` (admit B → all generated → update → sync),
``one-step-off`` (generation of batch k+1 with v_k overlaps the update on batch k; sync after both) and
``fully-async`` (admission keeps started ≤ (max_staleness + synced_version + 1)·B − 1; the trainer takes
B complete groups in completion order; sync after every update; a group staler than max_staleness is
dropped and its prompt re-issued, ``algorithm.stale_policy=drop``, the default). A sample's staleness is the
trainer's version at its update minus the roller's version when the sample's first token was decoded.

Commands::

    python bench/schedule_sim.py simulate --costs COSTS.json --rollers 2 --trainers 1 --lengths 8:4-8,2:60-64
    python bench/schedule_sim.py validate bench/results/modes_bench.json     # prediction vs measured, per mode
    python bench/schedule_sim.py plan --costs bench/sim_costs_example.json --gpus 8 16 64

``COSTS.json`` holds the fields of ``Costs``; ``validate`` reads the costs ``bench/modes_bench.py`` measured
(``calibration``) and its per-mode results.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path

MODES = ("sync", "one-step-off", "fully-async")
MACRO_CAP = 8  # fully-async: new groups and pauses are noticed within this many decode steps


@dataclass(frozen=True)
class Costs:
    """Measured (or, for the planner, assumed) costs; seconds. One roller = one engine (a GPU, or a CPU
    process with its threads); ``train_s_per_sample`` is for one trainer rank."""

    decode_base_s: float
    decode_per_seq_s: float
    train_s_per_sample: float
    max_batch_slots: int = 16
    group_overhead_s: float = 0.0
    train_step_overhead_s: float = 0.0
    train_comm_s: float = 0.0
    sync_s: float = 0.0
    sync_s_per_roller: float = 0.0

    def __post_init__(self):
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"costs.{f.name} must be >= 0, got {getattr(self, f.name)}")
        if self.max_batch_slots < 1:
            raise ValueError(f"costs.max_batch_slots must be >= 1, got {self.max_batch_slots}")

    @classmethod
    def from_dict(cls, d: dict) -> Costs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown cost keys {unknown}; accepted: {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True)
class Workload:
    """``prompts_per_step`` (B) groups of ``n`` samples per update; ``lengths``: response-length buckets
    ``(weight, min_tokens, max_tokens)`` (as ``rollout.forced_response_lengths``) or, with ``empirical``,
    a list of observed lengths drawn uniformly; the steady-state window runs from the end of update
    ``warmup_steps`` to the end of update ``num_steps - tail_steps`` (as ``bench/modes_runs.py``)."""

    prompts_per_step: int
    n: int
    lengths: tuple
    num_steps: int = 8
    max_staleness: int = 1
    warmup_steps: int = 1
    tail_steps: int = 0
    empirical: bool = False
    seed: int = 0

    def draw_length(self, rng: random.Random) -> int:
        if self.empirical:
            return rng.choice(self.lengths)
        _, low, high = rng.choices(self.lengths, weights=[b[0] for b in self.lengths])[0]
        return rng.randint(low, high)


def parse_lengths(spec: str) -> tuple:
    """``"8:4-8,2:60-64"`` → ``((8, 4, 8), (2, 60, 64))`` (weight:min-max, comma-separated); ValueError."""
    try:
        out = []
        for part in spec.split(","):
            weight, span = part.split(":")
            low, dash, high = span.partition("-")
            out.append((int(weight), int(low), int(high if dash else low)))
    except ValueError:
        raise ValueError(f"length spec {spec!r} must look like 8:4-8,2:60-64 (weight:min-max,...)") from None
    if not out or any(w < 1 or lo < 1 or hi < lo for w, lo, hi in out):
        raise ValueError(f"length spec {spec!r}: weights >= 1 and 1 <= min <= max")
    return tuple(out)


@dataclass
class SimResult:
    """Predicted outcome of one schedule; shares are of the steady-state window."""

    mode: str
    num_rollers: int
    num_trainers: int
    samples_per_s: float
    wall_s: float
    staleness_mean: float
    staleness_max: int
    trainer_idle_share: float
    roller_idle_share: float
    sync_share: float
    dropped_groups: int = 0


# ------------------------------------------------------------------------------------------ the engine


class _Signal:
    """Processes yield a signal to wait for its next ``fire()``."""

    def __init__(self, sim: _Sim):
        self.sim, self.waiters = sim, []

    def fire(self) -> None:
        waiters, self.waiters = self.waiters, []
        for proc in waiters:
            self.sim.schedule(0.0, proc)


class _Sim:
    def __init__(self):
        self.now, self._heap, self._seq = 0.0, [], 0

    def schedule(self, delay: float, proc) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay, self._seq, proc))

    def start(self, proc) -> None:
        self.schedule(0.0, proc)

    def run(self, until_done) -> None:
        while self._heap and not until_done():
            self.now, _, proc = heapq.heappop(self._heap)
            try:
                wait = next(proc)
            except StopIteration:
                continue
            if isinstance(wait, _Signal):
                wait.waiters.append(proc)
            else:
                self.schedule(float(wait), proc)


class _Seq:
    __slots__ = ("group", "remaining", "min_version")

    def __init__(self, group, length: int):
        self.group, self.remaining, self.min_version = group, length, None


class _Group:
    __slots__ = ("seqs", "left")

    def __init__(self, lengths: list[int]):
        self.seqs = [_Seq(self, L) for L in lengths]
        self.left = len(lengths)


class _World:
    """Shared state of one simulation: admitted groups, rollers' versions, completed groups, intervals."""

    def __init__(self, costs: Costs, wl: Workload, num_rollers: int, num_trainers: int):
        self.costs, self.wl, self.R, self.T = costs, wl, num_rollers, num_trainers
        self.sim = _Sim()
        self.rng = random.Random(wl.seed)
        self.pending: deque[_Group] = deque()
        self.ready: deque[_Group] = deque()
        self.work = _Signal(self.sim)       # groups admitted or a pause ended
        self.group_done = _Signal(self.sim)
        self.changed = _Signal(self.sim)    # a sync finished (fully-async admission)
        self.roller_version = [0] * num_rollers
        self.paused_until = 0.0
        self.version = 0
        self.synced = 0
        self.started = 0
        self.total_groups = wl.num_steps * wl.prompts_per_step
        self.done = False
        self.busy: list[list[tuple[float, float]]] = [[] for _ in range(num_rollers)]
        self.updates: list[tuple[float, float]] = []
        self.syncs: list[tuple[float, float]] = []
        self.lags: list[list[int]] = []
        self.dropped = 0

    def admit(self, k: int) -> None:
        k = min(k, self.total_groups - self.started)
        for _ in range(max(0, k)):
            self.pending.append(_Group([self.wl.draw_length(self.rng) for _ in range(self.wl.n)]))
        self.started += max(0, k)
        if k > 0:
            self.work.fire()

    def train_s(self, num_samples: int) -> float:
        c = self.costs
        return (c.train_step_overhead_s + num_samples * c.train_s_per_sample / self.T
                + (c.train_comm_s if self.T > 1 else 0.0))

    def sync_s(self) -> float:
        return self.costs.sync_s + self.costs.sync_s_per_roller * self.R

    # ------------------------------------------------------------------------------ processes

    def roller(self, r: int, macro_cap: int | None):
        """Decode in macro steps of k tokens (until the next sequence ends, at most ``macro_cap`` where
        work may arrive or a sync may pause mid-generation: fully-async), one event per macro step."""
        c, n = self.costs, self.wl.n
        max_groups = max(1, c.max_batch_slots // n)
        groups: list[_Group] = []
        while not self.done:
            while self.pending and len(groups) < max_groups:
                groups.append(self.pending.popleft())
            active = [s for g in groups for s in g.seqs if s.remaining > 0]
            if not active:
                yield self.work
                continue
            if self.sim.now < self.paused_until:
                yield self.paused_until - self.sim.now
                continue
            start, version = self.sim.now, self.roller_version[r]
            for s in active:
                if s.min_version is None:
                    s.min_version = version
            k = min(s.remaining for s in active)
            if macro_cap is not None:
                k = min(k, macro_cap)
            step = k * (c.decode_base_s + c.decode_per_seq_s * len(active))
            finished = []
            for s in active:
                s.remaining -= k
                if s.remaining == 0:
                    s.group.left -= 1
                    if s.group.left == 0:
                        finished.append(s.group)
            yield step + c.group_overhead_s * len(finished)
            self.busy[r].append((start, self.sim.now))
            for g in finished:
                groups.remove(g)
                self.ready.append(g)
            if finished:
                self.group_done.fire()

    def take(self, k: int, enforce_staleness: bool = False):
        """Wait for ``k`` complete groups (completion order); the batch goes to ``self.batch``. With
        ``enforce_staleness``, a group staler than ``max_staleness`` is dropped and re-issued."""
        self.batch = []
        while len(self.batch) < k:
            while not self.ready:
                yield self.group_done
            group = self.ready.popleft()
            if enforce_staleness and any(self.version - s.min_version > self.wl.max_staleness for s in group.seqs):
                self.dropped += 1
                self.pending.append(_Group([self.wl.draw_length(self.rng) for _ in range(self.wl.n)]))
                self.work.fire()
                continue
            self.batch.append(group)

    def update(self, batch: list[_Group]):
        start = self.sim.now
        lags = [self.version - s.min_version for g in batch for s in g.seqs]
        yield self.train_s(sum(len(g.seqs) for g in batch))
        self.updates.append((start, self.sim.now))
        self.lags.append(lags)
        self.version += 1

    def sync(self):
        start = self.sim.now
        self.paused_until = start + self.sync_s()
        yield self.sync_s()
        self.syncs.append((start, self.sim.now))
        self.synced = self.version
        self.roller_version = [self.version] * self.R
        self.work.fire()
        self.changed.fire()


def _sync_trainer(w: _World):
    B = w.wl.prompts_per_step
    for _ in range(w.wl.num_steps):
        w.admit(B)
        yield from w.take(B)
        yield from w.update(w.batch)
        yield from w.sync()
    w.done = True


def _one_step_off_trainer(w: _World):
    B, steps = w.wl.prompts_per_step, w.wl.num_steps
    w.admit(B)
    yield from w.take(B)
    batch = w.batch
    for k in range(steps):
        if k < steps - 1:
            w.admit(B)
        yield from w.update(batch)
        if k < steps - 1:
            yield from w.take(B)
            batch = w.batch
        yield from w.sync()
    w.done = True


def _admitter(w: _World):
    B, s = w.wl.prompts_per_step, w.wl.max_staleness
    while not w.done and w.started < w.total_groups:
        w.admit((s + w.synced + 1) * B - w.started)
        yield w.changed


def _fully_async_trainer(w: _World):
    B = w.wl.prompts_per_step
    for _ in range(w.wl.num_steps):
        yield from w.take(B, enforce_staleness=True)
        yield from w.update(w.batch)
        yield from w.sync()
    w.done = True


_TRAINERS = {"sync": _sync_trainer, "one-step-off": _one_step_off_trainer, "fully-async": _fully_async_trainer}


def _overlap(intervals, t0: float, t1: float) -> float:
    return sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in intervals)


def simulate(mode: str, costs: Costs, wl: Workload, num_rollers: int = 1, num_trainers: int = 1) -> SimResult:
    """Run one schedule to ``wl.num_steps`` updates; ValueError for an unknown mode or empty pools."""
    if mode not in _TRAINERS:
        raise ValueError(f"mode={mode!r} is not one of {list(MODES)}")
    if num_rollers < 1 or num_trainers < 1:
        raise ValueError(f"need >= 1 roller and trainer rank, got {num_rollers} and {num_trainers}")
    if not 0 <= wl.warmup_steps < wl.num_steps - wl.tail_steps or wl.tail_steps < 0:
        raise ValueError(f"need 0 <= warmup_steps={wl.warmup_steps} < num_steps={wl.num_steps} - "
                         f"tail_steps={wl.tail_steps}")
    w = _World(costs, wl, num_rollers, num_trainers)
    for r in range(num_rollers):
        w.sim.start(w.roller(r, MACRO_CAP if mode == "fully-async" else None))
    if mode == "fully-async":
        w.sim.start(_admitter(w))
    w.sim.start(_TRAINERS[mode](w))
    w.sim.run(lambda: w.done)
    last = wl.num_steps - wl.tail_steps
    t0 = w.updates[wl.warmup_steps - 1][1] if wl.warmup_steps else 0.0
    t1 = w.updates[last - 1][1]
    window = max(t1 - t0, 1e-12)
    samples = sum(len(lags) for lags in w.lags[wl.warmup_steps:last])
    lags = [x for step in w.lags[wl.warmup_steps:last] for x in step]
    sync_t = _overlap(w.syncs, t0, t1)
    roller_idle = sum(1 - _overlap(b, t0, t1) / window for b in w.busy) / num_rollers
    return SimResult(mode, num_rollers, num_trainers, samples / window, t1, sum(lags) / len(lags), max(lags),
                     1 - (_overlap(w.updates, t0, t1) + sync_t) / window, roller_idle, sync_t / window,
                     w.dropped)


# ------------------------------------------------------------------------------------------ validate, plan


def validate(results_path: Path) -> list[dict]:
    """Predict every measured (workload, mode) of a ``bench/modes_bench.py`` JSON with the costs it
    calibrated for that split; returns rows with measured and predicted samples/s and the relative error."""
    data = json.loads(results_path.read_text())
    rows = []
    for wl_name, wl_data in data["workloads"].items():
        spec = wl_data["sim_workload"]
        for mode, best in wl_data["best"].items():
            split = best["split"]
            cal = data["calibration"].get(f"{wl_name}/{split['key']}")
            if cal is None:
                continue
            wl = Workload(**{**spec, "lengths": tuple(spec["lengths"]),
                             "num_steps": best["num_steps"], "warmup_steps": best["warmup_steps"],
                             "tail_steps": best.get("tail_steps", 0)})
            pred = simulate(mode, Costs.from_dict(cal), wl, split["num_replicas"], 1)
            meas = best["samples_per_s"]
            rows.append({"workload": wl_name, "mode": mode, "split": split["key"], "measured_sps": meas,
                         "predicted_sps": pred.samples_per_s, "error": pred.samples_per_s / meas - 1,
                         "measured_staleness_max": best["staleness_max"],
                         "predicted_staleness_max": pred.staleness_max})
    return rows


def plan(costs: Costs, wl: Workload, gpus: int) -> dict[str, SimResult]:
    """The best split of ``gpus`` per schedule: async modes place R rollers and T = gpus − R trainer
    ranks on separate GPUs (R in eighths of the budget, or every R below 16 GPUs); sync may also colocate
    (every GPU serves both phases in turn, R = T = gpus)."""
    best: dict[str, SimResult] = {}
    grid = range(1, gpus) if gpus < 16 else sorted({max(1, gpus * i // 8) for i in range(1, 8)})
    for mode in MODES:
        options = [(r, gpus - r) for r in grid]
        if mode == "sync":
            options.append((gpus, gpus))
        for r, t in options:
            res = simulate(mode, costs, wl, r, t)
            if mode not in best or res.samples_per_s > best[mode].samples_per_s:
                best[mode] = res
    return best


def _workload_from_args(args) -> Workload:
    return Workload(args.prompts, args.n, parse_lengths(args.lengths), args.steps, args.max_staleness,
                    args.warmup_steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("simulate", "plan"):
        p = sub.add_parser(name)
        p.add_argument("--costs", required=True, help="JSON file with the fields of Costs")
        p.add_argument("--prompts", type=int, default=64, help="prompt groups per update (B)")
        p.add_argument("--n", type=int, default=8, help="samples per prompt")
        p.add_argument("--lengths", default="8:200-600,2:3000-4096", help="weight:min-max,... response tokens")
        p.add_argument("--steps", type=int, default=12)
        p.add_argument("--warmup-steps", type=int, default=2)
        p.add_argument("--max-staleness", type=int, default=1)
        if name == "simulate":
            p.add_argument("--rollers", type=int, default=1)
            p.add_argument("--trainers", type=int, default=1)
        else:
            p.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 64])
    v = sub.add_parser("validate")
    v.add_argument("results", type=Path, help="bench/results/modes_bench.json")
    args = parser.parse_args(argv)
    if args.cmd == "validate":
        rows = validate(args.results)
        print("| workload | mode | split | measured samples/s | predicted | error | staleness max meas/pred |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['workload']} | {r['mode']} | {r['split']} | {r['measured_sps']:.3f} | "
                  f"{r['predicted_sps']:.3f} | {r['error']:+.0%} | {r['measured_staleness_max']}/"
                  f"{r['predicted_staleness_max']} |")
        return
    costs = Costs.from_dict(json.loads(Path(args.costs).read_text()))
    wl = _workload_from_args(args)
    if args.cmd == "simulate":
        for mode in MODES:
            print(json.dumps(asdict(simulate(mode, costs, wl, args.rollers, args.trainers))))
        return
    print("| GPUs | mode | rollers | trainer ranks | samples/s | staleness mean/max | trainer idle | roller idle |")
    print("|---|---|---|---|---|---|---|---|")
    for g in args.gpus:
        for mode, r in plan(costs, wl, g).items():
            where = " (colocated)" if r.num_rollers + r.num_trainers > g else ""
            print(f"| {g} | {mode} | {r.num_rollers}{where} | {r.num_trainers} | {r.samples_per_s:.2f} | "
                  f"{r.staleness_mean:.2f}/{r.staleness_max} | {r.trainer_idle_share:.0%} | "
                  f"{r.roller_idle_share:.0%} |")


if __name__ == "__main__":
    sys.exit(main())
