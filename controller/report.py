"""What a run leaves behind: per-step JSONL, a progress line per step, ``summary.json`` and a plot.

Every record comes from metadata the controller already holds (sample tags, counts, timings) and the
flat metrics dicts the trainers and rollers return.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from common import schema
from controller.ledger import staleness

# Keys every line of metrics.jsonl carries (issue: run outputs).
REQUIRED_STEP_KEYS = ("step", "reward_mean", "weight_version", "staleness_mean", "staleness_max", "samples_per_s")


# Run-level keys every summary.json carries, whatever the outcome (null where unknown): what the run is,
# how it ended, and the schedule's counters (``controller/job.py``). ``roller_joins``: one row per roller
# that joined while the run went on (``controller.pool_keeper``: roller, reason, join_to_active_s,
# join_to_first_trained_s).
ABOUT_KEYS = ("status", "error", "mode", "model", "task", "model_dir", "threads")
COUNT_KEYS = ("num_syncs", "num_groups_admitted", "num_groups_generated", "num_failed_groups",
              "num_dropped_groups", "num_zero_variance_groups", "weight_version", "frac_groups_reward_variance",
              "frac_groups_any_correct", "num_rollers_lost", "num_roller_restarts", "num_reissued_groups",
              "roller_joins")
STEP_SUMMARY_KEYS = ("num_steps", "wall_s", "reward_first", "reward_last", "reward_mean", "staleness_max")
# Seconds from the job's start until its pools were up, and stopping pools and Ray after the last step (the
# job writes the summary, then shuts down, then adds shutdown_s and the final wall_s: ``RunReport.amend``).
# startup_breakdown_s: the parts of startup_s (controller/job.py); threads: the pools' torch threads.
TIME_KEYS = ("startup_s", "shutdown_s", "startup_breakdown_s")
# Held-out accuracy of the validation rounds (controller.validation), null without data.val_size: sampled
# (pass@1 at rollout.temperature) and greedy, at the first round, the best one and the last one, and the
# weight_version of the best (sampled) one.
VAL_METRICS = ("accuracy", "accuracy_greedy")
VAL_SUMMARY_KEYS = ("num_val_rounds", "val_best_weight_version",
                    *(f"val_{m}_{at}" for m in VAL_METRICS for at in ("first", "best", "last")))
SUMMARY_KEYS = STEP_SUMMARY_KEYS + TIME_KEYS + ABOUT_KEYS + COUNT_KEYS + VAL_SUMMARY_KEYS


def validation_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """``VAL_SUMMARY_KEYS`` from the validation records in the order they were logged (None where unknown)."""
    out: dict[str, Any] = dict.fromkeys(VAL_SUMMARY_KEYS)
    out["num_val_rounds"] = len(rounds)
    rounds = sorted(rounds, key=lambda r: r["weight_version"])
    for metric in VAL_METRICS:
        values = [(r[f"val/{metric}"], r["weight_version"]) for r in rounds if f"val/{metric}" in r]
        if values:
            best = max(values, key=lambda v: v[0])
            out.update({f"val_{metric}_first": values[0][0], f"val_{metric}_best": best[0],
                        f"val_{metric}_last": values[-1][0]})
            if metric == "accuracy":
                out["val_best_weight_version"] = best[1]
    return out


def group_reward_stats(rewards_by_uid: dict[str, list[float]]) -> dict[str, float | None]:
    """Fractions of prompt groups whose rewards vary, and that have any correct (reward > 0) sample;
    ``None`` for both without any group."""
    groups = [g for g in rewards_by_uid.values() if g]
    if not groups:
        return {"frac_groups_reward_variance": None, "frac_groups_any_correct": None}
    varied = sum(1 for g in groups if max(g) != min(g))
    correct = sum(1 for g in groups if max(g) > 0)
    return {"frac_groups_reward_variance": varied / len(groups), "frac_groups_any_correct": correct / len(groups)}


CORRECT = 0.999  # a sample counts as correct when its reward reaches this (rewards are in [0, 1])


def step_record(tags: list[dict], trained_from: int, wall_s: float, step_s: float, wait_s: float
                ) -> tuple[dict[str, Any], dict[str, list[float]], list[int], list[int]]:
    """The record of the trainer step whose update started from ``weight_version`` ``trained_from`` (its
    ``step`` and the ``weight_version`` it made are both ``trained_from + 1``) from its samples' tags
    (``common.schema.CONTROLLER``): ``(record, rewards by uid, staleness per sample, response length per
    sample)``. Staleness: ``controller.ledger.staleness`` from ``trained_from``; ``wall_s``: seconds since the
    previous step ended; ``step_s``/``wait_s``: the update's and the wait for data."""
    stalenesses = [staleness(trained_from, t[schema.MIN_WEIGHT_VERSION]) for t in tags]
    rewards = [float(t[schema.REWARD]) for t in tags]
    lengths = [int(t[schema.RESPONSE_LENGTH]) for t in tags]
    by_uid: dict[str, list[float]] = {}
    for t, r in zip(tags, rewards, strict=True):
        by_uid.setdefault(t[schema.UID], []).append(r)
    record = {
        "step": trained_from + 1,
        "weight_version": trained_from + 1,
        "reward_mean": sum(rewards) / len(rewards),
        "accuracy": sum(r >= CORRECT for r in rewards) / len(rewards),
        "staleness_mean": sum(stalenesses) / len(stalenesses),
        "staleness_max": max(stalenesses),
        "samples_per_s": len(tags) / wall_s,
        "step_s": step_s,
        "wait_s": wait_s,
        "num_samples": len(tags),
        "num_groups": len(by_uid),
        "multi_version_samples": sum(t[schema.MIN_WEIGHT_VERSION] != t[schema.MAX_WEIGHT_VERSION] for t in tags),
        "response_length_mean": sum(lengths) / len(lengths),
        "response_clip_ratio": sum(t[schema.FINISH_REASON] == "length" for t in tags) / len(tags),
        "response_lengths": lengths,
        "uids": sorted(by_uid),
        "responses_digest": responses_digest(tags),
        **group_reward_stats(by_uid),
    }
    return record, by_uid, stalenesses, lengths


