"""The main job: set up the environment, start the pools, run the chosen schedule."""

from __future__ import annotations

import sys

from controller.config import HFlowConfig

EXIT_NOT_BUILT = 3


def run_job(cfg: HFlowConfig) -> int:
    """Run ``cfg`` to completion; returns the process exit code."""
    print(
        f"hflow-async: mode {cfg.mode!r} resolved, but the schedules are not built yet "
        "(controller issue); nothing was trained.",
        file=sys.stderr,
    )
    return EXIT_NOT_BUILT
