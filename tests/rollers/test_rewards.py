"""Answer extraction, the built-in reward functions, user functions and failure reporting."""

from __future__ import annotations

import asyncio
import math
import sys
import types
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from controller.tasks import reasoning_gym_records
from rollers.environments import AsyncReward
from rollers.rewards import (
    build_reward_fn,
    extract_answer,
    load_user_reward,
    math_verify_reward,
    reasoning_gym_reward,
    reward_result,
    tiny_repeat_reward,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>7</answer>", "7"),
        ("I think <answer> -4 </answer> because", "-4"),
        ("<answer>3</answer> then <answer>5</answer>", "5"),
        ("<answer>12", "12"),  # unclosed tag (cut by max length) runs to the end
        ("so \\boxed{42} done", "42"),
        ("Natalia sold 48 clips ... #### 72", "72"),
        ("The answer is 7.", "7"),
        ("The final answer to this arithmetic problem is 15.", "15"),
        ("The answer is \"5.\"", "5"),
        ("The final answer to this classic arithmetic problem is indeed 8.", "8"),
        ("Answer: -4", "-4"),
        ("The final answer to the arithmetic problem is 1 + 5 = 6.", "6"),  # an expression, not "1"
        ("To find the final answer, 6 + 9 equals 15, which is the sum", "15"),
        ("Solving the equation 9 minus 9 results in 0.", "0"),
        ("7 - 4 = 3", "3"),
        ("0 - 4 = \u22124", "-4"),  # unicode minus
        ("The total is $1,000.50", "1000.50"),
        ("7", "7"),
        ("-4.", "-4"),
        ("2 \n\nIn this scenario, the original expression", "2"),
        ("The answer is 14, which is 10 more than 4", "14"),  # the stated answer, not a later number
    ],
)
def test_extract_answer_formats(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "To calculate 6 + 9, we can think of adding the six",  # restated operands are not an answer
        "I'm ready to practice your math skills.",
        "",
    ],
)
def test_extract_answer_none_when_no_answer(text):
    assert extract_answer(text) is None


def test_extract_answer_rejects_non_str():
    with pytest.raises(TypeError, match="str"):
        extract_answer(None)


def test_reasoning_gym_reward_uses_the_task_scorer():
    record = reasoning_gym_records("chain_sum", 3, 0, dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1))[0]
    answer = record.ground_truth["answer"]
    assert reasoning_gym_reward(f"The answer is {answer}.", record.ground_truth) == 1.0
    assert reasoning_gym_reward(f"<answer>{int(answer) + 1}</answer>", record.ground_truth) == 0.0
    assert reasoning_gym_reward("no idea", record.ground_truth) == 0.0


def test_tiny_repeat_reward_first_word():
    assert tiny_repeat_reward("c b a", {"answer": "c"}) == 1.0
    assert tiny_repeat_reward("b c", {"answer": "c"}) == 0.0
    assert tiny_repeat_reward("", {"answer": "c"}) == 0.0


def test_math_verify_reward_gsm8k_style():
    gold = {"answer": "She sold 48 + 24 = 72 clips.\n#### 72"}
    assert math_verify_reward("48 + 24 = 72, so the answer is \\boxed{72}.", gold) == 1.0
    assert math_verify_reward("The answer is 72.0", gold) == 1.0
    assert math_verify_reward("The answer is 71.", gold) == 0.0
    assert math_verify_reward("The answer is 1/2", {"answer": "0.5"}) == 1.0


def test_math_verify_reward_off_the_main_thread(monkeypatch, caplog):
    """Off the main thread math-verify's timeouts are off on purpose; its once-per-process warning about
    that (printed by every roller of a .jsonl run) is silenced, its other records are not."""
    import logging
    import threading

    import math_verify.grader
    import math_verify.parser

    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False)  # as in a fresh roller process
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False)
    results = []
    thread = threading.Thread(target=lambda: results.append(math_verify_reward("it is 72", {"answer": "72"})))
    with caplog.at_level(logging.WARNING):
        thread.start()
        thread.join(timeout=60)
        logging.getLogger("math_verify.parser").warning("Timeout during parsing: x")
    assert results == [1.0]
    assert "Timeout is disabled" not in caplog.text and "Timeout during parsing: x" in caplog.text


def _install_user_module(monkeypatch):
    module = types.ModuleType("my_user_rewards")
    module.length_reward = lambda text, gt: float(len(text) == gt["n"])
    module.not_callable = 3
    monkeypatch.setitem(sys.modules, "my_user_rewards", module)


def test_user_reward_module_function(monkeypatch):
    _install_user_module(monkeypatch)
    fn = build_reward_fn("my_user_rewards:length_reward")
    assert fn("abc", {"n": 3}) == 1.0 and fn("ab", {"n": 3}) == 0.0