def responses_digest(tags: list[dict]) -> str:
    """One digest of a step's responses, independent of sample order (for run-to-run parity)."""
    import hashlib

    from common import schema

    items = sorted(f"{t[schema.UID]}:{t.get(schema.RESPONSE_DIGEST, '')}" for t in tags)
    return hashlib.blake2b("|".join(items).encode(), digest_size=8).hexdigest()


async def write_timeline(run_dir: Path, timeline: dict[str, list], pool) -> dict:
    """Write ``RUN_DIR/timeline.json`` and return it: ``timeline``'s ``update`` and ``sync`` (the trainer's
    updates and the weight syncs) and ``rollers`` (name → the busy intervals of each live roller of ``pool``,
    >= 1 request in flight), each a list of ``[start, end]`` wall-clock seconds (``time.time()``).
    ``bench/modes_bench.py`` reads it for idle shares and its timeline plot."""
    import asyncio

    members = pool.live()
    intervals = await asyncio.gather(*(pool.call(m, "busy_intervals") for m in members))
    out = {**timeline, "rollers": {m.name: iv for m, iv in zip(members, intervals, strict=True)}}
    (run_dir / "timeline.json").write_text(json.dumps(out) + "\n")
    return out


class RunReport:
    """Writes ``metrics.jsonl`` as steps complete and ``summary.json`` + ``plot.png`` at the end
    (``finish``; ``amend`` adds what is known only after it, ``announce`` prints it)."""

    def __init__(self, run_dir: str | Path, total_steps: int, progress: bool = True, trackers=None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.trackers = trackers  # controller.trackers.Trackers, or None
        self.steps: list[dict[str, Any]] = []
        self.validations: list[dict[str, Any]] = []  # validation records (``"validation": true``)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._console = Console(highlight=False, soft_wrap=True) if progress else None
        self._t0 = time.monotonic()
        self._summary: dict[str, Any] | None = None  # as last written to summary.json

    def log_step(self, record: dict[str, Any]) -> None:
        """Append one trainer step; raises ValueError when a required key is missing."""
        missing = [k for k in REQUIRED_STEP_KEYS if k not in record]
        if missing:
            raise ValueError(f"step record lacks {missing}")
        self.steps.append(record)
        self._jsonl.write(json.dumps(record, default=float) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)
        if self._console is not None:
            acc = record.get("accuracy", float("nan"))
            self._console.print(
                f"step {record['step']:>3}/{self.total_steps} | v{record['weight_version']:<3} | "
                f"reward {record['reward_mean']:.3f} | acc {acc:.3f} | staleness "
                f"{record['staleness_mean']:.2f}/{record['staleness_max']} | "
                f"{record['samples_per_s']:.1f} samples/s | step {record.get('step_s', float('nan')):.1f}s"
            )

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Take back the ``metrics.jsonl`` rows kept from before a resume or a restart (already in the file):
        validation rounds (``"validation": true``) to ``validations``, trainer steps to ``steps``."""
        for row in rows:
            (self.validations if row.get("validation") else self.steps).append(row)

    def rewind(self, step: int) -> list[dict[str, Any]]:
        """Forget the steps after ``step`` (a trainer restart from that step's checkpoint trains them again):
        ``metrics.jsonl`` keeps the rows up to it and moves the others to ``metrics.superseded.jsonl``
        (``controller.job_checkpoint.truncate_metrics``); returns the step records forgotten."""
        from controller.job_checkpoint import truncate_metrics

        self._jsonl.close()
        try:
            truncate_metrics(self.run_dir, step)
        finally:
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        forgotten = [r for r in self.steps if r["step"] > step]
        self.steps = [r for r in self.steps if r["step"] <= step]
        self.validations = [r for r in self.validations if r["step"] <= step]  # as truncate_metrics moved them
        return forgotten

    def log_validation(self, record: dict[str, Any]) -> None:
        """Append one validation round (``controller.validation.validation_record``) to metrics.jsonl,
        marked ``"validation": true``; raises ValueError when it lacks ``weight_version``."""
        if not record.get("validation") or "weight_version" not in record:
            raise ValueError(f"validation record lacks 'validation': true or weight_version: {sorted(record)}")
        self.validations.append(record)
        self._jsonl.write(json.dumps(record, default=float) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)
        if self._console is not None:
            nan = float("nan")
            self._console.print(
                f"validation v{record['weight_version']:<3} | acc {record.get('val/accuracy', nan):.3f} sampled, "
                f"{record.get('val/accuracy_greedy', nan):.3f} greedy | reward {record.get('val/reward_mean', nan):.3f}"
                f" | {record['val/num_prompts']} prompts")

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write ``summary.json`` and ``plot.png``; returns the summary: every key of ``SUMMARY_KEYS``
        (``None`` where neither the steps nor ``summary`` tell), then the rest of ``summary``."""
        rewards = [s["reward_mean"] for s in self.steps]
        summary = {
            "num_steps": len(self.steps),
            "wall_s": time.monotonic() - self._t0,
            "reward_first": rewards[0] if rewards else None,
            "reward_last": rewards[-1] if rewards else None,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "staleness_max": max((s["staleness_max"] for s in self.steps), default=None),
            **dict.fromkeys(TIME_KEYS + ABOUT_KEYS + COUNT_KEYS),
            **validation_summary(self.validations),
            **summary,
        }
        self._write(summary)
        if self.steps:
            fig = plot_steps(self.steps, summary, self.total_steps, self.validations)
            import matplotlib.pyplot as plt  # after plot_steps chose the Agg backend

            fig.savefig(self.run_dir / "plot.png", dpi=100)
            plt.close(fig)
        return summary

    def amend(self, **keys: Any) -> None:
        """Update ``keys`` in the ``summary.json`` that ``finish`` wrote (values known only after it, such
        as ``shutdown_s``); raises RuntimeError before ``finish``."""
        if self._summary is None:
            raise RuntimeError("RunReport.amend before finish: no summary.json yet")
        self._write({**self._summary, **keys})

    def announce(self) -> None:
        """Print the summary as last written, in one line (its scalar keys), when progress lines are on."""
        if self._console is not None and self._summary is not None:
            brief = {k: v for k, v in self._summary.items() if not isinstance(v, dict | list)}
            self._console.print("summary: " + json.dumps(brief, default=float))

    def _write(self, summary: dict[str, Any]) -> None:
        self._summary = summary
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")

    def close(self) -> None:
        self._jsonl.close()
        if self.trackers is not None:
            self.trackers.close()


def plot_steps(steps: list[dict[str, Any]], summary: dict[str, Any], total_steps: int,
               validations: list[dict[str, Any]] = ()):
    """The figure of ``plot.png`` (a matplotlib Figure; the caller saves and closes it): reward, accuracy
    (when every step has it), held-out accuracy (with ``validations``: sampled and greedy per evaluated
    weight_version, on the step axis) and staleness per step, one panel each, titled with mode, model and task
    from ``summary``. Reward and accuracy axes span at least [0, 1] (noise stays small), staleness axes
    whole versions from 0, step ticks whole steps. ``steps``: step records (``REQUIRED_STEP_KEYS``), not empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [s["step"] for s in steps]
    series = [("reward mean", [s["reward_mean"] for s in steps])]
    if all("accuracy" in s for s in steps):
        series.append(("accuracy (share correct)", [s["accuracy"] for s in steps]))
    held_out = sorted(validations, key=lambda r: r["weight_version"])
    if held_out:
        series.append(("held-out accuracy", None))
    fig, axes = plt.subplots(len(series) + 1, 1, figsize=(8, 2.2 * (len(series) + 1) + 0.8), sharex=True)
    for ax, (label, values) in zip(axes, series, strict=False):
        if values is None:  # validation: one line per kind, at the weight_version each round evaluated
            values = []
            for key, kind in (("val/accuracy", "sampled (pass@1)"), ("val/accuracy_greedy", "greedy")):
                points = [(r["weight_version"], r[key]) for r in held_out if key in r]
                if points:
                    ax.plot(*zip(*points, strict=True), marker="s", markersize=3, label=kind)
                    values += [p[1] for p in points]
            ax.legend(loc="best")
        else:
            ax.plot(x, values, marker="o", markersize=3)
        low, high = min(0.0, min(values)), max(1.0, max(values))
        pad = 0.05 * (high - low)
        ax.set_ylim(low - pad, high + pad)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_s = axes[-1]
    ax_s.plot(x, [s["staleness_mean"] for s in steps], marker="o", markersize=3, label="mean")
    ax_s.plot(x, [s["staleness_max"] for s in steps], marker="x", linestyle="--", label="max")
    ax_s.set_ylim(-0.25, max(1, max(s["staleness_max"] for s in steps)) + 0.25)
    ax_s.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_s.set_ylabel("staleness (versions)")
    ax_s.set_xlabel("trainer step")
    ax_s.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_s.legend(loc="best")
    ax_s.grid(alpha=0.3)
    about = " · ".join(str(summary[k]) for k in ("mode", "model", "task") if summary.get(k) is not None)
    ended = f"{summary.get('status') or 'run'}: {len(steps)} of {total_steps} steps"
    fig.suptitle(f"{about}\n{ended}" if about else ended, fontsize=10)
    fig.tight_layout()
    return fig
