"""The dataset side of the prompt feeder: load a task, template and tokenize it, and count the steps.

``PromptDataset.splits(data_cfg, tokenizer)`` loads ``data.task`` (``controller.tasks``), applies the
chat template (``common.models.apply_chat_template``, with ``data.system_prompt`` as a system turn when
set) and enforces ``data.max_prompt_length``: a longer prompt raises ValueError naming its row (``data row
N``, counting from 1, or ``FILE:LINE`` for a ``.jsonl`` file) and length, or, with
``data.skip_long_prompts``, is skipped, counted (``num_skipped``) and logged.
``check_context(context_length)`` rejects a prompt that leaves no room for a response in the model's
context (run at start by the prompt feeder, ``controller.feeder.PromptFeeder``); one with some room is served, its responses
truncated at the limit.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common import schema
from common.ground_truth import encode_ground_truth
from common.models import apply_chat_template
from controller.config import DataConfig
from controller.tasks import TaskRecord, load_task_records

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


def load_split(cfg: DataConfig) -> tuple[list[TaskRecord], list[TaskRecord]]:
    """The training and validation records of ``cfg`` (validation empty when ``data.val_size`` is 0).

    Held-out rows of ``data.task``: the task is loaded with ``size + val_size`` rows and the last
    ``val_size`` are held out (a procedural task draws row i from its seed and i alone — reasoning-gym's
    ``Random(seed + i)``, tiny_repeat's stream — so the training rows are those of ``size`` rows; a file
    keeps all but its last ``val_size`` rows for training). A different seed would not do: reasoning-gym's
    row i of seed s+1 is row i+1 of seed s. With ``data.val_file``, its first ``val_size`` rows. Disjoint
    by row; a task with few distinct prompts (tiny_repeat has ``num_symbols``) repeats prompt texts.
    Raises ValueError naming ``data.val_size`` when too few rows are left for either side.
    """
    def load(task: str, size: int, kwargs) -> list[TaskRecord]:
        return load_task_records(task, size, cfg.seed, kwargs, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)

    if not cfg.val_size:
        return load(cfg.task, cfg.size, cfg.task_kwargs), []
    if cfg.val_file:
        val = load(cfg.val_file, cfg.val_size, {})
        if len(val) < cfg.val_size:
            raise ValueError(f"data.val_size={cfg.val_size} but data.val_file={cfg.val_file!r} has {len(val)} rows")
        return load(cfg.task, cfg.size, cfg.task_kwargs), val[: cfg.val_size]
    records = load(cfg.task, cfg.size + cfg.val_size, cfg.task_kwargs)
    if len(records) <= cfg.val_size:
        raise ValueError(f"data.val_size={cfg.val_size} leaves no training rows: data.task={cfg.task!r} has "
                         f"{len(records)} rows (lower data.val_size, or give data.val_file)")
    return records[: -cfg.val_size], records[-cfg.val_size:]


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

    def __init__(self, prompts: Sequence[Prompt], cfg: DataConfig, num_skipped: int = 0):
        if not prompts:
            raise ValueError(
                f"data.task={cfg.task!r}: no prompts left"
                + (f" after skipping {num_skipped} longer than data.max_prompt_length" if num_skipped else "")
            )
        self.prompts = tuple(prompts)
        self.cfg = cfg
        self.num_skipped = num_skipped

    @classmethod
    def splits(cls, cfg: DataConfig, tokenizer) -> tuple[PromptDataset, PromptDataset | None]:
        """The training and validation datasets of ``cfg`` (validation None without ``data.val_size``), from
        one load of ``cfg.task`` (``load_split``), each row templated and tokenized once; raises ValueError
        as described in the module docstring."""
        train, val = load_split(cfg)
        return cls.from_records(train, cfg, tokenizer), cls.from_records(val, cfg, tokenizer) if cfg.val_size else None

    @classmethod
    def from_records(cls, records: Sequence[TaskRecord], cfg: DataConfig, tokenizer) -> PromptDataset:
        """Template and tokenize ``records``, enforcing ``cfg.max_prompt_length``."""
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
        return cls(prompts, cfg, num_skipped=len(skipped))

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
