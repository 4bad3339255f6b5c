"""The task registry: what ``data.task`` names — prompts plus ground truth — loaded by the controller's
prompt feeder (``controller.data``).

A task is a registered, typed plug-in (:class:`Task`): its loader and the reward that
``rollout.reward=auto`` picks for it. ``resolve_task(spec)`` accepts, in order:

==========================  ================================================  ==========================
``data.task``               ground truth                                      reward for ``auto``
==========================  ================================================  ==========================
a registered name           what the loader returns                           the task's ``reward``
  ``tiny_repeat``           ``{"answer": symbol}``                            ``tiny_repeat``
``module:name``             a user task: importing ``module`` registers it     the task's ``reward``
``*.jsonl`` / ``*.parquet`` ``{"answer": row[answer_key]}``                   ``math_verify``
a reasoning-gym name        ``{"task": name, "answer": ..., "metadata": ...}``  ``reasoning_gym``
==========================  ================================================  ==========================

Anything else raises ValueError naming ``data.task``, the registered tasks and similar reasoning-gym
names. A user task::

    # my_tasks.py (on PYTHONPATH)
    from controller.tasks import TaskRecord, register_task

    @register_task("my_sums", reward="math_verify")
    def my_sums(size: int, seed: int, **task_kwargs) -> list[TaskRecord]:
        ...

    # data.task=my_tasks:my_sums

``load_task_records(task, ...)`` returns a list of ``TaskRecord(prompt, ground_truth)`` in dataset order;
the ground truth is a small JSON-able dict (it travels to the roller through the TransferQueue,
``common.ground_truth``, and the reward function scores against it in another process).

``tiny_repeat`` is a prompt-dependent task the tiny model of ``common.models`` can learn in seconds:
the prompt is ``repeat the word c`` (4 words of the tiny vocabulary) and the answer is the symbol, drawn
uniformly from the first ``num_symbols`` letters (default 8: a constant answer scores 1/8 in
expectation; a random tiny model, whose vocabulary has ~50 words, scores about 1/50).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.ground_truth import to_json_object
from common.registry import Registry

TINY_REPEAT = "tiny_repeat"
RENAMED = {"tiny-repeat": TINY_REPEAT}  # old data.task spellings: refused with the new name, never accepted
FILE_SUFFIXES = (".jsonl", ".parquet")
TINY_REPEAT_MAX_SYMBOLS = 26


@dataclass(frozen=True)
class TaskRecord:
    """One dataset row: ``prompt`` (the user message, before the chat template), its ``ground_truth``, and
    for a file row its ``source`` (``FILE:LINE`` or ``FILE row N``, counting from 1) for error messages."""

    prompt: str
    ground_truth: dict[str, Any]
    source: str = ""


TaskLoader = Callable[..., Sequence[TaskRecord]]


@dataclass(frozen=True)
class Task:
    """A task plug-in. ``load(size, seed, **task_kwargs)`` returns its records (``data.size``,
    ``data.seed``, ``data.task_kwargs``; a file task ignores ``size`` and ``seed``); ``reward``: the
    ``rollout.reward`` value ``auto`` resolves to (a built-in reward name or ``module:function``)."""

    name: str
    load: TaskLoader
    reward: str


TASKS: Registry[Task] = Registry("task", "data.task")


def register_task(name: str, *, reward: str) -> Callable[[TaskLoader], TaskLoader]:
    """Decorator registering ``fn`` as the :class:`Task` ``name`` whose ``auto`` reward is ``reward``
    (returns ``fn`` unchanged). Raises ValueError on a duplicate name or an empty ``reward``."""

    def wrap(fn: TaskLoader) -> TaskLoader:
        if not reward:
            raise ValueError(f"task {name!r} needs a reward (what rollout.reward=auto picks)")
        TASKS.register(name, Task(name, fn, reward))
        return fn

    return wrap


def resolve_task(spec: str, prompt_key: str = "prompt", answer_key: str = "answer") -> Task:
    """The :class:`Task` ``spec`` (``data.task``) names, as in the module docstring's table (no data is
    read; a file is bound to ``prompt_key``/``answer_key``). Raises ValueError naming ``data.task``."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"data.task must be a non-empty string, got {spec!r}")
    if spec in RENAMED:
        raise ValueError(f"data.task={spec!r} is now spelled {RENAMED[spec]!r} (data.task={RENAMED[spec]})")
    if spec in TASKS or ":" in spec:
        return TASKS.get(spec)
    if spec.endswith(FILE_SUFFIXES):
        path = Path(spec)
        return Task(spec, lambda size, seed, **kw: file_records(path, prompt_key, answer_key, kw), "math_verify")
    if "/" in spec or "." in Path(spec).name:
        raise ValueError(f"data.task={spec!r}: a dataset file must end in one of {list(FILE_SUFFIXES)}")
    from reasoning_gym.factory import DATASETS

    if spec not in DATASETS:
        close = sorted(name for name in DATASETS if spec[:4] in name)[:8]
        raise ValueError(
            f"data.task={spec!r} is not a registered task {TASKS.names()}, 'module:name' of a task plug-in, "
            "a reasoning-gym task, or a .jsonl/.parquet file"
            + (f" (similar reasoning-gym tasks: {close})" if close else "")
        )
    return Task(spec, lambda size, seed, **kw: reasoning_gym_records(spec, size, seed, kw), "reasoning_gym")


