"""The main job end to end: real Ray actors (rollers, FSDP2 trainer, feeder), real TransferQueue and
checkpoint-engine processes, the tiny model. Handed cases of the controller issue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from controller.cli import main as cli_main
from controller.config import load_config
from controller.job import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, MODEL_DIR, run_job
from controller.report import SUMMARY_KEYS
from controller.tasks import tiny_repeat_records

HOOKS = "tests.controller.reward_hooks"
# Whole jobs (Ray actors, FSDP2, TransferQueue processes): more room than the suite's 120 s default, so a
# loaded 2-core machine does not turn a slow run into a failure; a hang still ends.
pytestmark = pytest.mark.timeout(300)


def run(tmp_path: Path, mode: str, *overrides: str) -> tuple[int, list[dict], dict]:
    """Run the tiny preset in this test session's Ray cluster; (exit code, step records, summary)."""
    cfg = load_config(mode=mode, preset="tiny", overrides=[f"run_dir={tmp_path}", "metrics.progress=false",
                                                             *overrides])
    code = run_job(cfg)
    jsonl, summary = tmp_path / "metrics.jsonl", tmp_path / "summary.json"
    steps = [json.loads(x) for x in jsonl.read_text().splitlines()] if jsonl.exists() else []
    return code, steps, json.loads(summary.read_text()) if summary.exists() else {}


SMALL = ("data.size=32", "data.epochs=1", "data.train_batch_size=8", "trainer.ppo_mini_batch_size=8")


def test_too_many_steps_rejected_at_start(tmp_path, ray_cluster, capsys, monkeypatch):
    """Found by the prompt feeder, the data's only loader (this process, the controller, loads none), before
    the run directory gets anything."""
    import controller.data

    def no_load(*args, **kwargs):
        raise AssertionError("the controller loaded the data")

    monkeypatch.setattr(controller.data, "load_split", no_load)
    code, steps, _ = run(tmp_path, "one-step-off", *SMALL, "trainer.total_steps=10")
    assert code == EXIT_CONFIG and steps == [] and list(tmp_path.iterdir()) == []
    err = capsys.readouterr().err
    for needle in ("dataset size 32", "data.train_batch_size=8", "data.epochs=1", "trainer.total_steps=10"):
        assert needle in err


def test_validation_that_cannot_be_held_out_by_text_is_refused_at_start(tmp_path, ray_cluster, capsys):
    """tiny_repeat has 8 distinct prompts, all of them among 32 training rows: no held-out prompt exists."""
    code, steps, _ = run(tmp_path, "sync", *SMALL, "trainer.total_steps=1", "data.val_size=4")
    assert code == EXIT_CONFIG and steps == [] and list(tmp_path.iterdir()) == []
    err = capsys.readouterr().err
    for needle in ("data.val_size=4", "data.task='tiny_repeat'", "data.size=32", "data.val_disjoint=false"):
        assert needle in err


@pytest.mark.parametrize("total_steps,bypass", [(4, []), pytest.param(3, ["algorithm.bypass_mode=false"],
                                                                         marks=pytest.mark.long)])
def test_exact_termination_one_step_off(tmp_path, ray_cluster, total_steps, bypass):
    code, steps, summary = run(tmp_path, "one-step-off", *SMALL, f"trainer.total_steps={total_steps}", *bypass)
    assert code == EXIT_OK
    assert [s["step"] for s in steps] == list(range(1, total_steps + 1))
    assert summary["num_syncs"] == total_steps and summary["weight_version"] == total_steps
    assert summary["status"] == "completed" and set(summary) == {*SUMMARY_KEYS, "config"}
    assert 0 < summary["startup_s"] < summary["wall_s"] and 0 <= summary["shutdown_s"] < summary["wall_s"]
    assert summary["wall_s"] > summary["startup_s"] + sum(s["step_s"] for s in steps)
    # Nothing is generated beyond the last step (no 5th batch; with 3 steps no 4th batch to cancel).
    assert summary["num_groups_admitted"] == 8 * total_steps
    assert summary["num_groups_generated"] == 8 * total_steps
    assert all(s["num_groups"] == 8 for s in steps)
    assert max(s["staleness_max"] for s in steps) <= 1
    # By default one-step-off takes the rollers' log-probs (bypass mode): no old-log-prob forward. With
    # bypass_mode=false, step 1 trains samples of the trainer's own weights (v0) in one mini-batch: no
    # forward either; later steps' samples are one version old: recomputed. The mismatch every step.
    recomputed = [s["actor/old_log_prob_recomputed"] for s in steps]
    assert recomputed == ([0.0] + [1.0] * (total_steps - 1) if bypass else [0.0] * total_steps)
    assert all(s["rollout_corr/num_tokens"] > 0 and s["rollout_corr/k3_kl"] >= 0 for s in steps)
    parts = summary["startup_breakdown_s"]
    assert {"checks_s", "ray_s", "transferqueue_s", "feeder_s", "rollers_s", "trainer_s", "pools_s",
            "weight_plane_s"} == set(parts) and all(v >= 0 for v in parts.values())
    assert sum(parts[k] for k in ("checks_s", "ray_s", "feeder_s", "transferqueue_s", "pools_s", "weight_plane_s")) \
        <= summary["startup_s"]
    assert summary["threads"]["roller_threads"] >= 1 and summary["threads"]["trainer_threads"] >= 1


