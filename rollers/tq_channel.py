"""The roller's channel over the TransferQueue: take one prompt row per group, put the group's samples.

``TQGroupChannel`` implements ``rollers.roller.GroupChannel`` with a ``transferqueue.client.TQClient``;
each roller process builds its own (``TQGroupChannel.from_handle``). The feeder stores each prompt once,
as one row of the prompt partition; the roller turns it into ``rollout.n`` sample rows of the sample
partition, then clears it; the put itself marks the prompt row consumed by ``ANSWERED_TASK`` in the same
index step, so a roller that dies between the put and the clear leaves a row that says its group is done
(``controller.pool.find_orphans`` clears it rather than re-issue a group that may be trained already).
With a validation ``GroupSource`` (``controller.validation``), validation groups
are taken first, without waiting, from their own prompt partition and put into their own partition.
"""

from __future__ import annotations

from dataclasses import dataclass

from common import schema
from common.ground_truth import decode_ground_truth
from rollers.groups import GroupResult, PromptGroup
from rollers.response_fields import response_digest
from transferqueue.records import Consume

ROLLOUT_TASK = "rollout"  # the rollers' consumer task of prompt rows
ANSWERED_TASK = "answered"  # marks a prompt row whose group's samples are put (atomically with the put)
_TAG_TYPES = {"int": int, "str": str, "float": float}  # a tag's declared dtype (common.schema.Field.dtype)


@dataclass(frozen=True)
class GroupSource:
    """A second source of groups for ``TQGroupChannel``: validation prompt rows in ``prompt_partition``,
    each answered by ``group_size`` samples put into ``partition``, the last ``num_greedy`` decoded
    greedily. Taken before training groups."""

    prompt_partition: str
    partition: str
    group_size: int
    num_greedy: int = 0


class TQGroupChannel:
    """A ``GroupChannel`` over the TransferQueue (``transferqueue.client.TQClient``).

    ``take_group``: ``aget_meta(ROLLER.reads fields, 1, task, prompt_partition)`` long-polls for one prompt
    row the ``task`` (default ``rollout``) has not consumed (put by ``controller.data.prompt_fields``), then
    ``aget_data``; the prompt is its ``input_ids`` where ``attention_mask`` is 1. ``put_group``: ``aput`` of
    ``n`` new rows into ``partition``: the prompt row's ``input_ids``/``attention_mask`` beside each
    sample's response fields, with the tags ``uid``, ``min_weight_version``, ``max_weight_version``,
    ``finish_reason``, ``response_length``, ``reward`` (the sequence reward), ``greedy`` (0/1) and
    ``response_digest``; with ``put_text``, also ``response_text`` (for generation dumps), marking the prompt
    row consumed by ``ANSWERED_TASK`` in the same index step. Then the prompt row is cleared. Every put is
    checked against ``common.schema.ROLLER`` (ValueError on a mismatch).
    ``validation``: a ``GroupSource`` polled (without waiting) before each take of a training group.
    """

    def __init__(self, client, prompt_partition: str, partition: str, n: int, task: str = ROLLOUT_TASK,
                 put_timeout_s: float = 60.0, validation: GroupSource | None = None, put_text: bool = False):
        if n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {n}")
        self.client, self.prompt_partition, self.partition, self.n, self.task = (
            client, prompt_partition, partition, n, task)
        self.put_timeout_s = put_timeout_s
        self.validation, self.put_text = validation, put_text

    @classmethod
    def from_handle(cls, handle: dict, prompt_partition: str, partition: str, n: int,
                    validation: GroupSource | None = None, put_text: bool = False) -> TQGroupChannel:
        """A channel with its own ``TQClient`` of the TransferQueue ``handle`` (``TQHandle.to_dict()``), taking
        prompts from ``prompt_partition`` and putting groups of ``n`` into ``partition``: what each roller
        process builds (bind the arguments with ``functools.partial`` to get a ``channel_factory``; Ray ships
        it by reference)."""
        from transferqueue.client import TQClient
        from transferqueue.records import TQHandle

        return cls(TQClient(TQHandle.from_dict(handle)), prompt_partition, partition, n, validation=validation,
                   put_text=put_text)

    async def take_group(self, timeout_s: float) -> PromptGroup | None:
        v = self.validation
        if v is not None:  # validation first, without waiting: a round is small and its rows name a version
            group = await self._take(v.prompt_partition, v.partition, v.group_size, 0.0, v.num_greedy,
                                     validation=True)
            if group is not None:
                return group
        return await self._take(self.prompt_partition, self.partition, self.n, timeout_s)

    async def _take(self, prompt_partition: str, partition: str, size: int, timeout_s: float,
                    num_greedy: int = 0, validation: bool = False) -> PromptGroup | None:
        meta = await self.client.aget_meta(list(schema.ROLLER.read_fields()), 1, self.task, prompt_partition,
                                           timeout_s=timeout_s)
        if len(meta) == 0:
            return None
        batch = await self.client.aget_data(meta)
        # (1, prompt_len) each: a variable-width field comes back as a list of rows
        ids, mask = (batch[name][0].reshape(1, -1) for name in (schema.INPUT_IDS, schema.ATTENTION_MASK))
        tag = meta.tags[0]
        if not isinstance(tag.get(schema.UID), str):
            raise ValueError(f"prompt row {meta.sample_ids[0]} has no str {schema.UID!r} tag: {tag}")
        return PromptGroup(tag[schema.UID], meta.sample_ids[0], size, tuple(ids[0][mask[0].bool()].tolist()),
                           decode_ground_truth(batch[schema.GROUND_TRUTH][0]), num_greedy, validation, partition,
                           str(tag.get(schema.SEED_KEY, "")),
                           {schema.INPUT_IDS: ids, schema.ATTENTION_MASK: mask})

    async def put_group(self, result: GroupResult) -> None:
        group, fields = result.group, result.fields
        n = len(result.rewards)
        # build_response_fields' per-sample values the contract declares tags (weight versions, finish
        # reason, length) travel as tags only; the rest are stored fields.
        as_tags = [name for name in fields if name in schema.FIELDS and schema.FIELDS[name].tag]
        tags = [
            {schema.UID: group.uid}
            | {name: _TAG_TYPES[schema.FIELDS[name].dtype](fields[name][i]) for name in as_tags}
            | {schema.REWARD: float(result.rewards[i]), schema.RESPONSE_DIGEST: response_digest(fields, i),
               schema.GREEDY: int(bool(result.greedy and result.greedy[i]))}
            for i in range(n)
        ]
        data = {name: value.repeat(n, 1) for name, value in group.prompt_fields.items()}
        data |= {k: v for k, v in fields.items() if k not in as_tags}
        if self.put_text:
            data[schema.RESPONSE_TEXT] = list(result.texts)
        schema.check_batch(schema.ROLLER, data, tags)
        prompts = self.validation.prompt_partition if group.validation and self.validation else self.prompt_partition
        await self.client.aput(data, group.partition or self.partition, tags=tags, timeout_s=self.put_timeout_s,
                               consume=Consume(prompts, [group.prompt_id], ANSWERED_TASK))
        await self.client.aclear(prompts, [group.prompt_id])