def test_a_reward_registered_by_a_module_from_outside(monkeypatch):
    """``module:name`` imports the module; a reward it registers under ``name`` is the one chosen (over a
    module attribute of that name), as for every registry's plug-ins."""
    from rollers.rewards import REWARDS, register_reward

    module = types.ModuleType("my_registered_rewards")
    module.halved = lambda text, gt: 0.0  # shadowed by the registered plug-in of the same name
    monkeypatch.setitem(sys.modules, "my_registered_rewards", module)
    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))  # the registration ends with the test
    fn = register_reward("halved")(lambda text, gt: len(text) / 2)
    assert build_reward_fn("my_registered_rewards:halved") is fn and build_reward_fn("halved") is fn
    with pytest.raises(ValueError, match="'halved' is already registered"):
        register_reward("halved")(fn)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("my_user_rewards", "module:function"),
        ("my_user_rewards:missing", "no callable 'missing'"),
        ("my_user_rewards:not_callable", "no callable"),
        ("no_such_module_xyz:f", "cannot import"),
    ],
)
def test_user_reward_errors_name_the_spec(monkeypatch, spec, match):
    _install_user_module(monkeypatch)
    with pytest.raises(ValueError, match=match):
        load_user_reward(spec)


def test_build_reward_fn_auto_by_task(tmp_path):
    """``auto`` is resolved by the controller from the task (``controller.tasks.resolve_reward``); the
    rollers get the resolved name and refuse an unresolved ``auto``."""
    from controller.tasks import resolve_reward

    assert build_reward_fn(resolve_reward("auto", "chain_sum")) is reasoning_gym_reward
    assert build_reward_fn(resolve_reward("auto", "tiny_repeat")) is tiny_repeat_reward
    assert build_reward_fn(resolve_reward("auto", str(tmp_path / "d.jsonl"))) is math_verify_reward
    assert resolve_reward("math_verify", "tiny_repeat") == "math_verify"
    with pytest.raises(ValueError, match=r"rollout.reward='bogus' is not one of \['math_verify', 'reasoning_gym', "
                                         r"'tiny_repeat'"):
        build_reward_fn(resolve_reward("bogus", "chain_sum"))
    with pytest.raises(ValueError, match="resolved from data.task"):
        build_reward_fn("auto")


def _raises(text, gt):
    raise RuntimeError("boom")


async def _async_half(text, gt):
    await asyncio.sleep(0)
    return 0.5


@pytest.mark.parametrize(
    "fn, error",
    [
        (_raises, "RuntimeError: boom"),
        (lambda t, g: math.nan, "nan"),
        (lambda t, g: math.inf, "inf"),
        (lambda t, g: "1.0", "not a number"),
        (lambda t, g: None, "not a number"),
        (lambda t, g: np.float32("nan"), "nan"),
        (lambda t, g: 10**400, "not a float"),  # math.isfinite raised OverflowError: the roller died
        (lambda t, g: Decimal("NaN"), "nan"),
        (lambda t, g: Decimal("1e400"), "inf"),
    ],
)
def test_failed_rewards_are_reported_not_zero(fn, error):
    result = asyncio.run(AsyncReward(fn, 1, 5.0).score("x", {}))
    assert result.failed and error in result.error
    assert math.isnan(result.score)


@pytest.mark.parametrize("fn, expected", [(lambda t, g: 1, 1.0), (lambda t, g: True, 1.0),
                                          (lambda t, g: np.float32(0.25), 0.25), (lambda t, g: np.int64(2), 2.0),
                                          (lambda t, g: np.bool_(True), 1.0),
                                          (lambda t, g: Decimal("0.75"), 0.75),
                                          (lambda t, g: Fraction(1, 4), 0.25),
                                          (_async_half, 0.5), (lambda t, g: _async_half(t, g), 0.5)])
def test_every_real_number_is_a_score_sync_or_async(fn, expected):
    """One rule for single-turn and environments' rewards (both score through AsyncReward): any finite
    ``numbers.Real`` (bool, Fraction and numpy scalars too) or Decimal is a float score; an async function, or
    one returning a coroutine, is awaited."""
    result = asyncio.run(AsyncReward(fn, 1, 5.0).score("x", {}))
    assert not result.failed and result.score == expected and type(result.score) is float
    assert reward_result(True).score == 1.0 and reward_result(np.float32(0.5)).score == 0.5


def test_reward_calls_time_out_each_and_keep_good_scores_beside_failures():
    async def fn(text, gt):
        if text == "slow":
            await asyncio.sleep(10)
        if text == "bad":
            raise ValueError("bad text")
        return 0.5

    async def scenario():
        reward = AsyncReward(fn, 8, 0.2)
        return await asyncio.gather(*(reward.score(t, {}) for t in ["ok", "bad", "slow", "ok"]))

    results = asyncio.run(scenario())
    assert [r.failed for r in results] == [False, True, True, False]
    assert "ValueError: bad text" in results[1].error and "rollout.reward_timeout_s=0.2" in results[2].error
    assert results[0].score == 0.5 and results[3].score == 0.5