def test_mixed_precision_job_trains_fp32_weights_with_bf16_pools(tmp_path, ray_cluster):
    """model.compute_dtype=bfloat16: rollers decode in bf16 and receive each update (sent in bf16), the
    trainer computes in bf16 over float32 master weights; the exported model is float32 and the
    rollout-vs-trainer mismatch shows bf16 rounding, bounded."""
    code, steps, summary = run(tmp_path, "fully-async", "data.size=16", "data.train_batch_size=4",
                               "trainer.ppo_mini_batch_size=4", "trainer.total_steps=3",
                               "model.compute_dtype=bfloat16", "checkpointengine.dtype=bfloat16")
    assert code == EXIT_OK and [s["step"] for s in steps] == [1, 2, 3] and summary["num_syncs"] == 3
    assert all(0 < s["rollout_corr/max_abs_diff"] < 1.0 and abs(s["rollout_corr/kl"]) < 0.05 for s in steps)
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / MODEL_DIR / "model.safetensors").values()} == {torch.float32}


def test_partial_final_batch_is_a_step(tmp_path, ray_cluster, capsys):
    code, steps, summary = run(tmp_path, "sync", "data.size=3", "data.epochs=1", "data.train_batch_size=4",
                               "trainer.ppo_mini_batch_size=4", "trainer.total_steps=1", "trainer.save_every=1")
    assert code == EXIT_OK
    assert len(steps) == 1 and steps[0]["num_groups"] == 3 and steps[0]["num_samples"] == 3 * 8
    # sync, one mini-batch: old_log_probs from the update's own forward, which matches the rollers' numbers
    # (same fp32 weights; a KV-cached decode against one full forward differs only by rounding).
    assert steps[0]["actor/old_log_prob_recomputed"] == 0.0 and steps[0]["actor/ratio_mean"] == 1.0
    assert abs(steps[0]["rollout_corr/kl"]) < 1e-3 and steps[0]["rollout_corr/max_abs_diff"] < 1e-2
    assert any((tmp_path / "checkpoints" / "step_1").iterdir())  # trainer.save_every writes DCP checkpoints
    # The end of the run wrote the policy as a HF model directory; `hflow-async export` turns the step-1
    # checkpoint into the same weights (the run has one step).
    from safetensors.torch import load_file

    from common.models import ModelConfig, load_model, load_tokenizer

    final = tmp_path / MODEL_DIR
    assert summary["model_dir"] == str(final) and (final / "model.safetensors").is_file()
    assert cli_main(["export", str(tmp_path)]) == 0  # the latest checkpoint: step 1
    exported = load_file(tmp_path / "model_step_1" / "model.safetensors")
    assert exported.keys() == load_file(final / "model.safetensors").keys()
    assert all(torch.equal(t, exported[k]) for k, t in load_file(final / "model.safetensors").items())
    as_path = ModelConfig(path=str(final))  # usable as model.path
    assert load_tokenizer(as_path).chat_template == load_tokenizer(ModelConfig(path="tiny")).chat_template
    assert load_model(as_path).config.num_hidden_layers == 2
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path), "--step", "1"]) == EXIT_CONFIG  # model_step_1 exists
    assert cli_main(["export", str(tmp_path), "--step", "2", "--out", str(tmp_path / "x")]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "model_step_1 exists" in err and "checkpoints of steps [1]" in err


def test_export_without_checkpoint_names_the_choices(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("model:\n  path: tiny\n")
    assert cli_main(["export", str(tmp_path)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "no trainer checkpoint" in err and "trainer.save_every" in err and str(tmp_path / "model") in err
    assert cli_main(["export", str(tmp_path / "missing")]) == EXIT_CONFIG
    assert "config.yaml" in capsys.readouterr().err


def test_existing_run_dir_is_refused(tmp_path, capsys):
    """A second run into a run directory would append to its metrics.jsonl and replace the rest."""
    old = tmp_path / "old"
    old.mkdir()
    for name, text in (("metrics.jsonl", '{"step": 1}\n'), ("summary.json", "{}")):
        (old / name).write_text(text)
    code, steps, summary = run(old, "sync", "trainer.total_steps=1")
    assert code == EXIT_CONFIG and steps == [{"step": 1}] and summary == {}  # untouched
    assert sorted(p.name for p in old.iterdir()) == ["metrics.jsonl", "summary.json"]
    err = capsys.readouterr().err
    assert f"run_dir={str(old)!r} already holds a run (metrics.jsonl, summary.json)" in err
    assert "name a new directory" in err and "remove the old one" in err


def test_metrics_port_in_use_is_a_start_error_that_leaves_no_run_dir(tmp_path, capsys):
    """Like every start error, a taken metrics.port is found before the run directory exists, so the same
    run_dir can be used once the port is free. (A run stopped while its pools start still leaves a full
    summary: tests/controller/test_stop.py.)"""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, steps, summary = run(tmp_path / "run", "sync", "metrics.enabled=true", f"metrics.port={port}")
    assert code == EXIT_CONFIG and steps == [] and summary == {}
    assert f"metrics.port={port}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_fully_async_max_staleness_zero_matches_sync(tmp_path, ray_cluster):
    common = ("trainer.total_steps=3", "algorithm.max_staleness=0")
    code_a, sync_steps, _ = run(tmp_path / "sync", "sync", *common)
    code_b, async_steps, _ = run(tmp_path / "async", "fully-async", *common)
    assert code_a == code_b == EXIT_OK and len(sync_steps) == len(async_steps) == 3
    assert_trains_as_sync(sync_steps, async_steps)


def assert_trains_as_sync(sync_steps: list[dict], async_steps: list[dict]) -> None:
    """Step by step: the same prompts, token-identical responses, staleness 0, equal loss and grad norm."""
    for a, b in zip(sync_steps, async_steps, strict=True):
        assert a["uids"] == b["uids"]                           # same prompts in the same steps
        assert a["responses_digest"] == b["responses_digest"]   # token-identical responses
        assert b["staleness_max"] == 0 and b["multi_version_samples"] == 0
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], abs=1e-4)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], abs=1e-4)


