"""The records a roller takes and puts: a ``PromptGroup`` in, a ``GroupResult`` or a ``FailedGroup`` out,
through a ``GroupChannel`` (``rollers.roller`` runs them; ``rollers.agent_loop`` runs one sample of a group
as a trajectory; ``rollers.tq_channel`` is the TransferQueue channel)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class PromptGroup:
    """One prompt group as the roller receives it: one prompt, to be answered by ``num_samples`` samples
    sharing ``uid``.

    ``prompt_id``: the data plane's id of the group's prompt row (stored once per group; the channel
    clears it once the samples are put); ``num_samples``: samples to generate (``rollout.n``, or
    ``val.n`` + greedy); ``input_ids``: the prompt token ids (unpadded); ``ground_truth``: the task's
    answer; ``num_greedy``: its last ``num_greedy`` samples are greedy (temperature 0), put like the
    others; ``validation``: a validation group (no ReMax baseline, no forced lengths); ``partition``: where
    its responses go (empty: the channel's own); ``seed_key``: what its sampling seeds derive from (empty:
    the uid); ``prompt_fields``: the prompt row's stored fields as read (``input_ids``, ``attention_mask``,
    each ``(1, prompt_len)``), which the channel puts beside every sample (the trainer reads them per
    sample).
    """

    uid: str
    prompt_id: int
    num_samples: int
    input_ids: tuple[int, ...]
    ground_truth: dict
    num_greedy: int = 0
    validation: bool = False
    partition: str = ""
    seed_key: str = ""
    prompt_fields: Mapping[str, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))


@dataclass
class GroupResult:
    """What is put for ``group``: ``fields`` (``build_response_fields`` output, one row per sample);
    ``rewards``: per sample; ``greedy``: per sample, whether it was decoded greedily; ``texts``: the
    decoded responses."""

    group: PromptGroup
    fields: dict[str, Any]
    rewards: list[float]
    greedy: tuple[bool, ...] = ()
    texts: tuple[str, ...] = ()

    @property
    def uid(self) -> str:
        return self.group.uid


@dataclass(frozen=True)
class FailedGroup:
    """A group that was not put: ``prompt_id`` its prompt row (still in the data plane); ``stage`` is
    ``reward``, ``generate`` or ``environment`` (multi-turn); ``errors`` one line per problem;
    ``partition``: the group's (empty: the channel's own, i.e. training)."""

    uid: str
    prompt_id: int
    stage: str
    errors: tuple[str, ...]
    partition: str = ""

    def __str__(self) -> str:
        return f"group {self.uid} failed in {self.stage}: {'; '.join(self.errors)}"


class GroupChannel(Protocol):
    async def take_group(self, timeout_s: float) -> PromptGroup | None:
        """One whole prompt group not yet taken by the ``rollout`` task, or None after ``timeout_s``."""

    async def put_group(self, result: GroupResult) -> None:
        """Put the samples of ``result`` (one row each, beside its group's prompt fields)."""
