"""The task registry: prompts plus ground truth, from reasoning-gym, a file, or the synthetic ``tiny-repeat``.

``load_task_records(task, ...)`` returns a list of ``TaskRecord(prompt, ground_truth)``; the ground truth
is a small JSON-able dict (it travels to the roller through the TransferQueue, and the reward function
scores against it in another process):

==================  ==========================================================================
``data.task``       ground truth
==================  ==========================================================================
reasoning-gym name  ``{"task": name, "answer": entry["answer"], "metadata": entry["metadata"]}``
``tiny-repeat``     ``{"answer": symbol}``
``*.jsonl``         ``{"answer": row[answer_key]}``
``*.parquet``       ``{"answer": row[answer_key]}``
==================  ==========================================================================

``tiny-repeat`` is a prompt-dependent task the tiny model of ``common.models`` can learn in seconds:
the prompt is ``repeat the word c`` (4 words of the tiny vocabulary) and the answer is the symbol, drawn
uniformly from the first ``num_symbols`` letters (default 8: a constant answer scores 1/8 in
expectation; a random tiny model, whose vocabulary has ~50 words, scores about 1/50).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TINY_REPEAT = "tiny-repeat"
FILE_SUFFIXES = (".jsonl", ".parquet")
TINY_REPEAT_MAX_SYMBOLS = 26


@dataclass(frozen=True)
class TaskRecord:
    """One dataset row: ``prompt`` (the user message, before the chat template), its ``ground_truth``, and
    for a file row its ``source`` (``FILE:LINE`` or ``FILE row N``, counting from 1) for error messages."""

    prompt: str
    ground_truth: dict[str, Any]
    source: str = ""


def task_kind(task: str) -> str:
    """``file`` | ``tiny_repeat`` | ``reasoning_gym`` for a ``data.task`` value (no I/O).

    Raises ValueError for a path with another suffix or a name reasoning-gym does not know.
    """
    if task == TINY_REPEAT:
        return "tiny_repeat"
    if task.endswith(FILE_SUFFIXES):
        return "file"
    if "/" in task or "." in Path(task).name:
        raise ValueError(f"data.task={task!r}: a dataset file must end in one of {list(FILE_SUFFIXES)}")
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = sorted(name for name in DATASETS if task[:4] in name)[:8]
        raise ValueError(
            f"data.task={task!r} is not a reasoning-gym task, {TINY_REPEAT!r}, or a .jsonl/.parquet file"
            + (f" (similar reasoning-gym tasks: {close})" if close else "")
        )
    return "reasoning_gym"


def load_task_records(
    task: str,
    size: int,
    seed: int = 0,
    task_kwargs: dict[str, Any] | None = None,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> list[TaskRecord]:
    """The rows of ``task`` in dataset order (shuffling per epoch is the feeder's job).

    ``size`` and ``seed`` apply to generated tasks (reasoning-gym, tiny-repeat); a file yields all its
    rows. ``task_kwargs`` go to the reasoning-gym dataset config (or ``num_symbols`` for tiny-repeat).
    Raises ValueError naming the key for unknown tasks, bad kwargs, missing files or columns, and
    ground truth that is not JSON-able.
    """
    kwargs = dict(task_kwargs or {})
    kind = task_kind(task)
    if kind == "tiny_repeat":
        return tiny_repeat_records(size, seed, **_tiny_kwargs(kwargs))
    if kind == "file":
        if kwargs:
            raise ValueError(f"data.task_kwargs={kwargs} given, but a file task ({task!r}) takes none")
        return file_records(Path(task), prompt_key, answer_key)
    return reasoning_gym_records(task, size, seed, kwargs)


def _tiny_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = set(kwargs) - {"num_symbols"}
    if unknown:
        raise ValueError(f"data.task_kwargs has {sorted(unknown)}; tiny-repeat accepts only ['num_symbols']")
    return kwargs


def tiny_repeat_records(size: int, seed: int = 0, num_symbols: int = 8) -> list[TaskRecord]:
    """``size`` prompts ``repeat the word <s>`` with ``<s>`` uniform over the first ``num_symbols`` letters.

    Raises ValueError unless 2 <= ``num_symbols`` <= 26.
    """
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


def file_records(path: Path, prompt_key: str, answer_key: str) -> list[TaskRecord]:
    """Rows of a ``.jsonl`` or ``.parquet`` file (read with pyarrow) with ``prompt_key``/``answer_key``.

    Errors and ``TaskRecord.source`` name a row as ``FILE:LINE`` for ``.jsonl`` (lines count from 1, blank
    ones included, as an editor shows them) and ``FILE row N`` for ``.parquet`` (rows count from 1).
    """
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


def to_json_object(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """``obj`` round-tripped through JSON (tuples become lists); raises ValueError naming ``where`` if it
    holds something JSON cannot carry."""
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"ground truth of {where} is not JSON-able: {exc}") from exc


def encode_ground_truth(ground_truth: dict[str, Any]) -> str:
    """The wire form of a ground truth (compact JSON text), as carried in the ``ground_truth`` field."""
    return json.dumps(ground_truth, separators=(",", ":"))


def decode_ground_truth(text: str | bytes) -> dict[str, Any]:
    """Inverse of ``encode_ground_truth``; raises ValueError on malformed input."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"ground truth must decode to a dict, got {type(value).__name__}")
    return value
