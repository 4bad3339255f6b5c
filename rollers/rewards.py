"""Reward functions: answer extraction, reasoning-gym scorers, a math-verify numeric checker, user functions.

Every reward function has the signature ``fn(response_text: str, ground_truth: dict) -> float``; the
ground truth is the small JSON-able object a task attaches to each prompt (``controller.tasks``).
The built-ins are plug-ins of the ``REWARDS`` registry (``common.registry``), registered with
``@register_reward("name")``: ``reasoning_gym`` (that task's ``score_answer``), ``tiny_repeat`` (first-word
match), ``math_verify``. ``build_reward_fn(spec)`` picks one by name, or ``module:name`` from outside the
package: a reward the module registers under ``name``, else the module's function ``name``. ``rollout.reward=auto`` is
resolved by the controller, which knows ``data.task`` (``controller.tasks.resolve_reward``: each task
names its reward), before the rollers see it.

A reward function may also be ``async def``. The rollers call it through
``rollers.environment.AsyncReward`` (a concurrency limit and a per-call timeout) and never let one failure
pass for a score: a function that raises, times out or returns NaN/inf (or a non-number) yields a failed
``RewardResult`` carrying the error (``reward_result``), never a silent 0.

Answer extraction (``extract_answer``) is tuned to how SmolLM2-135M-Instruct actually answers short
arithmetic prompts (measured with ``bench/answer_extraction.py``): explicit markers first, then phrases that state a
value, then a number that opens the response — see ``extract_answer``.
"""

from __future__ import annotations

import decimal
import importlib
import inspect
import logging
import math
import numbers
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from common.registry import Registry

RewardFn = Callable[[str, dict], float]
REWARDS: Registry[RewardFn] = Registry("reward", "rollout.reward")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn(response_text, ground_truth) -> float`` as the reward ``name`` (returns
    ``fn`` unchanged). Raises ValueError on a duplicate or malformed name."""

    def wrap(fn: RewardFn) -> RewardFn:
        REWARDS.register(name, fn)
        return fn

    return wrap

# A number: optional sign glued to it (ASCII, unicode minus, en dash), optional $, thousands groups, decimals.
_NUM = r"[-+\u2212\u2013]?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
# ...that is a value, not the first operand of an expression ("is 1 + 5 = 6" must not read 1).
_VALUE = "(" + _NUM + r")(?![\d.,]*\s*[-+*/x\u00d7\u2212\u2013=^]\s*\d)"
_OPEN = r"\s*:?\s*(?:(?:indeed|actually|simply|just|exactly)\s+)?[\"'*(]*\s*"
_ANSWER_TAG = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.IGNORECASE | re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*(" + _NUM + ")")
# "The (final) answer (to this problem) is 7", "Answer: 7", "the sum is 7", "result = 7".
_ANSWER_IS = re.compile(
    r"(?:answer|result|sum|difference|total)\b[^.\n\d=]{0,40}?(?:\bis|:|=|\bequals|\bwould be|\bwill be)"
    + _OPEN + _VALUE,
    re.IGNORECASE,
)
# "4 + 3 equals 7", "9 minus 9 results in 0", "it is 7".
_IS = re.compile(r"\b(?:is|equals|results in|gives|makes)" + _OPEN + _VALUE, re.IGNORECASE)
_AFTER_EQUALS = re.compile(r"=" + _OPEN + _VALUE)
_LEADING = re.compile(r"^" + _OPEN + "(" + _NUM + r")(?![\w%])")


def _clean_number(text: str) -> str:
    return text.replace("\u2212", "-").replace("\u2013", "-").replace("$", "").replace(",", "")


def extract_answer(text: str) -> str | None:
    """The answer in a model response, or ``None`` when there is none.

    Rules, first match wins (measured on SmolLM2-135M-Instruct's answers to ``chain_sum``, see
    ``bench/answer_extraction.py``): the last ``<answer>…</answer>`` (an unclosed tag runs to the end),
    the last ``\\boxed{…}``, the last ``#### X`` (GSM8K), the first "answer is X" / "Answer: X" /
    "the sum is X", the last "equals X" / "results in X" / "is X", the value after the last ``=``, and a
    number that opens the response ("7", "7.", "-4 is the answer"). A number followed by an operator and
    another number is an expression, not a value ("is 1 + 5 = 6" reads 6). Other numbers in running
    text are ignored on purpose: SmolLM2 often restates the operands, and reading those would reward
    noise. Tag and boxed contents are returned stripped and as they are; numbers lose ``$``, thousands
    commas and a unicode minus (``-4``, ``1000.5``). Raises TypeError for a non-str ``text``.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects a str, got {type(text).__name__}")
    tags = _ANSWER_TAG.findall(text)
    if tags and tags[-1].strip():
        return tags[-1].strip()
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    for pattern, pick in ((_HASHES, -1), (_ANSWER_IS, 0), (_IS, -1), (_AFTER_EQUALS, -1), (_LEADING, 0)):
        found = pattern.findall(text)
        if found:
            return _clean_number(found[pick])
    return None


# ------------------------------------------------------------------------------------ reward functions


@lru_cache(maxsize=64)
def _rg_scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


