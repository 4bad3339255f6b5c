"""Reward functions for controller tests (``rollout.reward=tests.controller.reward_hooks:NAME``).

They run inside roller processes; module globals are per process, which is what "only the first time"
relies on (one roller per test run).
"""

import time
import zlib

from rollers.rewards import tiny_repeat_reward

_seen: set[str] = set()


def raise_on_c(response_text: str, ground_truth: dict) -> float:
    """Raises for every sample of prompts whose answer is ``c``; the tiny_repeat reward otherwise."""
    if ground_truth["answer"] == "c":
        raise RuntimeError("reward hook: refusing to score answer c")
    return tiny_repeat_reward(response_text, ground_truth)


def slow_first_c(response_text: str, ground_truth: dict) -> float:
    """Sleeps 4 s the first time it scores a prompt whose answer is ``c`` (so that group completes
    after two more trainer updates); the tiny_repeat reward otherwise."""
    if ground_truth["answer"] == "c" and "c" not in _seen:
        _seen.add("c")
        time.sleep(4.0)
    return tiny_repeat_reward(response_text, ground_truth)


def constant_for_c(response_text: str, ground_truth: dict) -> float:
    """0.5 for every sample of prompts whose answer is ``c`` (zero reward variance, always); otherwise a
    value in [0, 1) from a hash of the response text, so a group varies unless its responses all agree."""
    if ground_truth["answer"] == "c":
        return 0.5
    return (zlib.crc32(response_text.encode()) % 1000) / 1000


def constant(response_text: str, ground_truth: dict) -> float:
    """0.0 for every response: every group has zero reward variance."""
    return 0.0
