"""``hflow-async``: the command line.

    hflow-async [--mode {sync,one-step-off,fully-async}] [--preset NAME | --config FILE.yaml] [a.b=c ...]
    hflow-async show-config [--mode M] [--preset NAME | --config FILE.yaml] [a.b=c ...]
"""

from __future__ import annotations

import argparse
import sys

from controller.config import DEFAULT_PRESET, MODES, available_presets, load_config, to_yaml

EXIT_CONFIG_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hflow-async",
        description=(
            "Asynchronous RL post-training. Runs one job in one of three schedules: "
            "sync (generate, then train, then sync weights), one-step-off (generation of batch k+1 "
            "overlaps training on batch k), fully-async (rollers never stop; staleness bounded by "
            "admission control)."
        ),
        epilog=(
            "Commands: (none) runs the job; 'show-config' prints the resolved config and exits. "
            "Overrides are dotted keys, e.g. rollout.n=8 trainer.total_steps=20 run_dir=runs/x. "
            f"Presets: {', '.join(available_presets())} (default: {DEFAULT_PRESET})."
        ),
    )
    parser.add_argument("--mode", choices=MODES, default=None, help="the schedule (default: from the config)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help=f"a shipped preset: {', '.join(available_presets())}")
    source.add_argument("--config", default=None, metavar="FILE.yaml", help="a YAML config file")
    parser.add_argument("args", nargs="*", metavar="[show-config] key=value", help="command and overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    command, overrides = "run", list(args.args)
    if overrides and "=" not in overrides[0]:
        command = overrides.pop(0)
        if command not in ("run", "show-config"):
            print(f"hflow-async: unknown command {command!r}; accepted: run, show-config", file=sys.stderr)
            return EXIT_CONFIG_ERROR
    try:
        cfg = load_config(mode=args.mode, preset=args.preset, config_file=args.config, overrides=overrides)
    except ValueError as exc:
        print(f"hflow-async: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if command == "show-config":
        print(to_yaml(cfg), end="")
        return 0
    from controller.job import run_job

    return run_job(cfg)


if __name__ == "__main__":
    sys.exit(main())
