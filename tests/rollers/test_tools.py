"""Tools, the tool-call format, async rewards and the calculator environment (no model)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time

import pytest

from rollers import user_calls
from rollers.environments import ENVIRONMENTS, AsyncReward, EnvContext, EnvironmentFailure
from rollers.rewards import math_verify_reward
from rollers.tools import (
    Tool,
    ToolCall,
    ToolError,
    calculator,
    call_tool,
    evaluate_expression,
    parse_tool_call,
    tool,
)
from tests.rollers.engine_helpers import concurrency_probe, run


def call_text(name: str, arguments: str) -> str:
    return f'Let me compute. <tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def test_parse_tool_call():
    assert parse_tool_call("no call here") is None
    assert parse_tool_call(call_text("calculator", '{"expression": "1+2"}')) == \
        ToolCall("calculator", {"expression": "1+2"})
    assert parse_tool_call('<tool_call>{"name": "x", "arguments": {}}') == ToolCall("x", {})  # unclosed tag
    assert "not valid JSON" in parse_tool_call("<tool_call>{oops</tool_call>").error
    assert "name" in parse_tool_call('<tool_call>["x"]</tool_call>').error
    assert "object" in parse_tool_call('<tool_call>{"name": "x", "arguments": 3}</tool_call>').error


def test_calculator_is_safe_and_exact():
    assert evaluate_expression("123456789 + 987654321 - 5 * (2 + 1)") == "1111111095"
    for bad in ("__import__('os').system('true')", "2 ** 100000", "1 / 0", "x + 1", "9" * 600):
        assert evaluate_expression(bad).startswith("error:")


def test_call_tool_answers_mistakes_and_fails_on_tool_errors():
    tools = {"calculator": calculator}
    assert run(call_tool(tools, ToolCall("calculator", {"expression": "40+2"}), 5.0)) == "42"
    assert "unknown tool" in run(call_tool(tools, ToolCall("search", {}), 5.0))
    assert "bad arguments" in run(call_tool(tools, ToolCall("calculator", {"expr": "1"}), 5.0))
    assert run(call_tool(tools, ToolCall("", {}, "the tool call is not valid JSON"), 5.0)).startswith("error:")

    @tool({"type": "object", "properties": {}})
    def broken():
        """Always fails."""
        raise RuntimeError("boom")

    @tool({"type": "object", "properties": {}})
    async def slow():
        await asyncio.sleep(10)

    assert broken.description == "Always fails." and broken.spec()["function"]["name"] == "broken"
    with pytest.raises(ToolError, match="boom"):
        run(call_tool({"broken": broken}, ToolCall("broken", {}), 5.0))
    with pytest.raises(ToolError, match="longer than"):
        run(call_tool({"slow": slow}, ToolCall("slow", {}), 0.05))
    with pytest.raises(ValueError, match="object"):
        Tool("t", lambda: 1, {"type": "string"})


@contextlib.contextmanager
def _released(release: threading.Event):
    """Set ``release`` on leaving (the blocked calls return), then check the overdue count drains to 0."""
    try:
        yield
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while user_calls.num_overdue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert user_calls.num_overdue() == 0


def test_blocking_sync_tools_hold_only_their_own_threads():
    """Sync tool calls that block forever time out one by one, and a later call still runs at once (a shared
    worker pool, asyncio.to_thread's 6 threads on 2 cores, was used up by them: every later call timed out).
    The overdue count follows the threads and goes back to 0 once they return."""
    release = threading.Event()

    @tool({"type": "object", "properties": {}})
    def stuck():
        release.wait(30)
        return "late"

    @tool({"type": "object", "properties": {"timeout_s": {"type": "number"}}})
    def quick(timeout_s=None):
        return f"quick {timeout_s}"

    tools = {"stuck": stuck, "quick": quick}

    async def scenario():
        calls = [call_tool(tools, ToolCall("stuck", {}), 0.1) for _ in range(12)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(o, ToolError) and "longer than" in str(o) for o in outcomes)
        assert user_calls.num_overdue() == 12
        # a tool argument named like call_user's own parameter reaches the tool
        return await call_tool(tools, ToolCall("quick", {"timeout_s": 3}), 1.0)

    with _released(release):
        assert run(scenario()) == "quick 3"


def test_overdue_calls_are_bounded(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(user_calls, "MAX_OVERDUE", 2)

    async def scenario():
        for _ in range(2):
            with pytest.raises(TimeoutError):
                await user_calls.call_user(0.05, release.wait, 30)
        refused = r"2 earlier calls .* \(at most 2; the most: Event.wait ×2\)"
        with pytest.raises(user_calls.TooManyOverdueCalls, match=refused):
            await user_calls.call_user(5.0, lambda: 1)
        assert await user_calls.call_user(5.0, asyncio.sleep, 0, "async calls need no thread") == \
            "async calls need no thread"

    with _released(release):
        run(scenario())


def _stop_iteration():
    raise StopIteration


async def _async_exit():
    sys.exit(3)


@pytest.mark.parametrize("fn, name", [(_stop_iteration, "StopIteration"), (lambda: sys.exit(3), "SystemExit: 3"),
                                      (_async_exit, "SystemExit: 3")])
def test_a_call_raising_what_would_end_the_process_fails_at_once(fn, name):
    """StopIteration (which a future cannot carry: the caller used to wait out the timeout) and SystemExit
    (which would stop the roller's event loop) fail the call at once, as RuntimeError naming them."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=name):
        run(user_calls.call_user(30.0, fn))
    assert time.monotonic() - started < 10


def test_async_reward_limits_concurrency_and_times_out():
    reward, probe = concurrency_probe(lambda text, gt: 1.0 if text == gt["answer"] else 0.0, 0.02)

    async def scenario():
        limited = AsyncReward(reward, max_concurrency=2, timeout_s=5.0)
        return await asyncio.gather(*(limited("7", {"answer": "7"}) for _ in range(6)))

    assert run(scenario()) == [1.0] * 6 and probe.peak == 2

    def hanging(text, gt):
        time.sleep(1.0)
        return 1.0

    with pytest.raises(EnvironmentFailure, match="longer than"):
        run(AsyncReward(hanging, 1, 0.05)("x", {}))
    with pytest.raises(EnvironmentFailure, match="reward returned nan"):
        run(AsyncReward(lambda t, g: float("nan"), 1, 5.0)("x", {}))
    with pytest.raises(EnvironmentFailure, match="KeyError"):
        run(AsyncReward(lambda t, g: g["missing"], 1, 5.0)("x", {}))


def test_calculator_environment_answers_calls_then_scores_the_answer():
    ctx = EnvContext(AsyncReward(math_verify_reward, 4, 10.0), timeout_s=5.0)
    env = ENVIRONMENTS.get("calculator").make(ctx)

    async def episode(final: str):
        assert await env.reset({"answer": "1111"}) == ""
        first = await env.step(call_text("calculator", '{"expression": "1000 + 111"}'))
        second = await env.step(final)
        return first, second

    first, second = run(episode("The answer is 1111."))
    assert (first.observation, first.reward, first.done) == ("1111", 0.0, False)
    assert second.done and second.reward == 1.0
    _, wrong = run(episode("The answer is 1112."))
    assert wrong.done and wrong.reward == 0.0
