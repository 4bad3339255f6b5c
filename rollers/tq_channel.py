"""The roller's channel over the TransferQueue: take whole prompt groups, put their response fields back.

``TQGroupChannel`` implements ``rollers.roller.GroupChannel`` with a ``transferqueue.client.TQClient``;
each roller process builds its own (``TQGroupChannel.from_handle``). With a validation ``GroupSource``
(``controller.validation``), validation groups are taken first, without waiting, from their own partition
and put back there.
"""

from __future__ import annotations

from dataclasses import dataclass

from common import schema
from common.ground_truth import decode_ground_truth
from rollers.roller import GroupResult, PromptGroup, response_digest


@dataclass(frozen=True)
class GroupSource:
    """A second source of groups for ``TQGroupChannel``: validation groups of ``group_size`` rows in
    ``partition``, the last ``num_greedy`` decoded greedily. Taken before training groups."""

    partition: str
    group_size: int
    num_greedy: int = 0


class TQGroupChannel:
    """A ``GroupChannel`` over the TransferQueue (``transferqueue.client.TQClient``).

    ``take_group``: ``aget_meta([input_ids, attention_mask, ground_truth], n, task, partition,
    sampler="group_complete", options={"group_size": n})`` long-polls for one whole ``uid`` group the
    ``task`` (default ``rollout``) has not consumed, then ``aget_data``; the prompt is row 0's
    ``input_ids`` where ``attention_mask`` is 1 (the feeder puts them with ``controller.data.prompt_fields``).
    ``put_group``: ``aput`` of the response fields into the same sample ids, with tags
    ``min_weight_version``, ``max_weight_version``, ``finish_reason``, ``response_length``, ``reward``
    (the sequence reward), ``greedy`` (0/1) and ``response_digest`` per sample; with ``put_text``, also the
    field ``response_text`` (the decoded responses, for generation dumps).
    ``validation``: a ``GroupSource`` polled (without waiting) before each take of a training group; its
    groups are marked ``validation`` and put back into their own partition.
    """

    PROMPT_FIELDS = (schema.INPUT_IDS, schema.ATTENTION_MASK, schema.GROUND_TRUTH)
    TAG_FIELDS = (schema.MIN_WEIGHT_VERSION, schema.MAX_WEIGHT_VERSION, schema.FINISH_REASON, schema.RESPONSE_LENGTH)

    def __init__(self, client, partition: str, n: int, task: str = "rollout", put_timeout_s: float = 60.0,
                 validation: GroupSource | None = None, put_text: bool = False):
        if n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {n}")
        self.client, self.partition, self.n, self.task = client, partition, n, task
        self.put_timeout_s = put_timeout_s
        self.validation, self.put_text = validation, put_text

    @classmethod
    def from_handle(cls, handle: dict, partition: str, n: int, validation: GroupSource | None = None,
                    put_text: bool = False) -> TQGroupChannel:
        """A channel with its own ``TQClient`` of the TransferQueue ``handle`` (``TQHandle.to_dict()``), for
        ``partition`` and groups of ``n``: what each roller process builds (bind the arguments with
        ``functools.partial`` to get a ``channel_factory``; Ray ships it by reference)."""
        from transferqueue.client import TQClient
        from transferqueue.records import TQHandle

        return cls(TQClient(TQHandle.from_dict(handle)), partition, n, validation=validation, put_text=put_text)

    async def take_group(self, timeout_s: float) -> PromptGroup | None:
        v = self.validation
        if v is not None:  # validation first, without waiting: a round is small and its rows name a version
            group = await self._take(v.partition, v.group_size, 0.0, v.num_greedy, validation=True)
            if group is not None:
                return group
        return await self._take(self.partition, self.n, timeout_s)

    async def _take(self, partition: str, size: int, timeout_s: float, num_greedy: int = 0,
                    validation: bool = False) -> PromptGroup | None:
        meta = await self.client.aget_meta(list(self.PROMPT_FIELDS), size, self.task, partition,
                                           sampler="group_complete", options={"group_size": size},
                                           timeout_s=timeout_s)
        if len(meta) == 0:
            return None
        batch = await self.client.aget_data(meta)
        ids, mask = batch[schema.INPUT_IDS][0], batch[schema.ATTENTION_MASK][0]
        uids = {tag.get(schema.UID) for tag in meta.tags}
        if len(uids) != 1 or None in uids:
            raise ValueError(f"samples {meta.sample_ids} do not share one uid tag: {uids}")
        return PromptGroup(uids.pop(), tuple(meta.sample_ids), tuple(ids[mask.bool()].tolist()),
                           decode_ground_truth(batch[schema.GROUND_TRUTH][0]), num_greedy, validation, partition,
                           str(meta.tags[0].get(schema.SEED_KEY, "")))

    async def put_group(self, result: GroupResult) -> None:
        fields = result.fields
        tags = [
            {name: (fields[name][i] if name == schema.FINISH_REASON else int(fields[name][i]))
             for name in self.TAG_FIELDS}
            | {schema.REWARD: float(result.rewards[i]), schema.RESPONSE_DIGEST: response_digest(fields, i),
               schema.GREEDY: int(bool(result.greedy and result.greedy[i]))}
            for i in range(len(result.sample_ids))
        ]
        data = {k: v for k, v in fields.items() if k != schema.FINISH_REASON}
        if self.put_text:
            data[schema.RESPONSE_TEXT] = list(result.texts)
        await self.client.aput(data, result.partition or self.partition, sample_ids=list(result.sample_ids), tags=tags,
                               timeout_s=self.put_timeout_s)