@register_reward("reasoning_gym")
def reasoning_gym_reward(response_text: str, ground_truth: dict) -> float:
    """reasoning-gym: ``extract_answer`` then the task's own ``score_answer(answer, entry)`` (in [0, 1]).

    ``ground_truth`` is ``{"task": name, "answer": ..., "metadata": {...}}`` as built by
    ``controller.tasks``. Raises KeyError when ``task`` is missing, ValueError for an unknown task.
    """
    entry = {"answer": ground_truth["answer"], "metadata": ground_truth.get("metadata", {})}
    return float(_rg_scorer(ground_truth["task"])(extract_answer(response_text), entry))


@register_reward("tiny_repeat")
def tiny_repeat_reward(response_text: str, ground_truth: dict) -> float:
    """``tiny_repeat``: 1.0 when the response's first word is ``ground_truth["answer"]``, else 0.0."""
    words = response_text.split()
    return 1.0 if words and words[0] == ground_truth["answer"] else 0.0


def _gold_text(answer) -> str:
    text = str(answer)
    hashes = _HASHES.search(text)  # GSM8K solutions end in "#### 72"
    return _clean_number(hashes.group(1)) if hashes else text


class _DisabledTimeoutNotice(logging.Filter):
    """Drops math-verify's "Timeout is disabled ..." warning: off the main thread its timeouts are off on
    purpose (the roller bounds each reward call with ``rollout.reward_timeout_s``); every other record of
    math-verify passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_DISABLED_TIMEOUT_NOTICE = _DisabledTimeoutNotice()


def _quiet_math_verify() -> None:
    """Install ``_DisabledTimeoutNotice`` on math-verify's loggers (idempotent)."""
    for name in ("math_verify.parser", "math_verify.grader"):
        log = logging.getLogger(name)
        if _DISABLED_TIMEOUT_NOTICE not in log.filters:
            log.addFilter(_DISABLED_TIMEOUT_NOTICE)


@register_reward("math_verify")
def math_verify_reward(response_text: str, ground_truth: dict) -> float:
    """GSM8K-style numeric check with math-verify (Kydlíček et al., HuggingFace ``math-verify``).

    The gold answer is ``ground_truth["answer"]`` (a GSM8K ``#### 72`` tail is honoured); the
    response is parsed twice — the whole text and ``extract_answer``'s pick — and scores 1.0 if either
    verifies against the gold, else 0.0. math-verify's signal-based timeouts only work in the main
    thread; elsewhere they are disabled (the roller bounds each call with its own timeout), without
    math-verify's warning about it.
    """
    from math_verify import parse, verify

    _quiet_math_verify()

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_gold_text(ground_truth["answer"]), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {ground_truth['answer']!r}")
    candidates = [response_text]
    picked = extract_answer(response_text)
    if picked is not None:
        candidates.append(picked)
    for candidate in candidates:
        parsed = parse(candidate, parsing_timeout=timeout)
        if parsed and verify(gold, parsed, timeout_seconds=timeout):
            return 1.0
    return 0.0


def load_user_reward(spec: str) -> RewardFn:
    """Import ``module:name`` (e.g. ``my_pkg.rewards:score``): the reward the module registers as ``name``,
    else its function ``name``; raises ValueError if it is not callable or cannot be imported, naming the
    spec."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"rollout.reward={spec!r}: a user reward must look like 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail to import in any way: a config error either way
        raise ValueError(f"rollout.reward={spec!r}: cannot import {module_name!r}: "
                         f"{type(exc).__name__}: {exc}") from exc
    fn = REWARDS.get(attr) if attr in REWARDS else getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"rollout.reward={spec!r}: {module_name!r} has no callable {attr!r}")
    try:
        inspect.signature(fn).bind("response text", {})
    except TypeError as exc:
        raise ValueError(f"rollout.reward={spec!r}: a reward is called as fn(response_text: str, ground_truth: "
                         f"dict) -> float; {attr!r} cannot be: {exc}") from exc
    except ValueError:  # no signature to read (some builtins): it is called and judged by its results
        pass
    return fn


def build_reward_fn(spec: str) -> RewardFn:
    """The reward function for ``spec`` (``rollout.reward`` with ``auto`` already resolved by the controller,
    ``controller.tasks.resolve_reward``). Raises ValueError for ``auto`` or an unknown spec."""
    if isinstance(spec, str) and ":" in spec:
        return load_user_reward(spec)
    if spec == "auto":
        raise ValueError("rollout.reward='auto' must be resolved from data.task by the controller "
                         "(controller.tasks.resolve_reward) before it reaches the rollers")
    return REWARDS.get(spec)


# ------------------------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class RewardResult:
    """The outcome of one reward call: ``score`` (finite) when ``error`` is None, else NaN."""

    score: float
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


def reward_result(value) -> RewardResult:
    """What a reward function returned, as a result: a finite real number (``numbers.Real``: bool, Fraction
    and numpy scalars included; numpy's bool; ``decimal.Decimal``) is its score; anything else, NaN, ±inf or a
    number too large for a float fails it (never 0)."""
    if not isinstance(value, numbers.Real | np.bool_ | decimal.Decimal):
        return RewardResult(math.nan, f"reward returned {type(value).__name__} {value!r}, not a number")
    try:
        score = float(value)
    except (OverflowError, ValueError, TypeError) as exc:  # 10**400; a Real subclass that will not convert
        return RewardResult(math.nan, f"reward returned a {type(value).__name__} that is not a float: {exc}")
    if not math.isfinite(score):
        return RewardResult(math.nan, f"reward returned {score}")
    return RewardResult(score)
