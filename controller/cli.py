"""``hflow-async``: the command line.

    hflow-async [run] [--mode {sync,one-step-off,fully-async}] [--preset NAME | --config FILE.yaml] [a.b=c ...]
    hflow-async --resume RUN_DIR [--resume-step N] [a.b=c ...]
    hflow-async show-config [--describe] [--mode M] [--preset NAME | --config FILE.yaml] [a.b=c ...]
    hflow-async export RUN_DIR [--step N] [--out DIR]
    hflow-async scale [--rollers N] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from controller.config import DEFAULT_PRESET, available_presets, load_config, to_yaml
from controller.job_checkpoint import find_checkpoint
from controller.schedules import SCHEDULES

EXIT_CONFIG_ERROR = 2
_STEP_DIR = re.compile(r"step_(\d+)")


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
            "Commands: 'run' (the default: no command) runs the job; 'show-config' prints the resolved config "
            "and exits ('show-config --describe': each key with a one-line description); "
            "'export RUN_DIR [--step N] [--out DIR]' writes a trainer checkpoint of a run as a Hugging Face "
            "model directory (see 'hflow-async export --help'); 'scale --rollers N [--run-dir DIR]' resizes "
            "the roller pool of a running job (see 'hflow-async scale --help'). "
            "Overrides are dotted keys, e.g. rollout.n=8 trainer.total_steps=20 run_dir=runs/x. "
            f"Presets: {', '.join(available_presets())} (default: {DEFAULT_PRESET})."
        ),
    )
    parser.add_argument("--mode", choices=SCHEDULES.names(), default=None, help="the schedule (default: from the config)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help=f"a shipped preset: {', '.join(available_presets())}")
    source.add_argument("--config", default=None, metavar="FILE.yaml", help="a YAML config file")
    parser.add_argument("--resume", default=None, metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its latest job checkpoint (its config.yaml, plus "
                             "overrides that keep the run's promises: steps, logging, pool sizes)")
    parser.add_argument("--resume-step", type=int, default=None, metavar="N",
                        help="with --resume: the job checkpoint of trainer step N instead of the latest")
    parser.add_argument("--describe", action="store_true",
                        help="with show-config: each key followed by its one-line description (a YAML comment)")
    parser.add_argument("args", nargs="*", metavar="[run | show-config] key=value",
                        help="a command (default: run) and config overrides")
    return parser


def _export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hflow-async export",
        description=(
            "Write the policy of a trainer checkpoint (RUN_DIR/checkpoints/step_N, kept every "
            "trainer.save_every steps) as a Hugging Face model directory: safetensors, config, tokenizer and "
            "chat template, loadable as model.path=DIR, by transformers and by an SGLang server. A run that "
            "completes writes its final policy to RUN_DIR/model by itself."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds config.yaml and checkpoints/)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's trainer step (default: the latest)")
    parser.add_argument("--out", default=None, metavar="DIR", help="where to write (default: RUN_DIR/model_step_N)")
    return parser


def export(argv: list[str]) -> int:
    """``hflow-async export``: 0 after writing the model directory; 2 (message on stderr) when the run
    directory, its config, the checkpoint or the output directory is not as needed."""
    args = _export_parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        cfg = load_config(config_file=str(run_dir / "config.yaml"))
        found = {int(m.group(1)): p for p in (run_dir / "checkpoints").glob("step_*")
                 if (m := _STEP_DIR.fullmatch(p.name)) and (p / ".metadata").is_file()}
        if not found:
            raise ValueError(f"{run_dir} has no trainer checkpoint (checkpoints/step_N, written every "
                             f"trainer.save_every steps; it was {cfg.trainer.save_every}); a completed run's "
                             f"final policy is already in {run_dir / 'model'}")
        step = max(found) if args.step is None else args.step
        if step not in found:
            raise ValueError(f"--step {step}: {run_dir} has checkpoints of steps {sorted(found)}")
        out = Path(args.out) if args.out else run_dir / f"model_step_{step}"
        if out.exists():
            raise ValueError(f"{out} exists; name another directory with --out")
    except ValueError as exc:
        print(f"hflow-async export: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from trainers.export import export_checkpoint

    export_checkpoint(found[step], cfg.model, out)
    print(f"hflow-async export: step {step} of {run_dir} written to {out} (use it as model.path={out})")
    return 0


def _scale_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hflow-async scale",
        description=(
            "Resize the roller pool of a running job through its admin endpoint (loopback; the token is "
            "RUN_DIR/admin_token, owner-only). New rollers join with the trainer's current weights before "
            "they take work; removed ones (the oldest first) drain: no new group, held groups finished or "
            "handed back and re-issued. Answers once done, with the pool's state. Without --rollers: the "
            "pool's state only."
        ),
    )
    parser.add_argument("--rollers", type=int, default=None, metavar="N",
                        help="active rollers wanted (1 .. rollers.max_replicas)")
    parser.add_argument("--run-dir", default=None, metavar="DIR",
                        help="the running job's run directory (default: the newest under runs/ with a job running)")
    return parser


def _running_run_dir() -> Path:
    from controller.admin import ADDRESS_FILE

    found = sorted(Path("runs").glob(f"*/{ADDRESS_FILE}"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ValueError("no running job under runs/ (no runs/*/admin.json); name one with --run-dir DIR")
    return found[-1].parent


def scale(argv: list[str]) -> int:
    """``hflow-async scale``: 0 with the pool's state printed as JSON; 2 (message on stderr) when there is no
    job to ask, the token is refused or the request is bad."""
    import json

    from controller.admin import AdminError, pool_state, request_scale

    args = _scale_parser().parse_args(argv)
    try:
        run_dir = Path(args.run_dir) if args.run_dir else _running_run_dir()
        state = pool_state(run_dir) if args.rollers is None else request_scale(run_dir, args.rollers)
    except (AdminError, ValueError) as exc:
        print(f"hflow-async scale: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(json.dumps(state, indent=2))
    return 0


def _check_flags(args: argparse.Namespace, command: str, overrides: list[str]) -> str | None:
    """What is wrong with flags that contradict each other or the command (None when nothing is)."""
    modes = [item.partition("=")[2] for item in overrides if item.partition("=")[0].strip() == "mode"]
    if args.mode is not None and any(m != args.mode for m in modes):
        return (f"--mode {args.mode} conflicts with the override mode={modes[-1]}; give the mode once "
                "(either --mode or mode=)")
    if args.describe and command != "show-config":
        return "--describe goes with show-config (hflow-async show-config --describe)"
    if args.resume_step is not None and args.resume is None:
        return "--resume-step goes with --resume RUN_DIR"
    if args.resume is not None and (args.preset or args.config):
        return "--resume takes the run's config from RUN_DIR/config.yaml; drop --preset/--config"
    if args.resume is not None and not (Path(args.resume) / "config.yaml").is_file():
        return f"--resume {args.resume}: no run there (no {Path(args.resume) / 'config.yaml'})"
    if args.resume is not None and command == "run":
        # Here, not only in the job's own check (job_checkpoint.prepare_resume): that one runs after Ray and
        # the pools' libraries load, minutes on a loaded machine, for an answer these files give at once.
        try:
            find_checkpoint(args.resume, args.resume_step)
        except ValueError as exc:
            return f"cannot start: {exc}"  # the words of the job's own check
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # A user's plug-in or reward module in the current directory is importable as `module:name`, as under
    # `python -m` (the job also hands this directory to its Ray workers: job.make_user_modules_importable).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if argv[:1] == ["export"]:
        return export(argv[1:])
    if argv[:1] == ["scale"]:
        return scale(argv[1:])
    args = _parser().parse_intermixed_args(argv)
    command, overrides = "run", list(args.args)
    if overrides and "=" not in overrides[0]:
        command = overrides.pop(0)
        if command == "scale":
            print("hflow-async: 'scale' takes no --mode/--preset/--config and comes first: "
                  "hflow-async scale --rollers N [--run-dir DIR]", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        if command == "export":
            print("hflow-async: 'export' takes no --mode/--preset/--config and comes first: "
                  "hflow-async export RUN_DIR [--step N] [--out DIR]", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        if command not in ("run", "show-config"):
            print(f"hflow-async: unknown command {command!r}; accepted: run, show-config, export, scale",
                  file=sys.stderr)
            return EXIT_CONFIG_ERROR
    problem = _check_flags(args, command, overrides)
    if problem:
        print(f"hflow-async: {problem}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.resume is not None:
        args.config, overrides = str(Path(args.resume) / "config.yaml"), [*overrides, f"run_dir={args.resume}"]
    try:
        cfg = load_config(mode=args.mode, preset=args.preset, config_file=args.config, overrides=overrides)
    except ValueError as exc:
        print(f"hflow-async: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if command == "show-config":
        if args.describe:
            from controller.config_docs import to_described_yaml

            print(to_described_yaml(cfg), end="")
        else:
            print(to_yaml(cfg), end="")
        return 0
    from controller.job import run_job

    return run_job(cfg, resume=args.resume is not None, resume_step=args.resume_step)


if __name__ == "__main__":
    sys.exit(main())