def test_stale_group_is_dropped_and_reissued(tmp_path, ray_cluster):
    # One group's reward takes 4 s the first time, so it completes after two more updates: staleness 2.
    code, steps, summary = run(
        tmp_path, "fully-async", "data.train_batch_size=2", "trainer.ppo_mini_batch_size=2", "trainer.total_steps=8",
        "algorithm.max_staleness=1", "algorithm.stale_policy=drop", f"rollout.reward={HOOKS}:slow_first_c")
    assert code == EXIT_OK and len(steps) == 8
    assert summary["num_dropped_groups"] >= 1
    assert max(s["staleness_max"] for s in steps) <= 1
    trained = {u for s in steps for u in s["uids"]}
    assert any(".r" in u for u in trained)  # the dropped prompt came back under a fresh uid


def _seed_with_one_c(size: int = 4) -> int:
    return next(s for s in range(1000) if [r.ground_truth["answer"] for r in tiny_repeat_records(size, s)].count("c")
                == 1)


def test_failing_reward_fails_the_run(tmp_path, ray_cluster, capsys):
    seed = _seed_with_one_c()
    code, steps, _ = run(tmp_path, "sync", "data.size=4", f"data.seed={seed}", "data.train_batch_size=4",
                         "trainer.ppo_mini_batch_size=4", "trainer.total_steps=1", f"rollout.reward={HOOKS}:raise_on_c")
    assert code == EXIT_FAILED and steps == []
    assert "refusing to score answer c" in capsys.readouterr().err
    assert (tmp_path / "summary.json").exists()  # a failed (or interrupted) run still gets its summary
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "refusing to score answer c" in summary["error"]
    assert set(summary) == {*SUMMARY_KEYS, "config"}  # the same keys as a completed run's, null where unknown
    assert summary["num_syncs"] == 0 and summary["weight_version"] == 0 and summary["num_steps"] == 0
    assert summary["num_failed_groups"] >= 1  # the group that failed the run is counted


