"""What a run leaves behind: per-step JSONL, a progress line per step, ``summary.json`` and a plot.

Every record comes from metadata the controller already holds (sample tags, counts, timings) and the
flat metrics dicts the trainers and rollers return.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console

# Keys every line of metrics.jsonl carries (issue: run outputs).
REQUIRED_STEP_KEYS = ("step", "reward_mean", "weight_version", "staleness_mean", "staleness_max", "samples_per_s")


def group_reward_stats(rewards_by_uid: dict[str, list[float]]) -> dict[str, float]:
    """Fractions of prompt groups whose rewards vary, and that have any correct (reward > 0) sample."""
    groups = [g for g in rewards_by_uid.values() if g]
    if not groups:
        return {"frac_groups_reward_variance": 0.0, "frac_groups_any_correct": 0.0}
    varied = sum(1 for g in groups if max(g) != min(g))
    correct = sum(1 for g in groups if max(g) > 0)
    return {"frac_groups_reward_variance": varied / len(groups), "frac_groups_any_correct": correct / len(groups)}


class RunReport:
    """Writes ``metrics.jsonl`` as steps complete and ``summary.json`` + ``plot.png`` at the end."""

    def __init__(self, run_dir: str | Path, total_steps: int, progress: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.steps: list[dict[str, Any]] = []
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._console = Console(highlight=False, soft_wrap=True) if progress else None
        self._t0 = time.monotonic()

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
        """Write ``summary.json`` (with run-level aggregates added) and ``plot.png``; returns the summary."""
        rewards = [s["reward_mean"] for s in self.steps]
        summary = {
            "num_steps": len(self.steps),
            "wall_s": time.monotonic() - self._t0,
            "reward_first": rewards[0] if rewards else math.nan,
            "reward_last": rewards[-1] if rewards else math.nan,
            "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
            "staleness_max": max((s["staleness_max"] for s in self.steps), default=0),
            **summary,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
        if self.steps:
            self._plot()
        if self._console is not None:
            brief = {k: v for k, v in summary.items() if not isinstance(v, dict | list)}
            self._console.print("summary: " + json.dumps(brief, default=float))
        return summary

    def _plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [s["step"] for s in self.steps]
        fig, (ax_r, ax_s) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
        ax_r.plot(steps, [s["reward_mean"] for s in self.steps], marker="o", label="reward mean")
        if all("accuracy" in s for s in self.steps):
            ax_r.plot(steps, [s["accuracy"] for s in self.steps], marker=".", label="accuracy")
        ax_r.set_ylabel("reward")
        ax_r.legend()
        ax_s.plot(steps, [s["staleness_mean"] for s in self.steps], marker="o", label="mean")
        ax_s.plot(steps, [s["staleness_max"] for s in self.steps], marker="x", label="max")
        ax_s.set_ylabel("staleness (versions)")
        ax_s.set_xlabel("trainer step")
        ax_s.legend()
        fig.tight_layout()
        fig.savefig(self.run_dir / "plot.png", dpi=100)
        plt.close(fig)

    def close(self) -> None:
        self._jsonl.close()
