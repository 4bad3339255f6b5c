"""The schedule simulator of ``bench/schedule_sim.py``: exact answers on cases worked by hand, steady-state
rates, the staleness bound of each schedule, and the planner's search (fast, deterministic)."""

from __future__ import annotations

import json

import pytest

from bench.schedule_sim import Costs, Workload, parse_lengths, plan, simulate, validate

B, N, L = 4, 4, 10


def _costs(**kw) -> Costs:
    base = dict(decode_base_s=0.01, decode_per_seq_s=0.001, train_s_per_sample=0.05, max_batch_slots=16)
    return Costs(**{**base, **kw})


def _fixed(steps=6, warmup=0, **kw) -> Workload:
    return Workload(B, N, ((1, L, L),), num_steps=steps, warmup_steps=warmup, **kw)


def test_sync_without_sync_cost_is_generation_then_training_in_series():
    costs = _costs()
    res = simulate("sync", costs, _fixed())
    gen = L * (costs.decode_base_s + costs.decode_per_seq_s * B * N)  # every sequence in one batch
    train = B * N * costs.train_s_per_sample
    assert res.wall_s == pytest.approx(6 * (gen + train))
    assert res.samples_per_s == pytest.approx(B * N / (gen + train))
    assert res.staleness_max == 0 and res.sync_share == 0
    assert res.trainer_idle_share == pytest.approx(gen / (gen + train))
    assert res.roller_idle_share == pytest.approx(train / (gen + train))


def test_sync_cost_and_trainer_ranks_add_up():
    costs = _costs(sync_s=0.2, train_step_overhead_s=0.1, train_comm_s=0.05)
    res = simulate("sync", costs, _fixed(), num_trainers=2)
    gen = L * (costs.decode_base_s + costs.decode_per_seq_s * B * N)
    step = gen + 0.1 + B * N * costs.train_s_per_sample / 2 + 0.05 + 0.2
    assert res.wall_s == pytest.approx(6 * step - 0.2)  # the run ends at the last update
    assert res.sync_share == pytest.approx(5 * 0.2 / res.wall_s)


def test_one_step_off_overlaps_generation_with_training():
    costs = _costs()
    gen = L * (costs.decode_base_s + costs.decode_per_seq_s * B * N)
    train = B * N * costs.train_s_per_sample
    res = simulate("one-step-off", costs, _fixed(warmup=1))
    assert res.samples_per_s == pytest.approx(B * N / max(gen, train))
    assert res.staleness_max == 1 and res.staleness_mean == 1


def test_tail_steps_end_the_window_early():
    # the window (and wall_s) ends at update num_steps - tail_steps; the steady rate is unchanged
    costs = _costs(train_s_per_sample=0.001)
    gen = L * (costs.decode_base_s + costs.decode_per_seq_s * B * N)
    steady = B * N / max(gen, B * N * 0.001)
    res = simulate("one-step-off", costs, Workload(B, N, ((1, L, L),), num_steps=6, warmup_steps=1, tail_steps=1))
    assert res.samples_per_s == pytest.approx(steady)
    tail = Workload(B, N, ((1, L, L),), num_steps=6, warmup_steps=1, tail_steps=3)
    assert simulate("sync", costs, tail).wall_s == pytest.approx(3 * (gen + B * N * 0.001))
    with pytest.raises(ValueError, match="tail_steps"):
        simulate("sync", costs, Workload(B, N, ((1, L, L),), num_steps=3, warmup_steps=1, tail_steps=2))


@pytest.mark.parametrize("train_s", [0.001, 0.2])
def test_fully_async_steady_rate_is_the_slower_of_generation_and_training(train_s):
    costs = _costs(train_s_per_sample=train_s, max_batch_slots=B * N)
    wl = _fixed(steps=40, warmup=10, max_staleness=4)
    res = simulate("fully-async", costs, wl, num_rollers=2)
    gen_rate = 2 * B * N / (L * (costs.decode_base_s + costs.decode_per_seq_s * B * N))
    train_rate = 1 / train_s
    assert res.samples_per_s == pytest.approx(min(gen_rate, train_rate), rel=0.05)


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 4])
@pytest.mark.parametrize("rollers", [1, 3])
def test_fully_async_respects_the_staleness_bound(max_staleness, rollers):
    wl = Workload(B, N, parse_lengths("8:2-6,2:30-40"), num_steps=20, warmup_steps=2,
                  max_staleness=max_staleness, seed=7)
    res = simulate("fully-async", _costs(train_s_per_sample=0.002, sync_s=0.05), wl, num_rollers=rollers)
    assert res.staleness_max <= max_staleness
    assert simulate("sync", _costs(), wl).staleness_max == 0


def test_long_tail_favours_fully_async_over_sync():
    wl = Workload(B, N, parse_lengths("8:2-6,2:60-64"), num_steps=30, warmup_steps=3, max_staleness=2)
    costs = _costs(train_s_per_sample=0.02, max_batch_slots=64)
    sync, fa = simulate("sync", costs, wl), simulate("fully-async", costs, wl)
    assert fa.samples_per_s > 1.3 * sync.samples_per_s
    assert sync.roller_idle_share > fa.roller_idle_share


def test_simulation_is_deterministic():
    wl = Workload(B, N, parse_lengths("8:2-6,2:30-40"), num_steps=8, seed=3)
    assert simulate("fully-async", _costs(), wl, 2) == simulate("fully-async", _costs(), wl, 2)


def test_plan_splits_the_budget():
    wl = Workload(B, N, parse_lengths("8:2-6,2:30-40"), num_steps=6, warmup_steps=1)
    best = plan(_costs(train_s_per_sample=0.01), wl, 4)
    assert set(best) == {"sync", "one-step-off", "fully-async"}
    for mode in ("one-step-off", "fully-async"):
        assert best[mode].num_rollers + best[mode].num_trainers == 4
    assert best["sync"].num_rollers + best["sync"].num_trainers in (4, 8)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="costs.sync_s"):
        _costs(sync_s=-1)
    with pytest.raises(ValueError, match="unknown cost keys"):
        Costs.from_dict({"decode_base_s": 1, "decode_per_seq_s": 1, "train_s_per_sample": 1, "bogus": 1})
    with pytest.raises(ValueError, match="length spec"):
        parse_lengths("8:4-")
    with pytest.raises(ValueError, match="mode="):
        simulate("async", _costs(), _fixed())


def test_validate_reads_a_benchmark_result(tmp_path):
    cal = dict(decode_base_s=0.01, decode_per_seq_s=0.001, train_s_per_sample=0.05, max_batch_slots=16)
    spec = {"prompts_per_step": B, "n": N, "lengths": [[1, L, L]], "max_staleness": 1, "empirical": False, "seed": 0}
    gen = L * (0.01 + 0.001 * B * N)
    measured = B * N / (gen + B * N * 0.05)
    best = {"split": {"key": "r1x1-t1", "num_replicas": 1}, "num_steps": 6, "warmup_steps": 1,
            "samples_per_s": measured, "staleness_max": 0}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"calibration": {"main/r1x1-t1": cal},
                                "workloads": {"main": {"sim_workload": spec, "best": {"sync": best}}}}))
    (row,) = validate(path)
    assert row["error"] == pytest.approx(0, abs=1e-9) and row["predicted_staleness_max"] == 0
