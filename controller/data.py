"""The dataset side of the prompt feeder: load a task, template and tokenize it, and count the steps.

``PromptDataset.splits(data_cfg, tokenizer)`` loads ``data.task`` (``controller.tasks``), applies the
chat template (``common.models.apply_chat_template``, with ``data.system_prompt`` as a system turn when
set) and enforces ``data.max_prompt_length``: a longer prompt raises ValueError naming its row (``data row
N``, counting from 1, or ``FILE:LINE`` for a ``.jsonl`` file) and length, or, with
``data.skip_long_prompts``, is skipped, counted (``num_skipped``) and logged.
``check_context(context_length)`` rejects a prompt that leaves no room for a response in the model's
context (run at start by the prompt feeder, ``controller.feeder.PromptFeeder``); one with some room is served, its responses
truncated at the limit.

Held-out prompts (``data.val_size``) are held out by text: ``load_split`` draws them after the training rows,
passing over every row whose normalised text (``normalised_text``: whitespace collapsed, before the chat
template) occurs in training, and raises ValueError naming the keys when the task cannot supply them.

Step arithmetic. The prompts form one stream: epoch 0's order, then epoch 1's, ... (each epoch reshuffled
with ``data.seed + epoch`` when ``data.shuffle``), and step k takes the stream's next
``data.train_batch_size`` prompts, so a step may span two epochs (every schedule admits prompt groups
from this stream; fully-async's steps are not aligned to batches at all)::

    available steps = ceil(size * data.epochs / batch)    (a final partial step is a step)
                    = floor(size * data.epochs / batch)   (data.drop_last=true)

``check_total_steps`` rejects a run whose ``trainer.total_steps`` exceeds the available steps, naming
dataset size, ``data.train_batch_size``, ``data.epochs`` and ``trainer.total_steps``.
``PromptDataset.batches(total_steps)`` yields exactly ``total_steps`` ``PromptBatch`` es and stops —
nothing is produced beyond the last step, so a feeder that prefetches never has a batch to cancel.
``prompt_fields(prompts, pad_token_id, uids)`` builds the TransferQueue prompt rows and tags of a batch:
one row per prompt group under its ``uid`` tag (the rollers write the ``rollout.n`` samples).
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common import schema
from common.ground_truth import encode_ground_truth
from common.models import apply_chat_template
from controller.config import DataConfig
from controller.tasks import FILE_SUFFIXES, TaskRecord, load_task_records

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One tokenized prompt. ``index``: its row in the task's records (stable across epochs, from 0);
    ``input_ids``: chat-templated token ids, unpadded; ``ground_truth``: the task's JSON-able answer;
    ``where``: how messages name its row (``data row N`` counting from 1, or a file's ``FILE:LINE``);
    ``text``: the user message before the chat template (for generation dumps)."""

    index: int
    input_ids: tuple[int, ...]
    ground_truth: dict[str, Any]
    where: str = ""
    text: str = ""


@dataclass(frozen=True)
class PromptBatch:
    """The prompts of one training step (``global_step`` from 0); ``epoch`` (from 0) is its first prompt's
    (a step may span two epochs: see the module docstring)."""

    global_step: int
    epoch: int
    prompts: tuple[Prompt, ...]


VAL_DRAW_FACTORS = (1, 2, 4, 8, 16)  # a procedural task's held-out candidates per round, in val_size rows


def normalised_text(prompt: str) -> str:
    """``prompt`` (the user message, before the chat template) with every run of whitespace one space and
    none at either end: the text two prompts are compared by when held-out prompts are chosen."""
    return " ".join(prompt.split())


