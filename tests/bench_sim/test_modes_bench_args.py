"""``bench/modes_bench.py``'s own wiring, without running a job: split parsing, the sweep a mode gets, reading
a completed run again (``--reuse-runs``) and the TRL peer's spec (its imports broke once after a module
moved, which only a full run noticed)."""

from __future__ import annotations

import json
import math

import pytest

from bench import modes_bench
from controller.config import load_config


def test_split_items_form_each_modes_sweep_in_order():
    args = modes_bench.parse_args(["--split", "fully-async=r1x1-t1", "--split", "fully-async=r1x2-t2"])
    assert args.split == {"fully-async": [modes_bench.Split(1, 1, 1), modes_bench.Split(1, 2, 2)]}


def test_a_modes_candidate_splits_are_its_pinned_ones_else_its_sweep():
    pinned = modes_bench.parse_args(["--split", "fully-async=r1x1-t1"])
    assert modes_bench.candidate_splits("fully-async", pinned, 2) == [modes_bench.Split(1, 1, 1)]
    assert modes_bench.candidate_splits("sync", pinned, 2) == modes_bench.splits_for("sync", 2)
    assert len(modes_bench.splits_for("sync", 2)) > 1
    none = modes_bench.parse_args(["--sweep", "none"])
    assert modes_bench.candidate_splits("sync", none, 2) == modes_bench.splits_for("sync", 2)[:1]


def test_quick_leaves_the_drain_out_of_the_window():
    # fully-async's last update trains a backlog with the roller idle: faster than steady state (an agentic
    # run measured 0.466 samples/s with it in the window, 0.353 without).
    args = modes_bench.parse_args(["--quick"])
    assert (args.steps, args.warmup_steps, args.tail_steps, args.reps, args.sweep) == (4, 1, 1, 2, "none")
    assert (args.longtail_modes, args.longtail_reps) == (["sync", "fully-async"], 1)


@pytest.mark.parametrize("item", ["fully-async=r1x2", "nope=r1x1-t1", "sync=r0x1-t1", "sync"])
def test_a_malformed_split_is_a_usage_error_naming_it(item, capsys):
    with pytest.raises(SystemExit) as exc:
        modes_bench.parse_args(["--split", item])
    assert exc.value.code == 2
    assert repr(item) in capsys.readouterr().err


def test_a_mode_set_override_reaches_that_modes_runs_only(tmp_path, monkeypatch):
    args = modes_bench.parse_args(["--preset", "tiny", "--out", str(tmp_path), "--set", "rollout.n=2",
                                   "--mode-set", "fully-async:algorithm.max_staleness=2"])
    assert args.mode_set == {"fully-async": ["algorithm.max_staleness=2"]}
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return modes_bench.subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(modes_bench.subprocess, "run", fake_run)
    for mode in ("sync", "fully-async"):
        assert "error" in modes_bench.run_one("main", mode, modes_bench.Split(1, 1, 1), 0, args)
    sync_cmd, async_cmd = commands
    assert "rollout.n=2" in sync_cmd and "rollout.n=2" in async_cmd
    assert "algorithm.max_staleness=2" not in sync_cmd and async_cmd[-1] == "algorithm.max_staleness=2"


def test_a_bad_mode_set_value_fails_before_any_run():
    args = modes_bench.parse_args(["--preset", "tiny", "--mode-set", "fully-async:algorithm.max_staleness=-1"])
    modes_bench.check_mode_sets(modes_bench.parse_args(["--preset", "tiny"]), [])  # none given: nothing to fail
    with pytest.raises(ValueError, match="max_staleness"):
        modes_bench.check_mode_sets(args, [])


@pytest.mark.parametrize("item", ["fully-async=algorithm.max_staleness=2", "nope:rollout.n=2", "sync:rollout.n"])
def test_a_malformed_mode_set_is_a_usage_error_naming_it(item, capsys):
    with pytest.raises(SystemExit) as exc:
        modes_bench.parse_args(["--mode-set", item])
    assert exc.value.code == 2
    assert repr(item) in capsys.readouterr().err


def test_only_a_completed_run_of_the_same_length_is_reused(tmp_path):
    run = tmp_path / "run"
    assert modes_bench._completed_summary(run, 8) is None
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"status": "failed", "num_steps": 8}))
    assert modes_bench._completed_summary(run, 8) is None
    (run / "summary.json").write_text(json.dumps({"status": "completed", "num_steps": 3}))
    assert modes_bench._completed_summary(run, 8) is None
    (run / "summary.json").write_text(json.dumps({"status": "completed", "num_steps": 8}))
    assert modes_bench._completed_summary(run, 8) == {"status": "completed", "num_steps": 8}