def test_failing_reward_skipped_when_asked(tmp_path, ray_cluster):
    """A failed training group is skipped; so are failed validation groups (from a data.val_file here):
    their rounds complete without them."""
    seed = _seed_with_one_c()
    val_file = tmp_path.parent / f"{tmp_path.name}-val.jsonl"
    val_file.write_text("".join(json.dumps({"prompt": f"repeat the word {s}", "answer": s}) + "\n" for s in "acbc"))
    code, rows, summary = run(tmp_path, "sync", "data.size=4", f"data.seed={seed}", "data.train_batch_size=4",
                              "trainer.ppo_mini_batch_size=4", "trainer.total_steps=1", "data.val_size=4",
                              f"data.val_file={val_file}", "data.val_disjoint=false", f"rollout.reward={HOOKS}:raise_on_c",
                              "rollers.on_failed_group=skip")
    assert code == EXIT_OK
    assert summary["num_failed_groups"] == 1  # training groups only
    steps = [r for r in rows if not r.get("validation")]
    assert len(steps) == 1 and steps[0]["num_groups"] == 3
    rounds = [r for r in rows if r.get("validation")]
    assert [r["weight_version"] for r in rounds] == [0, 1]
    assert all(r["val/num_failed_groups"] == 2 and r["val/num_prompts"] == 2 for r in rounds)


def test_failed_groups_are_replaced_in_fully_async(tmp_path, ray_cluster):
    """fully-async with rollers.on_failed_group=skip: a fresh prompt takes each failed group's slot, so
    every step trains a full batch (they used to count toward the step that saw them, and the last step
    then waited for groups that never came); the replacements draw on the further epochs."""
    seed = next(s for s in range(1000) if [r.ground_truth["answer"] for r in tiny_repeat_records(8, s)].count("c")
                >= 3)  # a c among any 6 of the 8 prompts: at least one group fails
    code, steps, summary = run(tmp_path, "fully-async", "data.size=8", "data.epochs=3", f"data.seed={seed}",
                               "data.train_batch_size=2", "trainer.ppo_mini_batch_size=2", "trainer.total_steps=3",
                               f"rollout.reward={HOOKS}:raise_on_c", "rollers.on_failed_group=skip")
    assert code == EXIT_OK and [s["num_groups"] for s in steps] == [2, 2, 2]
    assert summary["num_failed_groups"] >= 1
    assert summary["num_groups_admitted"] == 6 + summary["num_failed_groups"]  # each failure replaced once


def test_prompts_near_the_context_limit_are_truncated_not_failed(tmp_path, ray_cluster):
    """The tiny prompts are 9 tokens; a context of 11 leaves 2 of rollout.max_response_length=4: every
    response is cut (finish_reason=length) and the run completes (it used to fail every group)."""
    context = ("model.tiny.max_position_embeddings=11", "rollout.max_response_length=4")
    code, steps, summary = run(tmp_path, "sync", *SMALL, "trainer.total_steps=1", *context)
    assert code == EXIT_OK and summary["num_failed_groups"] == 0
    assert steps[0]["response_clip_ratio"] > 0 and steps[0]["response_length_mean"] <= 2


