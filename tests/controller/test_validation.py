"""Validation, trackers and generation dumps without a job: pass@k, the round's record, the held-out split,
the summary and plot, TensorBoard files read back with tensorboard's own reader, and config errors."""

from __future__ import annotations

import itertools
import json

import pytest

from common import schema
from controller.config import DataConfig, available_presets, load_config
from controller.data import load_split, normalised_text
from controller.metrics import JobMetrics
from controller.report import VAL_SUMMARY_KEYS, RunReport, validation_summary
from controller.tasks import TASKS, TaskRecord, load_task_records, register_task
from controller.trackers import Trackers, check_trackers
from controller.validation import pass_at_k, pass_k_values, validation_record


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k)), (n, c, k)
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(*bad)
    assert pass_k_values(1) == [1] and pass_k_values(4) == [1, 2, 4] and pass_k_values(6) == [1, 2, 4, 6]


def _tags(uid: str, rewards: list[float], greedy_reward: float | None, version=(3, 3), finish="stop", length=5):
    out = [{schema.UID: uid, schema.REWARD: r, schema.GREEDY: 0, schema.RESPONSE_LENGTH: length,
            schema.FINISH_REASON: finish, schema.MIN_WEIGHT_VERSION: version[0],
            schema.MAX_WEIGHT_VERSION: version[1]} for r in rewards]
    if greedy_reward is not None:
        out.append({**out[0], schema.REWARD: greedy_reward, schema.GREEDY: 1, schema.RESPONSE_LENGTH: 99,
                    schema.FINISH_REASON: "length"})
    return out


def test_validation_record_from_tags():
    tags = (_tags("v1.p0", [1, 0, 0, 0], 1.0) + _tags("v1.p1", [0, 0, 0, 0], 0.0, version=(3, 4), finish="length",
                                                       length=9))
    rec = validation_record(tags, weight_version=3, n=4)
    assert rec["validation"] is True and rec["weight_version"] == 3 and rec["step"] == 3
    assert rec["val/num_prompts"] == 2 and rec["val/num_samples"] == 10
    assert rec["val/accuracy"] == rec["val/pass@1"] == pytest.approx((0.25 + 0) / 2)
    assert rec["val/pass@2"] == pytest.approx((0.5 + 0) / 2) and rec["val/pass@4"] == pytest.approx(0.5)
    assert rec["val/reward_mean"] == pytest.approx(0.125)
    assert rec["val/accuracy_greedy"] == 0.5 and rec["val/reward_mean_greedy"] == 0.5
    # Lengths and clip ratio over the sampled responses (at the training temperature), not the greedy ones.
    assert rec["val/response_length_mean"] == 7.0 and rec["val/response_clip_ratio"] == 0.5
    assert rec["val/multi_version_samples"] == 5 and rec["val/weight_version_max"] == 4
    no_greedy = validation_record(_tags("v0.p0", [1, 1], None), 0, n=2)
    assert "val/accuracy_greedy" not in no_greedy and no_greedy["val/accuracy"] == 1.0
    with pytest.raises(ValueError, match="without samples"):
        validation_record([], 0, 2)


def _texts(records) -> set[str]:
    return {normalised_text(r.prompt) for r in records}