def test_the_trl_peer_gets_the_jobs_own_prompts_and_settings(tmp_path, monkeypatch):
    import trl_peer

    seen, rates = {}, iter([1.0, 3.0, 2.0])

    def fake_run(spec, out_dir, timeout_s, log):
        seen.update(spec)
        out_dir.mkdir(parents=True)
        res = {"samples_per_s": next(rates), "tokens_per_s": 10.0, "window_s": 5.0, "wall_s": 9.0}
        (out_dir / "trl_result.json").write_text(json.dumps(res))
        return res

    monkeypatch.setattr(trl_peer, "run_trl", fake_run)
    args = modes_bench.parse_args(["--preset", "tiny", "--out", str(tmp_path), "--steps", "4", "--reps", "3"])
    cfg = load_config(preset="tiny")
    res = modes_bench.trl_peer(args, cfg, 2)  # --reps runs: their median and spread
    assert (res["samples_per_s"], res["spread_sps"], res["num_runs"]) == (2.0, [1.0, 3.0], 3)
    monkeypatch.setattr(trl_peer, "run_trl", lambda *a: pytest.fail("a completed TRL run is run again"))
    args.reuse_runs = True
    assert modes_bench.trl_peer(args, cfg, 2)["spread_sps"] == [1.0, 3.0]
    assert len(seen["records"]) == cfg.data.size
    assert (seen["n"], seen["prompts_per_step"], seen["num_steps"]) == (cfg.rollout.n, cfg.data.train_batch_size, 4)
    assert seen["num_threads"] == 2 and seen["max_response_length"] == cfg.rollout.max_response_length
    assert seen["forced_response_lengths"] == []  # the main workload: natural lengths
    reward_fn = trl_peer.build_reward(seen)  # what the worker in the TRL venv calls
    record = seen["records"][0]
    assert reward_fn("no answer here", record["ground_truth"]) == 0.0

    # The long tail: its own runs (--longtail-reps of them, not the main workload's), with our forced lengths.
    args = modes_bench.parse_args(["--preset", "tiny", "--out", str(tmp_path), "--steps", "4", "--reps", "3",
                                   "--longtail-reps", "1"])
    tail = load_config(preset="tiny", overrides=modes_bench.workload_overrides("longtail", args))
    rates = iter([4.0])
    monkeypatch.setattr(trl_peer, "run_trl", fake_run)
    assert modes_bench.trl_peer(args, tail, 2, "longtail")["num_runs"] == 1
    assert seen["forced_response_lengths"] == tail.rollout.forced_response_lengths != []
    assert seen["max_response_length"] == args.longtail_max


def test_the_limit_counts_generation_at_full_occupancy_and_training_alone():
    # One sync split (1 roller x 2 threads, trainer 2 threads), 4 samples per group: decode 0.1 s + 0.01 s per
    # sequence at 10 slots = 0.02 s per token per sequence, x 2 threads x 10 tokens = 0.4 core-s; overhead
    # 0.2 s per group on one core / 4 = 0.05 core-s; training 2 s per 4-sample step x 2 threads = 1.0 core-s.
    split = {"key": "r1x2-t2", "num_replicas": 1, "roller_threads": 2, "trainer_threads": 2}
    wl = {"runs": [{"mode": "sync", "split": split, "update_s": [2.0, 2.0, 9.0], "samples_per_step": 4}],
          "sim_workload": {"empirical": False, "lengths": [[3, 5, 5], [1, 25, 25]], "n": 4}}
    calibration = {"main/r1x2-t2": {"decode_base_s": 0.1, "decode_per_seq_s": 0.01, "max_batch_slots": 10,
                                    "group_overhead_s": 0.2}}
    lim = modes_bench.limit("main", wl, calibration, 2)
    assert lim["mean_response_tokens"] == pytest.approx(10.0)
    assert lim["core_s_per_sample_gen"] == pytest.approx(0.45)
    assert lim["core_s_per_sample_train"] == pytest.approx(1.0)
    assert lim["limit_sps"] == pytest.approx(2 / 1.45)
    assert math.isnan(modes_bench.limit("longtail", wl, calibration, 2)["limit_sps"])  # no costs measured there


def test_each_workload_reports_its_own_trl_runs():
    from bench import modes_report

    def best(sps):
        return {"split": {"key": "r1x2-t2"}, "samples_per_s": sps, "spread_sps": [sps, sps], "tokens_per_s": 1.0,
                "trainer_idle_share": 0.0, "roller_idle_share": 0.0, "sync_share": 0.0, "staleness_mean": 0.0,
                "staleness_max": 0, "window_s": 1.0, "wall_s": 2.0, "num_runs": 3}

    def trl(sps):
        return {"samples_per_s": sps, "spread_sps": [sps, sps], "tokens_per_s": 5.0, "window_s": 1.0, "wall_s": 2.0,
                "num_runs": 3}

    results = {"cores": 2, "workloads": {
        "main": {"best": {"sync": best(1.0), "fully-async": best(1.5)}, "runs": [], "limit": {"limit_sps": 2.0},
                 "trl": trl(1.25)},
        "longtail": {"best": {"sync": best(0.5), "fully-async": best(1.0)}, "runs": [], "limit": {"limit_sps": 1.5},
                     "trl": {"error": "skipped (--no-trl)"}}}}
    line = modes_report.result_line(results)
    assert "trl_sps=1.25 " in line and line.endswith("longtail_trl_sps=nan") and "longtail_speedup_fully_async=2 " in line
    results["workloads"]["longtail"]["trl"] = trl(0.4)
    assert modes_report.result_line(results).endswith("longtail_trl_sps=0.4")
    rows = [r for r in modes_report.table(results).splitlines() if r.startswith("| TRL GRPOTrainer")]
    assert [r.split(" | ")[2] for r in rows] == ["1.250 (1.250-1.250)", "0.400 (0.400-0.400)"]
