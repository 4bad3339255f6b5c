"""Experiment trackers: the scalars of ``metrics.jsonl`` also go to TensorBoard and/or Weights & Biases.

``metrics.tensorboard=true`` writes event files into ``RUN_DIR/tensorboard`` (``torch.utils.tensorboard``,
which needs the ``tensorboard`` package: ``pip install hflow-async[tensorboard]``); ``metrics.wandb=true``
logs to W&B (``pip install wandb``), in ``metrics.wandb_mode`` (``offline`` by default: files in
``RUN_DIR/wandb``, uploaded later with ``wandb sync``; ``WANDB_MODE`` in the environment wins, as W&B
documents). Neither is imported by a default run.

Tags: a trainer step's scalars as ``train/<key>`` at its ``step``; a validation round's keys are already
``val/<name>``, at the ``weight_version`` it evaluated. Lists, strings and booleans are not logged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric scalars of a metrics.jsonl record (ints and floats; not bools, lists or strings)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("step", "validation")}


def check_trackers(cfg) -> None:
    """Raise ValueError naming ``metrics.tensorboard`` / ``metrics.wandb`` and the package to install when
    a tracker ``cfg`` (``MetricsConfig``) turns on cannot be imported (checked before the run starts)."""
    if cfg.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as exc:
            raise ValueError("metrics.tensorboard=true needs the tensorboard package: pip install "
                             f"tensorboard (or hflow-async[tensorboard]); {exc}") from exc
    if cfg.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError as exc:
            raise ValueError("metrics.wandb=true needs the wandb package: pip install wandb "
                             f"(or hflow-async[wandb]); {exc}") from exc


class Trackers:
    """The trackers ``cfg`` (``MetricsConfig``) turns on, for ``run_dir``; ``config``: the resolved config
    as a dict (W&B's run config). Raises ValueError naming ``metrics.tensorboard`` / ``metrics.wandb`` and
    the package to install when a tracker's library is missing."""

    def __init__(self, cfg, run_dir: str | Path, config: dict[str, Any] | None = None):
        self._tb = self._wandb = None
        run_dir = Path(run_dir)
        check_trackers(cfg)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))
        if cfg.wandb:
            import wandb

            (run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(project=cfg.wandb_project, dir=str(run_dir), name=run_dir.name,
                                     mode=cfg.wandb_mode, config=config or {})
            self._wandb.define_metric("step")
            self._wandb.define_metric("train/*", step_metric="step")
            self._wandb.define_metric("val_step")
            self._wandb.define_metric("val/*", step_metric="val_step")

    def log(self, record: dict[str, Any]) -> None:
        """Log one metrics.jsonl record: a trainer step, or a validation round (``"validation": true``)."""
        step = int(record["step"])
        values = scalars(record)
        prefix = "val/" if record.get("validation") else "train/"
        values = {k if k.startswith(prefix) else prefix + k: v for k, v in values.items()}
        if self._tb is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log({**values, "val_step" if record.get("validation") else "step": step})

    def close(self) -> None:
        """Flush and close every tracker (idempotent)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