def _jsonl(path, prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": str(i)}) + "\n" for i, p in enumerate(prompts)))
    return str(path)


@pytest.mark.parametrize("preset", available_presets())
def test_every_preset_with_validation_holds_out_by_text(preset):
    """Held out means by text: no held-out prompt's normalised text occurs in training (issue 44: 42 of the
    main job's 64 held-out prompts were training prompts, held out by row)."""
    cfg = load_config(preset=preset).data
    if not cfg.val_size:
        pytest.skip(f"preset {preset} validates on nothing")
    split = load_split(cfg)
    assert len(split.val) == cfg.val_size and len(split.train) == cfg.size
    assert not _texts(split.train) & _texts(split.val) and split.num_val_seen == 0
    assert len(_texts(split.val)) == cfg.val_size  # distinct: no prompt counts twice
    # The task's space is wide enough that most rows after the training ones are unseen (the one-digit task
    # of before issue 44 passed over 96 rows to find 64; a wider one passes over few).
    assert split.num_val_skipped <= cfg.val_size // 2


def test_held_out_prompts_pass_over_training_texts_and_leave_the_training_rows_unchanged():
    kwargs = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # ~200 distinct problems
    plain = load_task_records("chain_sum", 200, 0, kwargs)
    split = load_split(DataConfig(task="chain_sum", size=200, task_kwargs=kwargs, val_size=64))
    assert split.train == plain and len(split.val) == 64 and not _texts(plain) & _texts(split.val)
    rows = load_task_records("chain_sum", 200 + 64 + split.num_val_skipped, 0, kwargs)[200:]
    first_unseen, texts = [], _texts(plain)  # rows in order, each text once, none a training prompt's
    for row in rows:
        if normalised_text(row.prompt) not in texts:
            first_unseen.append(row)
            texts.add(normalised_text(row.prompt))
    assert split.num_val_skipped > 0 and split.val == first_unseen
    by_row = load_split(DataConfig(task="chain_sum", size=200, task_kwargs=kwargs, val_size=64, val_disjoint=False))
    assert by_row.val == rows[:64] and by_row.num_val_seen == sum(normalised_text(r.prompt) in _texts(plain)
                                                                  for r in rows[:64]) > 0
    assert load_split(DataConfig(task="tiny_repeat", size=40)).val == []


def test_a_plug_in_of_fixed_rows_is_split_like_a_file(monkeypatch):
    """A task plug-in that returns its own rows whatever ``size`` (here 12) keeps all but the held-out ones."""
    monkeypatch.setattr(TASKS, "_items", dict(TASKS._items))  # the test's registration does not leak
    rows = [TaskRecord(f"q{i % 10}", {"answer": str(i)}) for i in range(12)]  # q0 and q1 repeat at the end
    register_task("fixed_rows_for_split", reward="math_verify")(lambda size, seed, **kw: rows)
    split = load_split(DataConfig(task="fixed_rows_for_split", size=200, val_size=3))
    assert [r.prompt for r in split.val] == ["q7", "q8", "q9"] and split.num_val_skipped == 2
    assert sorted(r.prompt for r in [*split.train, *split.val]) == sorted(r.prompt for r in rows)
    by_row = load_split(DataConfig(task="fixed_rows_for_split", size=200, val_size=3, val_disjoint=False))
    assert by_row.val == rows[-3:] and len(by_row.train) == 9 and by_row.num_val_seen == 2


def test_whitespace_does_not_make_a_training_prompt_unseen(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", ["what is  1+1", "q2", "q3", " what is 1+1 ", "q4", "q5"])
    split = load_split(DataConfig(task=data, val_size=2))
    assert [r.prompt for r in split.val] == ["q4", "q5"] and len(split.train) == 4
    split = load_split(DataConfig(task=data, val_size=3))  # the repeat at row 4 is passed over and trains
    assert [r.prompt for r in split.val] == ["q3", "q4", "q5"] and split.num_val_skipped == 1
    assert [r.prompt for r in split.train] == ["what is  1+1", "q2", " what is 1+1 "]


def test_a_file_task_holds_out_unseen_rows_from_its_end_and_loses_none(tmp_path):
    prompts = ["a", "b", "c", "a", "d", "b", "e", "e"]
    split = load_split(DataConfig(task=_jsonl(tmp_path / "d.jsonl", prompts), val_size=2))
    assert [r.prompt for r in split.val] == ["c", "d"] and split.num_val_skipped == 4  # e e b, then a: repeats
    assert sorted(r.prompt for r in [*split.train, *split.val]) == sorted(prompts)  # every row trains or validates
    assert not _texts(split.train) & _texts(split.val)
    with pytest.raises(ValueError, match=r"data.val_size=4: .* only 2 prompts .* data.val_disjoint=false"):
        load_split(DataConfig(task=_jsonl(tmp_path / "d.jsonl", prompts), val_size=4))
    with pytest.raises(ValueError, match="data.val_size=6 leaves no training rows"):
        load_split(DataConfig(task=_jsonl(tmp_path / "e.jsonl", [f"q{i}" for i in range(6)]), val_size=6))
    split = load_split(DataConfig(task=_jsonl(tmp_path / "d.jsonl", prompts), val_size=3, val_disjoint=False))
    assert [r.prompt for r in split.val] == ["b", "e", "e"] and split.num_val_seen == 1  # its last rows, as before


def test_a_val_file_passes_over_training_prompts(tmp_path):
    val_file = _jsonl(tmp_path / "v.jsonl", ["repeat the word a", "q1", "q2", "q3"])
    split = load_split(DataConfig(task="tiny_repeat", size=8, val_size=3, val_file=val_file))
    assert len(split.train) == 8 and [r.prompt for r in split.val] == ["q1", "q2", "q3"]
    assert split.num_val_skipped == 1 and split.num_val_seen == 0
    with pytest.raises(ValueError, match="data.val_size=4 but data.val_file=.* has 4 rows, 1 of them training"):
        load_split(DataConfig(task="tiny_repeat", size=8, val_size=4, val_file=val_file))
    with pytest.raises(ValueError, match="data.val_size=7 but data.val_file"):
        load_split(DataConfig(task="tiny_repeat", val_size=7, val_file=val_file))
    split = load_split(DataConfig(task="tiny_repeat", size=8, val_size=4, val_file=val_file, val_disjoint=False))
    assert [r.prompt for r in split.val][0] == "repeat the word a" and split.num_val_seen == 1


def test_a_task_too_small_to_hold_out_by_text_is_refused_naming_the_keys():
    """tiny_repeat has at most 26 distinct prompts: it validates only with data.val_disjoint=false."""
    with pytest.raises(ValueError) as err:
        load_split(DataConfig(task="tiny_repeat", size=64, val_size=6))
    for needle in ("data.val_size=6", "data.task='tiny_repeat'", "data.task_kwargs={}", "data.size=64",
                   "gave only 0 prompts", "data.val_disjoint=false"):
        assert needle in str(err.value)
    split = load_split(DataConfig(task="tiny_repeat", size=64, val_size=6, val_disjoint=False))
    assert len(split.val) == 6 and split.num_val_seen == 6 and split.num_val_skipped == 0


@pytest.mark.parametrize("override, needle", [
    ("trainer.val_every=2", "trainer.val_every=2 needs held-out prompts: set data.val_size"),
    ("data.val_size=-1", "data.val_size must be >= 0"),
    ("data.val_file=x.csv", "data.val_file must be a .jsonl or .parquet file"),
    ("val.n=0", "val.n must be >= 1"),
    ("metrics.dump_every=-1", "metrics.dump_every must be >= 0"),
    ("metrics.wandb_mode=cloud", "metrics.wandb_mode='cloud' is not one of"),
])
def test_bad_validation_and_tracker_config_is_named(override, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        load_config(preset="tiny", overrides=[override])
    with pytest.raises(ValueError, match="data.val_file='v.jsonl' needs data.val_size"):
        load_config(preset="tiny", overrides=["data.val_file=v.jsonl"])


def _round(version: int, acc: float, greedy: float) -> dict:
    return {"validation": True, "step": version, "weight_version": version, "val/accuracy": acc,
            "val/accuracy_greedy": greedy, "val/reward_mean": acc, "val/reward_mean_greedy": greedy,
            "val/pass@1": acc, "val/pass@4": min(1.0, 2 * acc), "val/num_prompts": 4}


def test_summary_plot_and_prometheus_take_the_validation_rounds(tmp_path):
    assert validation_summary([]) == {**dict.fromkeys(VAL_SUMMARY_KEYS), "num_val_rounds": 0}
    report = RunReport(tmp_path, total_steps=4, progress=True)
    for step in (1, 2, 3, 4):
        report.log_step({"step": step, "reward_mean": 0.1, "weight_version": step, "staleness_mean": 0,
                         "staleness_max": 0, "samples_per_s": 1.0})
    for version, acc, greedy in ((0, 0.1, 0.0), (4, 0.4, 0.75), (2, 0.5, 0.5)):  # logged out of order
        report.log_validation(_round(version, acc, greedy))
    with pytest.raises(ValueError, match="weight_version"):
        report.log_validation({"validation": True, "val/accuracy": 0.1})
    summary = report.finish({"mode": "fully-async"})
    report.close()
    assert summary["num_val_rounds"] == 3 and summary["val_best_weight_version"] == 2
    assert (summary["val_accuracy_first"], summary["val_accuracy_best"], summary["val_accuracy_last"]) == (0.1, 0.5, 0.4)
    assert (summary["val_accuracy_greedy_first"], summary["val_accuracy_greedy_last"]) == (0.0, 0.75)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["weight_version"] for x in lines if x.get("validation")] == [0, 4, 2]
    assert [x["step"] for x in lines if not x.get("validation")] == [1, 2, 3, 4]
    assert (tmp_path / "plot.png").stat().st_size > 1000
    metrics = JobMetrics()
    metrics.observe_validation(_round(4, 0.4, 0.75))
    value = metrics.registry.get_sample_value
    assert value("hflow_val_accuracy", {"kind": "greedy"}) == 0.75 and value("hflow_val_weight_version") == 4
    assert value("hflow_val_pass_at_k", {"k": "4"}) == 0.8 and value("hflow_val_reward_mean", {"kind": "sampled"}) == 0.4


def test_a_resumed_report_takes_back_its_validation_rounds_and_a_rewind_forgets_later_ones(tmp_path):
    """``metrics.jsonl`` rows kept from before a resume mix steps and validation rounds (the default preset
    validates): each goes back where it belongs, so the summary is written (a validation row read as a
    step once made ``finish`` fail on its missing ``reward_mean``)."""
    from controller.job import _open_report
    from controller.job_checkpoint import truncate_metrics

    report = RunReport(tmp_path, total_steps=4, progress=False)
    report.log_validation(_round(0, 0.1, 0.0))
    for step in (1, 2, 3):
        report.log_step({"step": step, "reward_mean": 0.1, "weight_version": step, "staleness_mean": 0,
                         "staleness_max": 0, "samples_per_s": 1.0})
        if step != 1:
            report.log_validation(_round(step, 0.1 * step, 0.0))
    report.close()
    cfg = load_config(preset="tiny", overrides=[f"run_dir={tmp_path}", "metrics.progress=false", "trainer.total_steps=4"])
    resumed = _open_report(cfg, tmp_path, truncate_metrics(tmp_path, 2))  # a resume from step 2
    assert [r["step"] for r in resumed.steps] == [1, 2]
    assert [r["weight_version"] for r in resumed.validations] == [0, 2]
    resumed.log_step({"step": 3, "reward_mean": 0.3, "weight_version": 3, "staleness_mean": 0, "staleness_max": 0,
                      "samples_per_s": 1.0})
    resumed.log_validation(_round(3, 0.4, 0.5))
    assert [r["step"] for r in resumed.rewind(2)] == [3]  # a trainer restart from step 2
    assert [r["weight_version"] for r in resumed.validations] == [0, 2]
    summary = resumed.finish({"status": "completed"})
    resumed.close()
    assert summary["num_steps"] == 2 and summary["num_val_rounds"] == 2 and summary["val_accuracy_last"] == 0.2
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def read_tensorboard(log_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the event files under ``log_dir``, with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_the_jsonl_scalars(tmp_path):
    cfg = load_config(preset="tiny", overrides=["metrics.tensorboard=true"]).metrics
    report = RunReport(tmp_path, total_steps=2, progress=False, trackers=Trackers(cfg, tmp_path))
    for step in (1, 2):
        report.log_step({"step": step, "reward_mean": 0.25 * step, "weight_version": step, "staleness_mean": 0,
                         "staleness_max": 0, "samples_per_s": 1.0, "uids": ["a"], "responses_digest": "ff"})
    report.log_validation(_round(2, 0.5, 0.75))
    report.close()
    scalars = read_tensorboard(tmp_path / "tensorboard")
    assert scalars["train/reward_mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["train/staleness_max"] == [(1, 0.0), (2, 0.0)]
    assert scalars["val/accuracy_greedy"] == [(2, 0.75)] and scalars["val/weight_version"] == [(2, 2.0)]
    assert not any("uids" in t or "digest" in t or t.endswith("/step") for t in scalars)


def test_a_missing_tracker_library_is_named(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    cfg = load_config(preset="tiny", overrides=["metrics.wandb=true"]).metrics
    with pytest.raises(ValueError, match=r"metrics.wandb=true needs the wandb package: pip install wandb"):
        check_trackers(cfg)