@dataclass(frozen=True)
class DataSplit:
    """The training and held-out records of a run (``load_split``); held-out prompts are distinct by text
    (except with ``data.val_disjoint=false``). ``num_val_skipped``: rows passed over while the held-out set
    was drawn because their normalised text occurs in training or was already held out (a file task: was
    kept for training); ``num_val_seen``: held-out prompts whose text does occur in training
    (only with ``data.val_disjoint=false``; 0 otherwise)."""

    train: list[TaskRecord]
    val: list[TaskRecord]
    num_val_skipped: int = 0
    num_val_seen: int = 0


def load_split(cfg: DataConfig) -> DataSplit:
    """The training and held-out records of ``cfg`` (held-out empty when ``data.val_size`` is 0).

    Held out means held out by text: no held-out prompt's normalised text (``normalised_text``) occurs among
    the training prompts, whatever row it came from.

    * A procedural task (reasoning-gym, tiny_repeat, a plug-in) draws row i from its seed and i alone
      (reasoning-gym's ``Random(seed + i)``), so training is its first ``data.size`` rows, as without
      validation, and the held-out prompts are drawn from the rows after them, in order, passing over every
      row whose text occurs in training or among the prompts already held out, until ``val_size`` are
      found; the candidates grow ``val_size``, 2×, 4×, ... up to 16× ``val_size`` rows
      (``VAL_DRAW_FACTORS``). A different seed would not do: reasoning-gym's row i of seed s+1 is row i+1 of
      seed s. A plug-in that returns another number of rows than asked (fixed rows) is split like a file.
    * A file task (no ``data.val_file``): the held-out prompts are drawn from its last rows backwards; a row
      whose text occurs in the rows before it, or among the rows already passed over, is passed over and
      trains (so no row is lost); training is every row not held out.
    * ``data.val_file``: its first ``val_size`` rows whose text occurs neither in training nor earlier in
      the file.

    With ``data.val_disjoint=false`` the held-out prompts are the ``val_size`` rows after the training ones
    (a file: its last ``val_size``; ``data.val_file``: its first), whatever their text, and ``num_val_seen``
    counts those that occur in training (a task with few distinct prompts: tiny_repeat has at most 26).

    Raises ValueError naming ``data.val_size``, ``data.task``, ``data.task_kwargs``, ``data.size`` (or
    ``data.val_file``) and ``data.val_disjoint`` when the task cannot supply ``val_size`` unseen prompts,
    or when too few rows are left for training.
    """
    def load(task: str, size: int, kwargs) -> list[TaskRecord]:
        return load_task_records(task, size, cfg.seed, kwargs, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)

    if not cfg.val_size:
        return DataSplit(load(cfg.task, cfg.size, cfg.task_kwargs), [])
    if cfg.val_file:
        train = load(cfg.task, cfg.size, cfg.task_kwargs)
        rows = load(cfg.val_file, cfg.val_size, {})
        val, skipped = _unseen(rows, _texts(train), cfg.val_size, cfg.val_disjoint)
        if len(val) < cfg.val_size:
            raise ValueError(f"data.val_size={cfg.val_size} but data.val_file={cfg.val_file!r} has {len(rows)} rows"
                             + (f", {skipped} of them training prompts or repeats (data.val_disjoint=true)"
                                if skipped else ""))
        return DataSplit(train, val, skipped, _num_seen(val, train))
    if cfg.task.endswith(FILE_SUFFIXES):
        return _file_split(load(cfg.task, 0, cfg.task_kwargs), cfg)
    for factor in VAL_DRAW_FACTORS if cfg.val_disjoint else (1,):
        records = load(cfg.task, cfg.size + factor * cfg.val_size, cfg.task_kwargs)
        if len(records) != cfg.size + factor * cfg.val_size:  # a plug-in of fixed rows: they are all there is
            return _file_split(records, cfg)
        train, rows = records[: cfg.size], records[cfg.size:]
        val, skipped = _unseen(rows, _texts(train), cfg.val_size, cfg.val_disjoint)
        if len(val) == cfg.val_size:
            return DataSplit(train, val, skipped, _num_seen(val, train))
    raise ValueError(
        f"data.val_size={cfg.val_size}: data.task={cfg.task!r} with data.task_kwargs={dict(cfg.task_kwargs)} "
        f"gave only {len(val)} prompts whose text does not occur among its data.size={cfg.size} training "
        f"prompts, in the {len(rows)} rows it gave after them ({skipped} repeat a training prompt): held-out "
        "prompts must be unseen. Widen the task (data.task_kwargs), lower data.val_size or data.size, give "
        "data.val_file, or set data.val_disjoint=false to validate on rows that may repeat training prompts")


