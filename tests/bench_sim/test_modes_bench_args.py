"""``bench/modes_bench.py``'s own wiring, without running a job: split parsing, the sweep a mode gets, reading
a completed run again (``--reuse-runs``) and the TRL peer's spec (its imports broke once after a module
moved, which only a full run noticed)."""

from __future__ import annotations

import json

import pytest

from bench import modes_bench
from controller.config import load_config


def test_split_items_form_each_modes_sweep_in_order():
    args = modes_bench.parse_args(["--split", "fully-async=r1x1-t1", "--split", "fully-async=r1x2-t2"])
    assert args.split == {"fully-async": [modes_bench.Split(1, 1, 1), modes_bench.Split(1, 2, 2)]}


@pytest.mark.parametrize("item", ["fully-async=r1x2", "nope=r1x1-t1", "sync=r0x1-t1", "sync"])
def test_a_malformed_split_is_a_usage_error_naming_it(item, capsys):
    with pytest.raises(SystemExit) as exc:
        modes_bench.parse_args(["--split", item])
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

    seen = {}
    monkeypatch.setattr(trl_peer, "run_trl", lambda spec, out_dir, timeout_s, log: seen.update(spec) or
                        {"samples_per_s": 1.0})
    args = modes_bench.parse_args(["--preset", "tiny", "--out", str(tmp_path), "--steps", "4"])
    cfg = load_config(preset="tiny")
    assert modes_bench.trl_peer(args, cfg, 2) == {"samples_per_s": 1.0}
    assert len(seen["records"]) == cfg.data.size
    assert (seen["n"], seen["prompts_per_step"], seen["num_steps"]) == (cfg.rollout.n, cfg.data.train_batch_size, 4)
    assert seen["num_threads"] == 2 and seen["max_response_length"] == cfg.rollout.max_response_length
    reward_fn = trl_peer.build_reward(seen)  # what the worker in the TRL venv calls
    record = seen["records"][0]
    assert reward_fn("no answer here", record["ground_truth"]) == 0.0
