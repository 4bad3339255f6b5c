"""``bench/agentic_bench.py``'s own logic, without running a job: its workload is a valid config whose turn
counts follow the long tail, the per-run metrics from a run directory and trajectory log, and the RESULT line."""

from __future__ import annotations

import json
import math

import pytest

from bench import agentic_bench
from bench.agentic_env import num_turns
from controller.config import load_config
from rollers.agent_loop import environment_seed


def test_workload_is_a_valid_multi_turn_config_with_room_for_every_turn(tmp_path):
    args = agentic_bench.parse_args(["--quick", "--out", str(tmp_path), "--turns", "8:1-2,2:5-9",
                                     "--turn-lengths", "1:4-10", "--tool-latency-s", "0.5"])
    # The window leaves out the drain: fully-async's last update, the roller idle, is faster than steady state.
    assert (args.steps, args.warmup_steps, args.tail_steps, args.reps, args.sweep) == (4, 1, 1, 1, "none")
    cfg = load_config(preset=agentic_bench.PRESET, overrides=agentic_bench.workload_overrides(args))
    r = cfg.rollout
    assert r.environment == agentic_bench.ENVIRONMENT and r.max_turns == 9
    assert r.env_kwargs == {"turns": "8:1-2,2:5-9", "tool_latency_s": 0.5, "log_dir": str(tmp_path / "env_log")}
    assert r.forced_response_lengths == [[1, 4, 10]]
    assert r.max_response_length == 9 * (10 + agentic_bench.OBSERVATION_TOKENS)


@pytest.mark.parametrize("argv", [["--turns", "1-2"], ["--turn-lengths", "0:1-2"], ["--modes", "one-step-off"],
                                  ["--tool-latency-s", "-1"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        agentic_bench.parse_args(argv)
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


def test_turns_follow_the_long_tail_and_only_the_seed():
    counts = [num_turns("8:1-2,2:8-12", environment_seed(0, f"s0.p{p}", i)) for p in range(100) for i in range(4)]
    assert counts == [num_turns("8:1-2,2:8-12", environment_seed(0, f"s0.p{p}", i)) for p in range(100) for i in range(4)]
    short = sum(c <= 2 for c in counts) / len(counts)
    assert 0.7 < short < 0.9 and set(counts) - {1, 2} <= set(range(8, 13)) and max(counts) >= 8


def _run_dir(tmp_path, steps):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return run_dir


def test_agentic_metrics_count_the_windows_turns_and_tool_wait(tmp_path):
    steps = [{"uids": [f"s{k}.p0"], "num_samples": 2, "response_clip_ratio": 0.5 if k == 2 else 0.0} for k in range(4)]
    run = {"run_dir": str(_run_dir(tmp_path, steps)), "warmup_steps": 1, "tail_steps": 1, "window_s": 10.0,
           "timeline": {"t0": 100.0, "t1": 110.0}}
    log = [{"start": 101.0, "end": 105.0, "tool_wait_s": 1.0}, {"start": 99.0, "end": 109.0, "tool_wait_s": 4.0},
           {"start": 105.0, "end": 111.0, "tool_wait_s": 6.0}]  # the last ends after the window: left out
    out = agentic_bench.agentic_metrics(run, "1:1-3", 7, 2, log)
    turns = [num_turns("1:1-3", environment_seed(7, f"s{k}.p0", i)) for k in (1, 2) for i in range(2)]
    assert out["turns_per_s"] == pytest.approx(sum(turns) / 10.0)
    assert out["turns_per_sample"] == pytest.approx(sum(turns) / 4)
    assert out["truncated_share"] == pytest.approx(0.25)  # one of the window's 4 samples
    assert out["tool_wait_share"] == pytest.approx(5.0 / 14.0) and out["num_logged_trajectories"] == 2


def test_result_line_and_table():
    summary = {"split": {"key": "r1x1-t1"}, "samples_per_s": 0.5, "spread_sps": [0.4, 0.6], "turns_per_s": 1.0,
               "turns_per_sample": 2.0, "update_share": 0.5, "trainer_idle_share": 0.4, "sync_share": 0.1,
               "roller_idle_share": 0.3, "tool_wait_share": 0.2, "staleness_mean": 0.5, "staleness_max": 1,
               "num_runs": 2}
    best = {"sync": dict(summary, samples_per_s=0.25, turns_per_s=0.8, staleness_max=0), "fully-async": summary}
    assert agentic_bench.result_line(best) == \
        "RESULT sync_sps=0.2500 fully_async_sps=0.5000 speedup=2.000 speedup_turns=1.250 max_staleness=1"
    assert "| fully-async | r1x1-t1 | 0.500 |" in agentic_bench.table(best)
    line = agentic_bench.result_line({"sync": {"error": "exit 1"}, "fully-async": summary})
    assert line.startswith("RESULT sync_sps=nan") and "speedup=nan" in line
    assert math.isnan(float(line.split("speedup=")[1].split()[0]))
