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

# Keys every line of metrics.jsonl carries (issue: run outputs).
REQUIRED_STEP_KEYS = ("step", "reward_mean", "weight_version", "staleness_mean", "staleness_max", "samples_per_s")


# Run-level keys every summary.json carries, whatever the outcome (null where unknown): what the run is,
# how it ended, and the schedule's counters (``controller/job.py``).
ABOUT_KEYS = ("status", "error", "mode", "model", "task", "model_dir")
COUNT_KEYS = ("num_syncs", "num_groups_admitted", "num_groups_generated", "num_failed_groups",
              "num_dropped_groups", "num_zero_variance_groups", "weight_version", "frac_groups_reward_variance",
              "frac_groups_any_correct", "num_rollers_lost", "num_roller_restarts", "num_reissued_groups")
STEP_SUMMARY_KEYS = ("num_steps", "wall_s", "reward_first", "reward_last", "reward_mean", "staleness_max")
# Seconds from the job's start until its pools were up, and stopping pools and Ray after the last step (the
# job writes the summary, then shuts down, then adds shutdown_s and the final wall_s: ``RunReport.amend``).
TIME_KEYS = ("startup_s", "shutdown_s")
SUMMARY_KEYS = STEP_SUMMARY_KEYS + TIME_KEYS + ABOUT_KEYS + COUNT_KEYS


def group_reward_stats(rewards_by_uid: dict[str, list[float]]) -> dict[str, float | None]:
    """Fractions of prompt groups whose rewards vary, and that have any correct (reward > 0) sample;
    ``None`` for both without any group."""
    groups = [g for g in rewards_by_uid.values() if g]
    if not groups:
        return {"frac_groups_reward_variance": None, "frac_groups_any_correct": None}
    varied = sum(1 for g in groups if max(g) != min(g))
    correct = sum(1 for g in groups if max(g) > 0)
    return {"frac_groups_reward_variance": varied / len(groups), "frac_groups_any_correct": correct / len(groups)}


class RunReport:
    """Writes ``metrics.jsonl`` as steps complete and ``summary.json`` + ``plot.png`` at the end
    (``finish``; ``amend`` adds what is known only after it, ``announce`` prints it)."""

    def __init__(self, run_dir: str | Path, total_steps: int, progress: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.steps: list[dict[str, Any]] = []
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
        if self._console is not None:
            acc = record.get("accuracy", float("nan"))
            self._console.print(
                f"step {record['step']:>3}/{self.total_steps} | v{record['weight_version']:<3} | "
                f"reward {record['reward_mean']:.3f} | acc {acc:.3f} | staleness "
                f"{record['staleness_mean']:.2f}/{record['staleness_max']} | "
                f"{record['samples_per_s']:.1f} samples/s | step {record.get('step_s', float('nan')):.1f}s"
            )

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
            **summary,
        }
        self._write(summary)
        if self.steps:
            fig = plot_steps(self.steps, summary, self.total_steps)
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


def plot_steps(steps: list[dict[str, Any]], summary: dict[str, Any], total_steps: int):
    """The figure of ``plot.png`` (a matplotlib Figure; the caller saves and closes it): reward, accuracy
    (when every step has it) and staleness per step, one panel each, titled with mode, model and task
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
    fig, axes = plt.subplots(len(series) + 1, 1, figsize=(8, 2.2 * (len(series) + 1) + 0.8), sharex=True)
    for ax, (label, values) in zip(axes, series, strict=False):
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
