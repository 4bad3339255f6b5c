"""Generations on disk: every ``metrics.dump_every`` trainer steps, the decoded samples of that step — and
of the validation round at that weight version — appended to ``RUN_DIR/generations.jsonl``.

Decoding happens where the data lives: rollers already decode responses for the reward and, with
``metrics.dump_every`` > 0, also put the text (``response_text``) beside the tensors; the feeder keeps the
user message and ground truth of every prompt it issued. ``PromptFeeder.dump_rows(meta)`` reads the
response text from the TransferQueue, adds its own prompt by ``uid`` and returns rows
(``common.schema.GENERATION_DUMP``); the controller sends metadata (sample ids and tags) and gets strings
back, never a tensor. One line per sample::

    {"kind": "train" | "validation", "step": 8, "weight_version": 7, "uid": "s7.p3", "prompt": "...",
     "response": "...", "ground_truth": {...}, "reward": 1.0, "greedy": 0, "min_weight_version": 7,
     "max_weight_version": 7, "finish_reason": "stop", "response_length": 12}

``weight_version``: for a trained sample, the version of the weights it was trained from (``step`` − 1);
for a validation sample, the version the round evaluated (its ``step`` is that version too).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

GENERATIONS_FILE = "generations.jsonl"


class GenerationDump:
    """Appends dumps to ``run_dir/generations.jsonl`` every ``dump_every`` steps (0 = never); ``rt``: the
    job's ``Runtime`` (its PromptFeeder actor's ``dump_rows``)."""

    def __init__(self, run_dir: str | Path, dump_every: int, rt):
        self.path = Path(run_dir) / GENERATIONS_FILE
        self.dump_every, self.rt = dump_every, rt

    def due(self, step: int) -> bool:
        """Whether ``step`` (a trainer step, or a validated weight version: 0 included) is dumped."""
        return bool(self.dump_every) and step % self.dump_every == 0

    async def __call__(self, meta, kind: str, step: int, weight_version: int) -> int:
        """Dump ``meta``'s samples when ``step`` is due; returns the number of lines written (0 if not)."""
        if not self.due(step):
            return 0
        rows = await self.rt.feeder.dump_rows.remote(meta)
        lines = "".join(json.dumps({"kind": kind, "step": step, "weight_version": weight_version, **row}) + "\n"
                        for row in rows)
        await asyncio.to_thread(self._append, lines)
        return len(rows)

    def _append(self, text: str) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(text)