def _texts(records: Sequence[TaskRecord]) -> set[str]:
    return {normalised_text(r.prompt) for r in records}


def _num_seen(val: Sequence[TaskRecord], train: Sequence[TaskRecord]) -> int:
    texts = _texts(train)
    return sum(normalised_text(r.prompt) in texts for r in val)


def _unseen(rows: Sequence[TaskRecord], train_texts: set[str], want: int,
            disjoint: bool) -> tuple[list[TaskRecord], int]:
    """The first ``want`` of ``rows`` whose text is neither in ``train_texts`` nor an earlier one's (any
    ``want`` rows unless ``disjoint``), and how many rows were passed over to find them."""
    if not disjoint:
        return list(rows[:want]), 0
    val, skipped, seen = [], 0, set(train_texts)
    for row in rows:
        if len(val) == want:
            break
        text = normalised_text(row.prompt)
        if text in seen:
            skipped += 1
        else:
            val.append(row)
            seen.add(text)
    return val, skipped


def _file_split(records: list[TaskRecord], cfg: DataConfig) -> DataSplit:
    """``load_split`` of a file task: held-out rows drawn from the end (see there)."""
    if len(records) <= cfg.val_size:
        raise ValueError(f"data.val_size={cfg.val_size} leaves no training rows: data.task={cfg.task!r} has "
                         f"{len(records)} rows (lower data.val_size, or give data.val_file)")
    if not cfg.val_disjoint:
        train, val = records[: -cfg.val_size], records[-cfg.val_size:]
        return DataSplit(train, val, 0, _num_seen(val, train))
    before = Counter(normalised_text(r.prompt) for r in records)  # texts of the rows not yet walked
    held, num_passed, passed_texts = [], 0, set()  # held: row positions, from the end
    for pos in range(len(records) - 1, -1, -1):
        if len(held) == cfg.val_size:
            break
        text = normalised_text(records[pos].prompt)
        before[text] -= 1  # now the texts of rows 0..pos-1
        if before[text] > 0 or text in passed_texts:  # it trains: a row before it, or one passed over, says so
            num_passed += 1
            passed_texts.add(text)
        else:
            held.append(pos)
    kept = set(held)
    train = [r for i, r in enumerate(records) if i not in kept]
    if len(held) < cfg.val_size or not train:
        raise ValueError(
            f"data.val_size={cfg.val_size}: data.task={cfg.task!r} has {len(records)} rows but only "
            f"{len(held)} prompts whose text occurs nowhere else in it, with rows left for training: held-out "
            "prompts must be unseen. Lower data.val_size, give data.val_file, or set data.val_disjoint=false "
            "to hold out its last rows whatever their text")
    return DataSplit(train, [records[i] for i in sorted(held)], num_passed, 0)


def num_available_steps(dataset_size: int, train_batch_size: int, epochs: int, drop_last: bool = False) -> int:
    """Training steps ``epochs`` passes give (see the module docstring); raises ValueError on sizes or
    epochs < 1."""
    if dataset_size < 1 or train_batch_size < 1:
        raise ValueError(f"dataset size ({dataset_size}) and train_batch_size ({train_batch_size}) must be >= 1")
    if epochs < 1:
        raise ValueError(f"data.epochs must be >= 1, got {epochs}")
    total = dataset_size * epochs
    return total // train_batch_size if drop_last else math.ceil(total / train_batch_size)


