"""The prompt feeder: reads the dataset, templates and tokenizes prompts, and puts admitted prompt groups
into the TransferQueue. It runs as a Ray actor so that the controller never holds a tensor: the controller
says *how many* groups to start; the feeder answers with their ``uid``s.

Each group is ``rollout.n`` rows of the same prompt under one ``uid``
(``controller.data.prompt_fields``). ``uid`` = ``s<global_step>.p<position>`` — deterministic, so the
per-sample seeds (``rollers.roller.sample_seed``) and hence the responses do not depend on the schedule.
A re-issued prompt (``stale_policy=drop``, or in flight at a job checkpoint) gets ``uid`` + ``.r<k>``.

``state()``/``restore(state)``: the data position a job checkpoint keeps (prompts taken from the stream,
re-issue counts); a restored feeder continues the stream where the saved one stopped and can re-issue any
prompt it issued before, since a ``uid`` names its place in the stream.
"""

from __future__ import annotations

from collections import deque

from controller.config import HFlowConfig
from controller.data import Prompt, PromptDataset, prompt_fields


class PromptFeeder:
    """Puts prompt groups into partition ``partition`` of the TransferQueue on request.

    ``num_batches``: prompt batches (of ``data.train_batch_size``) the run consumes; the feeder never
    produces beyond them — except with ``algorithm.dynamic_sampling``, whose refills draw further prompts
    of the same stream (in order, so no prompt twice in an epoch), up to every batch of ``data.epochs``.
    Raises ValueError (from ``PromptDataset``) when the data cannot provide them, naming the dataset size,
    ``data.train_batch_size``, ``data.epochs`` and the steps asked for.
    """

    def __init__(self, cfg: HFlowConfig, tq_handle: dict, partition: str, num_batches: int):
        from common.env import set_torch_threads
        from common.models import load_tokenizer
        from transferqueue.client import TQClient
        from transferqueue.records import TQHandle

        set_torch_threads(1)
        tokenizer = load_tokenizer(cfg.model)
        self.pad_token_id = tokenizer.pad_token_id
        self.n = cfg.rollout.n
        self.partition = partition
        self.dataset = PromptDataset.from_config(cfg.data, tokenizer)
        self.dataset.check_total_steps(num_batches)
        self._pending: deque[tuple[str, int, Prompt]] = deque()
        if cfg.algorithm.dynamic_sampling:  # refills may use every prompt the epochs provide
            num_batches = self.dataset.num_available_steps()
        self._num_batches = num_batches
        self._batches = self.dataset.batches(num_batches)
        self._by_uid: dict[str, tuple[int, Prompt]] = {}
        self._reissues: dict[str, int] = {}
        self._num_fed = 0  # prompts taken from the stream (re-issues not counted)
        self.client = TQClient(TQHandle.from_dict(tq_handle))

    def dataset_size(self) -> int:
        return len(self.dataset)

    def _next(self) -> tuple[str, int, Prompt] | None:
        if not self._pending:
            batch = next(self._batches, None)
            if batch is None:
                return None
            for pos, prompt in enumerate(batch.prompts):
                self._pending.append((f"s{batch.global_step}.p{pos}", batch.global_step, prompt))
        self._num_fed += 1
        return self._pending.popleft()

    def state(self) -> dict:
        """The data position: ``num_fed`` (prompts taken from the stream of every epoch, in order),
        ``reissues`` (base uid -> times re-issued) and ``exhausted`` (the stream has no prompt left for
        the run's batches). JSON-able."""
        size = self.dataset.cfg.train_batch_size
        stream = min(self._num_batches * size, len(self.dataset) * self.dataset.cfg.epochs)
        return {"num_fed": self._num_fed, "reissues": dict(self._reissues), "exhausted": self._num_fed >= stream}

    def restore(self, state: dict) -> None:
        """Continue from ``state`` (:meth:`state` of a feeder of the same data config): the next prompt fed
        is the stream's ``num_fed``-th. Raises ValueError when ``num_fed`` is past the run's batches."""
        num_fed, size = int(state["num_fed"]), self.dataset.cfg.train_batch_size
        step, within = divmod(num_fed, size)
        if not 0 <= step <= self._num_batches or (step == self._num_batches and within):
            raise ValueError(f"a data position of {num_fed} prompts is past the run's {self._num_batches} batches "
                             f"of data.train_batch_size={size}")
        self._pending.clear()
        self._batches = self.dataset.batches(self._num_batches, start_step=step)
        if within:
            batch = next(self._batches)
            for pos, prompt in enumerate(batch.prompts[within:], start=within):
                self._pending.append((f"s{batch.global_step}.p{pos}", batch.global_step, prompt))
        self._num_fed = num_fed
        self._reissues = {str(k): int(v) for k, v in state["reissues"].items()}

    def _issued(self, base: str) -> tuple[int, Prompt]:
        """The step and prompt of issued uid ``base`` (``s<step>.p<pos>``); ValueError for another uid."""
        if base in self._by_uid:
            return self._by_uid[base]
        try:
            step, pos = (int(part[1:]) for part in base.split("."))
            return step, next(self.dataset.batches(step + 1, start_step=step)).prompts[pos]
        except (ValueError, IndexError, StopIteration) as exc:
            raise ValueError(f"uid {base!r} names no prompt of this run's data (s<step>.p<position>)") from exc

    def feed(self, num_groups: int) -> list[dict]:
        """Put up to ``num_groups`` new prompt groups; returns ``[{"uid", "global_step"}]`` of those put
        (fewer when the data is exhausted)."""
        picked = []
        while len(picked) < num_groups:
            item = self._next()
            if item is None:
                break
            picked.append(item)
        return self._put(picked)

    def reissue(self, uids: list[str]) -> list[dict]:
        """Put the prompts of ``uids`` again under fresh uids (dropped as too stale, or in flight at a job
        checkpoint); returns them. Raises ValueError for a uid this run's data does not name."""
        picked = []
        for uid in uids:
            base = uid.split(".r")[0]
            step, prompt = self._issued(base)
            self._reissues[base] = self._reissues.get(base, 0) + 1
            picked.append((f"{base}.r{self._reissues[base]}", step, prompt))
        return self._put(picked)

    def _put(self, picked: list[tuple[str, int, Prompt]]) -> list[dict]:
        if not picked:
            return []
        for uid, step, prompt in picked:
            self._by_uid.setdefault(uid, (step, prompt))
        data, tags = prompt_fields([p for _, _, p in picked], self.n, self.pad_token_id, [u for u, _, _ in picked])
        self.client.put(data, self.partition, tags=tags)
        return [{"uid": uid, "global_step": step} for uid, step, _ in picked]

    def close(self) -> None:
        self.client.close()