def test_prometheus_endpoint_serves_every_series_during_a_run(tmp_path, ray_cluster):
    """Scraped over HTTP all through a run: every series is served, and in every scrape produced samples
    are at least consumed + dropped ones (a backlog panel never goes negative). The Prometheus file_sd
    targets (run directory and ``metrics.sd_dir`` copy) name the endpoint while it runs, nothing after."""
    import threading
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from controller.metrics import JobMetrics

    result, run_dir, sd_dir = {}, tmp_path / "run", tmp_path / "sd"
    thread = threading.Thread(target=lambda: result.update(zip(
        ("code", "steps", "summary"), run(run_dir, "fully-async", "trainer.total_steps=40", f"metrics.sd_dir={sd_dir}"),
        strict=True)))
    thread.start()
    endpoint, bodies, deadline = run_dir / "metrics_endpoint.json", [], time.monotonic() + 150
    targets_seen = []
    while thread.is_alive() and time.monotonic() < deadline:
        if endpoint.exists():
            port = json.loads(endpoint.read_text())["port"]
            if not targets_seen and list(sd_dir.glob("*.json")):
                targets_seen = [json.loads(p.read_text()) for p in [run_dir / "prometheus_targets.json",
                                                                     *sd_dir.glob("*.json")]]
            try:
                bodies.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
            except OSError:  # not serving yet, or already closed at the end of the run
                pass
        time.sleep(0.2)
    thread.join(timeout=150)
    assert result.get("code") == EXIT_OK
    counts = []
    for body in bodies:
        values = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
        counts.append(tuple(values[f"hflow_samples_{k}_total"] for k in ("produced", "consumed", "dropped")))
    assert all(produced >= consumed + dropped for produced, consumed, dropped in counts), counts
    assert sum(consumed > 0 for _, consumed, _ in counts) >= 5, counts  # scrapes during training, not only before
    body = next(b for b in reversed(bodies) if 'hflow_roller_busy_ratio{roller="roller0"}' in b)
    missing = [name for name in JobMetrics().series_names() if name not in body]
    assert not missing, missing
    assert 'hflow_queue_depth{task="train"}' in body or 'hflow_queue_depth{task="rollout"}' in body
    assert "hflow_weight_sync_seconds_count" in body and "hflow_queue_lag_bucket" in body
    group = {"targets": [f"127.0.0.1:{port}"], "labels": {"run": "run", "mode": "fully-async", "component": "controller"}}
    assert targets_seen == [[group], [group]]
    assert json.loads((run_dir / "prometheus_targets.json").read_text()) == [] and not list(sd_dir.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.long), pytest.param("one-step-off", marks=pytest.mark.long),
                                  "fully-async"])  # one mode in make test, all three in make test-long
def test_tiny_model_learns_the_prompt_dependent_task(tmp_path, ray_cluster, mode):
    code, rows, summary = run(tmp_path, mode, "data.val_size=32", "data.val_disjoint=false", "trainer.val_every=125")
    assert code == EXIT_OK
    steps = [r for r in rows if not r.get("validation")]
    # Validation accuracy (the 32 rows after the training ones, 4 samples each + 1 greedy) rises with training.
    # Not held out by text: tiny_repeat's 8 prompts all train (data.val_disjoint=false).
    assert [r["weight_version"] for r in rows if r.get("validation")] == [0, 125, 250]
    assert summary["val_accuracy_first"] < 0.2 and summary["val_accuracy_last"] > 0.8, summary
    rewards = [s["reward_mean"] for s in steps]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.2, rewards[:5]
    assert last > 0.9, (last, summary["wall_s"])


def test_epochs_are_one_stream_of_prompts(tmp_path, ray_cluster):
    # 6 prompts x 2 epochs in steps of 4: 3 full steps, the middle one spanning both epochs (a run once
    # checked 4 steps available at start, counting each epoch's short batch, then ran out at step 4).
    small = ("data.size=6", "data.epochs=2", "data.train_batch_size=4", "trainer.ppo_mini_batch_size=4")
    code, steps, _ = run(tmp_path / "four", "sync", *small, "trainer.total_steps=4")
    assert code == EXIT_CONFIG and steps == []
    code, steps, summary = run(tmp_path / "three", "sync", *small, "trainer.total_steps=3")
    assert code == EXIT_OK and [s["num_groups"] for s in steps] == [4, 4, 4]
    assert summary["status"] == "completed"


def test_a_value_error_of_the_controllers_own_pool_set_up_is_a_start_error(monkeypatch):
    """A ValueError raised by the controller-side set-up inside Runtime (not in a pool's actor, where it
    arrives as a RayTaskError), e.g. TransferQueueConfig.sized_for's, is a StartError: exit 2 'cannot start',
    not a failed run."""
    from controller import job, runtime

    def refuse(cfg, feeder, on_stage):
        raise ValueError("transferqueue.max_samples=1 is below the 2 samples this job's admission can hold")

    monkeypatch.setattr(runtime, "Runtime", refuse)
    with pytest.raises(job.StartError, match="transferqueue.max_samples=1"):
        job._start_runtime(load_config(preset="tiny"), feeder=None)