def check_total_steps(
    dataset_size: int, train_batch_size: int, epochs: int, total_steps: int, drop_last: bool = False
) -> int:
    """Returns the available steps; raises ValueError naming dataset size, ``data.train_batch_size``,
    ``data.epochs`` and ``trainer.total_steps`` when ``total_steps`` asks for more."""
    available = num_available_steps(dataset_size, train_batch_size, epochs, drop_last)
    if total_steps > available:
        raise ValueError(
            f"trainer.total_steps={total_steps} exceeds the {available} steps the data provides: "
            f"dataset size {dataset_size} prompts, data.train_batch_size={train_batch_size}, "
            f"data.epochs={epochs} (data.drop_last={drop_last}); lower trainer.total_steps or raise "
            "data.epochs / data.size"
        )
    return available


class PromptDataset:
    """Tokenized prompts of one task plus the epoch/batch iteration of the feeder."""

    def __init__(self, prompts: Sequence[Prompt], cfg: DataConfig, num_skipped: int = 0,
                 num_val_skipped: int = 0, num_val_seen: int = 0):
        if not prompts:
            raise ValueError(
                f"data.task={cfg.task!r}: no prompts left"
                + (f" after skipping {num_skipped} longer than data.max_prompt_length" if num_skipped else "")
            )
        self.prompts = tuple(prompts)
        self.cfg = cfg
        self.num_skipped = num_skipped
        self.num_val_skipped, self.num_val_seen = num_val_skipped, num_val_seen  # a held-out set's: ``DataSplit``

    @classmethod
    def splits(cls, cfg: DataConfig, tokenizer) -> tuple[PromptDataset, PromptDataset | None]:
        """The training and validation datasets of ``cfg`` (validation None without ``data.val_size``), from
        one load of ``cfg.task`` (``load_split``), each row templated and tokenized once; raises ValueError
        as described in the module docstring."""
        split = load_split(cfg)
        val = (cls.from_records(split.val, cfg, tokenizer, split.num_val_skipped, split.num_val_seen)
               if cfg.val_size else None)
        return cls.from_records(split.train, cfg, tokenizer), val

    @classmethod
    def from_records(cls, records: Sequence[TaskRecord], cfg: DataConfig, tokenizer, num_val_skipped: int = 0,
                     num_val_seen: int = 0) -> PromptDataset:
        """Template and tokenize ``records``, enforcing ``cfg.max_prompt_length``; a held-out set's counts
        (``DataSplit``) are kept as ``num_val_skipped`` / ``num_val_seen``."""
        prompts, skipped = [], []
        for index, record in enumerate(records):
            ids = apply_chat_template(tokenizer, record.prompt, cfg.system_prompt or None)
            where = record.source or f"data row {index + 1}"
            if len(ids) > cfg.max_prompt_length:
                if not cfg.skip_long_prompts:
                    raise ValueError(
                        f"{where}: prompt is {len(ids)} tokens after the chat template, longer than "
                        f"data.max_prompt_length={cfg.max_prompt_length} (raise it, or set "
                        "data.skip_long_prompts=true to skip such rows)"
                    )
                skipped.append(index + 1)
                continue
            prompts.append(Prompt(index, tuple(ids), record.ground_truth, where, record.prompt))
        if skipped:
            logger.warning(
                "skipped %d of %d prompts longer than data.max_prompt_length=%d (rows %s%s, counting from 1)",
                len(skipped), len(records), cfg.max_prompt_length, skipped[:10], "..." if len(skipped) > 10 else "",
            )
        return cls(prompts, cfg, len(skipped), num_val_skipped, num_val_seen)

    def __len__(self) -> int:
        return len(self.prompts)

    def num_available_steps(self) -> int:
        return num_available_steps(len(self), self.cfg.train_batch_size, self.cfg.epochs, self.cfg.drop_last)

    def check_context(self, context_length: int) -> None:
        """Raise ValueError naming the first prompt (row and length) that leaves no room for one response
        token within the model's ``context_length`` (prompt + response, tokens). A prompt with some room is
        served: a response cut by the context limit is truncated (``finish_reason=length``)."""
        for prompt in self.prompts:
            if len(prompt.input_ids) >= context_length:
                raise ValueError(
                    f"{prompt.where or f'data row {prompt.index + 1}'}: prompt is {len(prompt.input_ids)} tokens "
                    "after the chat template, "
                    f"leaving no room for a response within the model's context length of {context_length} "
                    "tokens (lower data.max_prompt_length below it, and set data.skip_long_prompts=true to skip "
                    "such rows)"
                )

    def check_total_steps(self, total_steps: int) -> int:
        """``check_total_steps`` for this dataset (size after skipped rows)."""
        return check_total_steps(len(self), self.cfg.train_batch_size, self.cfg.epochs, total_steps,
                                 self.cfg.drop_last)

    def epoch_order(self, epoch: int) -> list[int]:
        """Positions of the prompts in ``epoch``: shuffled with ``data.seed + epoch`` when ``data.shuffle``."""
        order = list(range(len(self)))
        if self.cfg.shuffle:
            random.Random(self.cfg.seed + epoch).shuffle(order)
        return order

    def batches(self, total_steps: int, start_step: int = 0) -> Iterator[PromptBatch]:
        """Exactly the batches of steps ``start_step`` .. ``total_steps - 1`` (resume starts mid-run).

        Raises ValueError (``check_total_steps``) before yielding anything if the data is too short.
        """
        self.check_total_steps(total_steps)
        if not 0 <= start_step <= total_steps:
            raise ValueError(f"start_step={start_step} must be in [0, trainer.total_steps={total_steps}]")
        size, end = self.cfg.train_batch_size, len(self) * self.cfg.epochs
        orders: dict[int, list[int]] = {}
        for step in range(start_step, total_steps):
            positions = range(step * size, min((step + 1) * size, end))  # in the stream of all epochs
            picked = []
            for pos in positions:
                epoch, within = divmod(pos, len(self))
                if epoch not in orders:
                    orders[epoch] = self.epoch_order(epoch)
                picked.append(self.prompts[orders[epoch][within]])
            yield PromptBatch(step, positions[0] // len(self), tuple(picked))


def prompt_fields(
    prompts: Sequence[Prompt], pad_token_id: int, uids: Sequence[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The prompt rows of ``prompts``: one row per prompt group (``common.schema.FEEDER``), each prompt
    stored once whatever ``rollout.n``.

    Returns ``(data, tags)`` ready for ``TQClient.put(data, partition, tags=tags)`` (what
    ``rollers.tq_channel.TQGroupChannel`` reads), with batch = ``len(prompts)``: ``data`` holds
    ``input_ids`` (batch, prompt_len) int64 left-padded with ``pad_token_id``, ``attention_mask``
    (batch, prompt_len) int64 and ``ground_truth`` (batch JSON str, ``common.ground_truth.encode_ground_truth``);
    ``tags[j]`` is ``{"uid": uids[j]}``. Raises ValueError when ``uids`` and ``prompts`` differ in length
    or ``prompts`` is empty.
    """
    if len(uids) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(uids)} uids")
    if not prompts:
        raise ValueError("need at least one prompt, got none")
    width = max(len(p.input_ids) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        length = len(prompt.input_ids)
        input_ids[row, width - length:] = torch.tensor(prompt.input_ids, dtype=torch.int64)
        attention_mask[row, width - length:] = 1
    data = {
        schema.INPUT_IDS: input_ids,
        schema.ATTENTION_MASK: attention_mask,
        schema.GROUND_TRUTH: [encode_ground_truth(p.ground_truth) for p in prompts],
    }
    return data, [{schema.UID: uid} for uid in uids]
