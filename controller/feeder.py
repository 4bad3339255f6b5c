"""The prompt feeder: reads the dataset, templates and tokenizes prompts, and puts admitted prompt groups
into the TransferQueue. It runs as a Ray actor so that the controller never holds a tensor: the controller
says *how many* groups to start; the feeder answers with their ``uid``s.

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

from common import schema
from controller.config import HFlowConfig
from controller.data import Prompt, PromptDataset, prompt_fields


class PromptFeeder:
    """Puts prompt groups (one prompt row each) into partition ``partition`` of the TransferQueue on request;
    validation prompts into ``val_partition``.

    ``num_batches``: prompt batches (of ``data.train_batch_size``) the run consumes; the feeder never
    produces beyond them — except with ``algorithm.dynamic_sampling``, whose refills draw further prompts
    of the same stream (in order, so no prompt twice in an epoch), up to every batch of ``data.epochs``.
    Raises ValueError (from ``PromptDataset``) when the data cannot provide them, naming the dataset size,
    ``data.train_batch_size``, ``data.epochs`` and the steps asked for.
    """

    def __init__(self, cfg: HFlowConfig, tq_handle: dict, partition: str, num_batches: int,
                 val_partition: str = ""):
        from common.env import set_torch_threads
        from common.models import load_tokenizer
        from transferqueue.client import TQClient
        from transferqueue.records import TQHandle

        set_torch_threads(1)
        tokenizer = load_tokenizer(cfg.model)
        self.pad_token_id = tokenizer.pad_token_id
        self.partition = partition
        self.dataset = PromptDataset.from_config(cfg.data, tokenizer)
        self.dataset.check_total_steps(num_batches)
        self.val_partition = val_partition
        self.val_dataset = PromptDataset.from_config(cfg.data, tokenizer, "val") if cfg.data.val_size else None
        self._pending: deque[tuple[str, int, Prompt]] = deque()
        if cfg.algorithm.dynamic_sampling:  # refills may use every prompt the epochs provide
            num_batches = self.dataset.num_available_steps()
        self._num_batches = num_batches
        self._batches = self.dataset.batches(num_batches)
        self._by_uid: dict[str, tuple[int, Prompt]] = {}
        self._reissues: dict[str, int] = {}
        self._requeued: deque[str] = deque()  # issued prompts (base uids) to feed again before the stream
        self._num_fed = 0  # prompts taken from the stream (re-issues not counted)
        self.client = TQClient(TQHandle.from_dict(tq_handle))

    def dataset_size(self) -> int:
        return len(self.dataset)

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
        self.client.put(data, self.val_partition, tags=tags)
        return uids

    def dump_rows(self, meta) -> list[dict]:
        """The decoded samples of ``meta`` (a BatchMeta of finished samples) as JSON-able rows: ``uid``,
        ``prompt``, ``response``, ``ground_truth``, ``reward``, ``greedy``, ``min_weight_version``,
        ``max_weight_version``, ``finish_reason``, ``response_length`` (tokens). Needs
        ``metrics.dump_every`` > 0 (the rollers put ``response_text`` only then); the prompt (the user message
        before the chat template) and ground truth are this feeder's own, found by ``uid``."""
        batch = self.client.get_data(meta, list(schema.GENERATION_DUMP.read_fields()))
        rows = []
        for i, tag in enumerate(meta.tags):
            prompt = self._prompt_of(str(tag[schema.UID]))
            rows.append({
                "uid": tag[schema.UID],
                "prompt": prompt.text,
                "response": batch[schema.RESPONSE_TEXT][i],
                "ground_truth": prompt.ground_truth,
                "reward": float(tag[schema.REWARD]),
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
                self._pending.append((f"s{batch.global_step}.p{pos}", batch.global_step, prompt))
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
                self._pending.append((f"s{batch.global_step}.p{pos}", batch.global_step, prompt))
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
        self.client.put(data, self.partition, tags=tags)
        return [{"uid": uid, "global_step": step} for uid, step, _ in picked]

    def close(self) -> None:
        self.client.close()
