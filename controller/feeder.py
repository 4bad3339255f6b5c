"""The prompt feeder: reads the dataset, templates and tokenizes prompts, and puts admitted prompt groups
into the TransferQueue. It runs as a Ray actor so that the controller never holds a tensor: the controller
says *how many* groups to start; the feeder answers with their ``uid``s.

It holds the run's only copy of the data: started before any pool (``controller.runtime.start_feeder``),
it loads, templates, tokenizes and checks the data once, and the controller learns only ``DataFacts``
(counts, the longest prompt) or the ValueError that names what is wrong with the data (exit 2 at start).

Each group is stored as one prompt row under its ``uid`` (``controller.data.prompt_fields``, the
contract's ``common.schema.FEEDER``); a roller turns it into the group's ``rollout.n`` sample rows.
``uid`` = ``s<global_step>.p<position>`` — deterministic, so the per-sample seeds
(``rollers.response_fields.sample_seed``) and hence the responses do not depend on the schedule.
A re-issued prompt (``stale_policy=drop``, or in flight at a job checkpoint) gets ``uid`` + ``.r<k>``.

``state()``/``restore(state)``: the data position a job checkpoint keeps (prompts taken from the stream,
re-issue counts, prompts queued again); a restored feeder continues the stream where the saved one stopped
and can re-issue any prompt it issued before, since a ``uid`` names its place in the stream. ``requeue(uids)``
queues issued prompts to be fed again (``.r<k>`` uids) before the stream's next ones: the prompts a trainer
restart takes back (``controller.trainer_restart``), admitted again under the usual rules.

Validation (``data.val_size``): ``feed_validation(round)`` puts every held-out prompt as one prompt row
(answered by ``val.n`` sampled samples + 1 greedy one with ``val.greedy``) under ``uid`` =
``v<round>.p<position>`` into the validation prompt partition. Generation dumps (``metrics.dump_every``):
``dump_rows(meta)`` reads the decoded responses of finished samples from the TransferQueue and takes
their prompt text and ground truth from its own prompts by ``uid``, so the controller receives strings
and tags, never tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common import schema
from controller.config import HFlowConfig
from controller.data import Prompt, PromptDataset, prompt_fields
from controller.schedules import SCHEDULES


@dataclass(frozen=True)
class DataFacts:
    """What the controller learns of the run's data (``PromptFeeder.facts``): counts and lengths, never a
    prompt. ``num_prompts``: training prompts (after rows skipped as longer than ``data.max_prompt_length``:
    ``num_skipped``); ``num_val_prompts``: held-out prompts (``data.val_size``), ``num_val_skipped`` rows
    passed over to draw them (their text occurs in training) and ``num_val_seen`` of them that occur in
    training (``data.val_disjoint=false`` only: ``controller.data.DataSplit``); ``max_prompt_tokens``: the
    longest prompt of either after the chat template; ``num_available_steps``: training steps the data gives
    (``controller.data.num_available_steps``)."""

    num_prompts: int
    num_skipped: int
    num_val_prompts: int
    num_val_skipped: int
    num_val_seen: int
    max_prompt_tokens: int
    num_available_steps: int


class PromptFeeder:
    """Holds the run's prompts and puts prompt groups (one prompt row each) into partition ``partition`` of
    the TransferQueue on request; validation prompts into ``val_partition``.

    The constructor is the run's only load of the data: it loads ``data.task`` once, the training and
    validation rows together (``PromptDataset.splits``), templates and tokenizes each row once, and checks
    the data against the run: ``num_batches`` prompt batches (of ``data.train_batch_size``) must be available, and
    every prompt must leave room for a response within ``context_length`` tokens (the model's context;
    None: not checked). It raises ValueError naming the problem (``PromptDataset``'s messages: the dataset
    size, ``data.train_batch_size``, ``data.epochs`` and the steps asked for; or the offending row and its
    length). ``connect(tq_handle)`` then attaches it to the TransferQueue, which it puts into.

    The feeder never produces beyond ``num_batches`` — except with ``algorithm.dynamic_sampling``, whose
    refills draw further prompts of the same stream (in order, so no prompt twice in an epoch), up to every
    batch of ``data.epochs``; so, in fully-async, do the replacements of failed groups
    (``rollers.on_failed_group=skip``, ``controller.stages.Stages.check_rollers``; the stream is sized so
    in every fully-async run, whatever that key, so that a resume may change it).
    """

    def __init__(self, cfg: HFlowConfig, num_batches: int, context_length: int | None, partition: str,
                 val_partition: str = ""):
        from common.env import set_torch_threads
        from common.models import load_tokenizer

        set_torch_threads(1)
        tokenizer = load_tokenizer(cfg.model)
        self.pad_token_id = tokenizer.pad_token_id
        self.partition = partition
        self.dataset, self.val_dataset = PromptDataset.splits(cfg.data, tokenizer)
        self.dataset.check_total_steps(num_batches)
        self.val_partition = val_partition
        if context_length is not None:
            for dataset in (self.dataset, self.val_dataset):
                if dataset is not None:
                    dataset.check_context(context_length)
        self._pending: deque[tuple[str, int, Prompt]] = deque()
        # refills and replacements of failed groups: every epoch's prompts
        if cfg.algorithm.dynamic_sampling or SCHEDULES.get(cfg.mode).replaces_failed:
            num_batches = self.dataset.num_available_steps()
        self._num_batches = num_batches
        self._batches = self.dataset.batches(num_batches)
        self._by_uid: dict[str, tuple[int, Prompt]] = {}
        self._reissues: dict[str, int] = {}
        self._requeued: deque[str] = deque()  # issued prompts (base uids) to feed again before the stream
        self._num_fed = 0  # prompts taken from the stream (re-issues not counted)
        self.client = None

    def connect(self, tq_handle: dict) -> None:
        """Put into the TransferQueue of ``tq_handle`` (``TQHandle.to_dict()``) from now on."""
        from transferqueue.client import TQClient
        from transferqueue.records import TQHandle

        self.client = TQClient(TQHandle.from_dict(tq_handle))

    def _client(self):
        if self.client is None:
            raise RuntimeError("the prompt feeder is not connected to a TransferQueue (connect first)")
        return self.client

    def facts(self) -> DataFacts:
        """Counts and lengths of the data this feeder holds (see ``DataFacts``)."""
        datasets = [d for d in (self.dataset, self.val_dataset) if d is not None]
        val = self.val_dataset
        return DataFacts(len(self.dataset), self.dataset.num_skipped, len(val) if val is not None else 0,
                         val.num_val_skipped if val is not None else 0, val.num_val_seen if val is not None else 0,
                         max(len(p.input_ids) for d in datasets for p in d.prompts),
                         self.dataset.num_available_steps())

    def feed_validation(self, round_index: int) -> list[str]:
        """Put every validation prompt as one prompt row into the validation partition; returns their uids
        ``v<round_index>.p<position>``. Their ``seed_key`` tag ``val.p<position>`` makes every round draw the
        same sampling seeds, so rounds differ by weights, not by sampling noise. Raises RuntimeError when the
        run has no validation set."""
        if self.val_dataset is None or not self.val_partition:
            raise RuntimeError("feed_validation without data.val_size (no validation set)")
        prompts = self.val_dataset.prompts
        uids = [f"v{round_index}.p{pos}" for pos in range(len(prompts))]
        data, tags = prompt_fields(prompts, self.pad_token_id, uids)
        for j, tag in enumerate(tags):  # every round samples prompt p with the same seeds (common random numbers)
            tag[schema.SEED_KEY] = f"val.p{j}"
        schema.check_batch(schema.FEEDER, data, tags)
        self._client().put(data, self.val_partition, tags=tags)
        return uids

    def dump_rows(self, meta) -> list[dict]:
        """The decoded samples of ``meta`` (a BatchMeta of finished samples) as JSON-able rows: ``uid``,
        ``prompt``, ``response``, ``ground_truth``, ``reward``, ``greedy``, ``min_weight_version``,
        ``max_weight_version``, ``finish_reason``, ``response_length`` (tokens). Needs
        ``metrics.dump_every`` > 0 (the rollers put ``response_text`` only then); the prompt (the user message
        before the chat template) and ground truth are this feeder's own, found by ``uid``."""
        batch = self._client().get_data(meta, list(schema.GENERATION_DUMP.read_fields()))
        rows = []
        for i, tag in enumerate(meta.tags):
            prompt = self._prompt_of(str(tag[schema.UID]))
            rows.append({
                schema.UID: tag[schema.UID],
                "prompt": prompt.text,
                "response": batch[schema.RESPONSE_TEXT][i],
                schema.GROUND_TRUTH: prompt.ground_truth,
                schema.REWARD: float(tag[schema.REWARD]),
                **{k: tag.get(k) for k in schema.DUMP_TAGS if k not in (schema.UID, schema.REWARD)},
            })
        return rows

    def _prompt_of(self, uid: str) -> Prompt:
        """The prompt issued under ``uid``: validation ``v<round>.p<position>``, or training
        ``s<step>.p<position>`` with any ``.r<k>`` re-issue suffix. ValueError for another uid."""
        if uid.startswith("v") and self.val_dataset is not None:
            try:
                return self.val_dataset.prompts[int(uid.rsplit(".p", 1)[1])]
            except (ValueError, IndexError) as exc:
                raise ValueError(f"uid {uid!r} names no validation prompt (v<round>.p<position>)") from exc
        return self._issued(uid.split(".r")[0])[1]

    def _next(self) -> tuple[str, int, Prompt] | None:
        if self._requeued:
            return self._reissued(self._requeued.popleft())
        if not self._pending:
            batch = next(self._batches, None)
            if batch is None:
                return None
            for pos, prompt in enumerate(batch.prompts):
                self._pending.append((schema.train_uid(batch.global_step, pos), batch.global_step, prompt))
        self._num_fed += 1
        return self._pending.popleft()

    def state(self) -> dict:
        """The data position: ``num_fed`` (prompts taken from the stream of every epoch, in order),
        ``reissues`` (base uid -> times re-issued), ``requeued`` (base uids queued to be fed again, in order)
        and ``exhausted`` (neither the stream nor the queue has a prompt left for the run's batches). JSON-able."""
        size = self.dataset.cfg.train_batch_size
        stream = min(self._num_batches * size, len(self.dataset) * self.dataset.cfg.epochs)
        return {"num_fed": self._num_fed, "reissues": dict(self._reissues), "requeued": list(self._requeued),
                "exhausted": self._num_fed >= stream and not self._requeued}

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
                self._pending.append((schema.train_uid(batch.global_step, pos), batch.global_step, prompt))
        self._num_fed = num_fed
        self._reissues = {str(k): int(v) for k, v in state["reissues"].items()}
        # A checkpoint written before the queue existed has none.
        self._requeued = deque(str(u) for u in state.get("requeued", []))

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
        """Put up to ``num_groups`` prompt groups, the requeued ones first, then the stream's next; returns
        ``[{"uid", "global_step"}]`` of those put (fewer when the data is exhausted)."""
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
        return self._put([self._reissued(uid) for uid in uids])

    def requeue(self, uids: list[str]) -> None:
        """Queue the prompts of ``uids`` (issued before; their groups are gone) to be fed again, under fresh
        uids, by the next ``feed`` calls, before any new prompt of the stream. Raises ValueError for a uid this
        run's data does not name (nothing is queued then)."""
        bases = [uid.split(".r")[0] for uid in uids]
        for base in bases:
            self._issued(base)
        self._requeued.extend(bases)

    def _reissued(self, uid: str) -> tuple[str, int, Prompt]:
        """(fresh uid ``<base>.r<k>``, step, prompt) of issued ``uid``; counts the re-issue."""
        base = uid.split(".r")[0]
        step, prompt = self._issued(base)
        self._reissues[base] = self._reissues.get(base, 0) + 1
        return f"{base}.r{self._reissues[base]}", step, prompt

    def _put(self, picked: list[tuple[str, int, Prompt]]) -> list[dict]:
        if not picked:
            return []
        for uid, step, prompt in picked:
            self._by_uid.setdefault(uid, (step, prompt))
        data, tags = prompt_fields([p for _, _, p in picked], self.pad_token_id, [u for u, _, _ in picked])
        schema.check_batch(schema.FEEDER, data, tags)
        self._client().put(data, self.partition, tags=tags)
        return [{"uid": uid, "global_step": step} for uid, step, _ in picked]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class FeederActor(PromptFeeder):
    """``PromptFeeder`` as a Ray actor (``controller.runtime.start_feeder``): a ValueError of the constructor
    (bad data for the run) is kept and raised by ``facts()``, so it reaches the controller as that
    ValueError; Ray would report a constructor's error only as the actor's death. The caller then kills it."""

    def __init__(self, *args, **kwargs):
        self._start_error: ValueError | None = None
        try:
            super().__init__(*args, **kwargs)
        except ValueError as exc:
            self._start_error = exc

    def facts(self) -> DataFacts:
        if self._start_error is not None:
            raise self._start_error
        return super().facts()
