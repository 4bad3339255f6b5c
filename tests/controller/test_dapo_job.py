"""DAPO in whole jobs (tiny preset): dynamic sampling in the three schedules, its refill limit, and the
overlong penalty. Reward hooks in ``tests/controller/reward_hooks.py`` make zero-variance groups
deterministic: every group of a prompt whose answer is ``c`` scores a constant."""

from __future__ import annotations

import pytest

from common.models import load_tokenizer
from controller.config import load_config
from controller.data import PromptDataset
from controller.job import EXIT_FAILED, EXIT_OK
from tests.controller.test_job import HOOKS, run

pytestmark = pytest.mark.timeout(300)

B, SIZE = 4, 16
SMALL = (f"data.size={SIZE}", "data.epochs=1", f"data.train_batch_size={B}", f"trainer.ppo_mini_batch_size={B}",
         "rollout.n=4", "trainer.total_steps=2")


def _stream_answers(seed: int) -> list[str]:
    """Answers of the epoch-0 prompt stream in the order the feeder draws them (stream position =
    ``global_step * B + position``, the ``s<step>.p<pos>`` of a uid)."""
    cfg = load_config(preset="tiny", overrides=[*SMALL, f"data.seed={seed}"])
    dataset = PromptDataset.splits(cfg.data, load_tokenizer(cfg.model))[0]
    return [dataset.prompts[i].ground_truth["answer"] for i in dataset.epoch_order(0)]


def _seed_with_c_chain() -> int:
    """A data seed whose stream is: one ``c`` in the first batch, a ``c`` next (its replacement is also
    zero-variance: 2 refill rounds), then no ``c`` in the next 5 prompts (the rest of the run)."""
    for seed in range(1000):
        a = _stream_answers(seed)
        if a[:B].count("c") == 1 and a[B] == "c" and "c" not in a[B + 1:2 * B + 2]:
            return seed
    raise AssertionError("no seed found")


def _position(uid: str) -> int:
    step, pos = uid.split(".r")[0].removeprefix("s").split(".p")
    return int(step) * B + int(pos)


# one-step-off (sync's batches one step ahead, the same refill stage) in `make test-long`: the suite's time
@pytest.mark.parametrize("mode", ["sync", pytest.param("one-step-off", marks=pytest.mark.long), "fully-async"])
def test_dynamic_sampling_replaces_zero_variance_groups(tmp_path, ray_cluster, mode):
    seed = _seed_with_c_chain()
    answers = _stream_answers(seed)
    code, steps, summary = run(tmp_path, mode, *SMALL, f"data.seed={seed}", "algorithm.dynamic_sampling=true",
                               f"rollout.reward={HOOKS}:constant_for_c")
    assert code == EXIT_OK and len(steps) == 2
    assert all(s["num_groups"] == B for s in steps)  # full batches: every dropped group was replaced
    assert all(s["frac_groups_reward_variance"] == 1.0 and s["dynamic_sampling/num_padded_groups"] == 0
               for s in steps)
    trained = sorted(_position(u) for s in steps for u in s["uids"])
    num_dropped = sum(s["dynamic_sampling/num_dropped_groups"] for s in steps)
    consumed = range(len(trained) + num_dropped)  # the stream advances over kept and dropped prompts alike
    assert trained == [i for i in consumed if answers[i] != "c"]  # each prompt once, no c group trained
    assert num_dropped == summary["num_zero_variance_groups"] == sum(answers[i] == "c" for i in consumed) >= 2
    # A dropped group counts as dropped: its replacement takes its place within the admission bound.
    assert summary["num_groups_admitted"] == len(trained) + num_dropped + summary["num_dropped_groups"]
    assert max(s["staleness_max"] for s in steps) <= (0 if mode == "sync" else 1)
    if mode != "fully-async":  # batch by batch: step 1's c and its c replacement, then nothing
        assert [s["dynamic_sampling/refill_rounds"] for s in steps] == [2, 0]
        assert [s["dynamic_sampling/num_dropped_groups"] for s in steps] == [2, 0]


def test_dynamic_sampling_pads_when_rounds_or_data_run_out(tmp_path, ray_cluster, capsys):
    # Every group has zero variance; 12 prompts = 3 batches of 4, one refill round allowed.
    code, steps, _ = run(tmp_path, "sync", *SMALL, "data.size=12", "trainer.total_steps=3",
                         "algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=1",
                         f"rollout.reward={HOOKS}:constant")
    assert len(steps) == 2 and all(s["num_groups"] == B and s["frac_groups_reward_variance"] == 0.0 for s in steps)
    # Step 1: each slot's group dropped once, its replacement (prompts 4-7) zero-variance too: out of rounds.
    assert sorted(_position(u) for u in steps[0]["uids"]) == list(range(B, 2 * B))
    assert (steps[0]["dynamic_sampling/refill_rounds"], steps[0]["dynamic_sampling/num_dropped_groups"],
            steps[0]["dynamic_sampling/num_padded_groups"]) == (1, B, B)
    # Step 2: the last batch (prompts 8-11); no prompt left to replace them, so they train as they are.
    assert sorted(_position(u) for u in steps[1]["uids"]) == list(range(2 * B, 3 * B))
    assert (steps[1]["dynamic_sampling/refill_rounds"], steps[1]["dynamic_sampling/num_dropped_groups"],
            steps[1]["dynamic_sampling/num_padded_groups"]) == (0, 0, B)
    # Step 3 has no prompt at all: the run fails and says why.
    assert code == EXIT_FAILED
    err = capsys.readouterr().err
    assert "prompt data ran out before step 3" in err and "4 prompts went to replace zero-variance groups" in err


def test_overlong_penalty_reaches_the_step(tmp_path, ray_cluster):
    # Buffer = max_response_length = 4: every response (>= 1 token) is penalised by -length / 4 * factor.
    code, steps, _ = run(tmp_path, "sync", *SMALL, "trainer.total_steps=1", "algorithm.overlong_buffer_len=4",
                         "algorithm.overlong_penalty_factor=0.5")
    assert code == EXIT_OK and len(steps) == 1
    step = steps[0]
    assert step["overlong/frac_penalised"] == 1.0
    assert step["overlong/penalty_mean"] == pytest.approx(-0.5 * step["response_length_mean"] / 4, abs=1e-6)
    assert "dynamic_sampling/refill_rounds" not in step  # reported only when dynamic sampling is on