def resolve_reward(reward: str, task: str) -> str:
    """``rollout.reward`` as the rollers get it: ``auto`` becomes the reward of ``data.task=task`` (the
    task's ``reward``, see ``resolve_task``); any other value is returned unchanged (the rollers check it,
    ``rollers.rewards.build_reward_fn``). Raises ValueError naming ``data.task`` for an unknown task."""
    return resolve_task(task).reward if reward == "auto" else reward


def load_task_records(
    task: str,
    size: int,
    seed: int = 0,
    task_kwargs: dict[str, Any] | None = None,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> list[TaskRecord]:
    """The rows of ``task`` in dataset order (shuffling per epoch is the feeder's job).

    ``size`` and ``seed`` apply to generated tasks (reasoning-gym, tiny_repeat, most plug-ins); a file
    yields all its rows. ``task_kwargs`` go to the task's loader (the reasoning-gym dataset config,
    ``num_symbols`` for tiny_repeat). Raises ValueError naming the key for unknown tasks, bad kwargs,
    missing files or columns, records that are not ``TaskRecord`` s, and ground truth that is not JSON-able.
    """
    plugin = resolve_task(task, prompt_key, answer_key)
    kwargs = dict(task_kwargs or {})
    try:
        records = list(plugin.load(size, seed, **kwargs))
    except TypeError as exc:  # a plug-in's loader called with kwargs it does not take
        raise ValueError(f"data.task_kwargs={kwargs} rejected by task {task!r}: {exc}") from exc
    for index, record in enumerate(records):
        if not isinstance(record, TaskRecord) or not isinstance(record.prompt, str):
            raise ValueError(f"data.task={task!r}: record {index} is {record!r}, not a TaskRecord with a str prompt")
    return [TaskRecord(r.prompt, to_json_object(r.ground_truth, r.source or f"{task} row {i + 1}"), r.source)
            for i, r in enumerate(records)]


# ------------------------------------------------------------------------------------ built-in tasks


@register_task(TINY_REPEAT, reward="tiny_repeat")
def tiny_repeat_records(size: int, seed: int = 0, **task_kwargs: Any) -> list[TaskRecord]:
    """``size`` prompts ``repeat the word <s>`` with ``<s>`` uniform over the first ``num_symbols`` letters
    (the only kwarg, default 8). Raises ValueError for other kwargs or unless 2 <= ``num_symbols`` <= 26.
    """
    unknown = set(task_kwargs) - {"num_symbols"}
    if unknown:
        raise ValueError(f"data.task_kwargs has {sorted(unknown)}; tiny_repeat accepts only ['num_symbols']")
    num_symbols = task_kwargs.get("num_symbols", 8)
    if not 2 <= num_symbols <= TINY_REPEAT_MAX_SYMBOLS:
        raise ValueError(
            f"data.task_kwargs.num_symbols must be in [2, {TINY_REPEAT_MAX_SYMBOLS}], got {num_symbols}"
        )
    symbols = "abcdefghijklmnopqrstuvwxyz"[:num_symbols]
    rng = random.Random(seed)
    picks = [rng.choice(symbols) for _ in range(size)]
    return [TaskRecord(f"repeat the word {s}", {"answer": s}) for s in picks]


def reasoning_gym_records(task: str, size: int, seed: int, kwargs: dict[str, Any]) -> list[TaskRecord]:
    """``size`` entries of the reasoning-gym dataset ``task`` built with ``seed`` and ``kwargs``."""
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"data.task_kwargs={kwargs} rejected by reasoning-gym task {task!r}: {exc}") from exc
    records = []
    for index, entry in enumerate(dataset):
        ground_truth = {"task": task, "answer": entry["answer"], "metadata": entry.get("metadata", {})}
        records.append(TaskRecord(entry["question"], to_json_object(ground_truth, f"{task} row {index}")))
    return records


def file_records(path: Path, prompt_key: str, answer_key: str,
                 kwargs: dict[str, Any] | None = None) -> list[TaskRecord]:
    """Rows of a ``.jsonl`` or ``.parquet`` file (read with pyarrow) with ``prompt_key``/``answer_key``.
    Raises ValueError for ``kwargs`` (a file takes none), a missing file, bad JSON or a missing column.

    Errors and ``TaskRecord.source`` name a row as ``FILE:LINE`` for ``.jsonl`` (lines count from 1, blank
    ones included, as an editor shows them) and ``FILE row N`` for ``.parquet`` (rows count from 1).
    """
    if kwargs:
        raise ValueError(f"data.task_kwargs={kwargs} given, but a file task ({str(path)!r}) takes none")
    if not path.is_file():
        raise ValueError(f"data.task={str(path)!r}: file does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [(f"{path} row {n}", row) for n, row in enumerate(pq.read_table(path).to_pylist(), start=1)]
    else:
        rows = []
        with path.open(encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{path}:{line_no}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: not valid JSON: {exc}") from exc
    records = []
    for where, row in rows:
        for key, name in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
            if not isinstance(row, dict) or key not in row:
                present = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{where}: no column {name}={key!r} (columns: {present})")
        if not isinstance(row[prompt_key], str):
            raise ValueError(f"{where}: column {prompt_key!r} must be a string")
        records.append(TaskRecord(row[prompt_key], to_json_object({"answer": row[answer_key]}, where), where))
    if not records:
        raise ValueError(f"data.task={str(path)!r}: the file has no rows")
    return records
