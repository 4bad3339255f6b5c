"""The sample contract (``common/schema.py``): every stage reads only what an earlier stage put, nothing on
the wire goes unread, and what the rollers' channel really puts matches the declared dtypes and shapes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common import schema
from rollers.engine import GenerationOutput
from rollers.response_fields import build_response_fields
from rollers.roller import GroupResult, PromptGroup
from rollers.tq_channel import ANSWERED_TASK, TQGroupChannel
from transferqueue.records import Consume


def test_every_stage_reads_only_fields_an_earlier_stage_puts():
    for i, stage in enumerate(schema.STAGES):
        earlier = [s for s in schema.STAGES[:i] if s.wire or not stage.wire]  # the wire sees no trainer memory
        put = {name for s in earlier for name in (*s.puts, *s.optional_puts)}
        unput = [name for name in (*stage.reads, *stage.optional_reads) if name not in put]
        assert not unput, f"{stage.name} reads {unput}, which no earlier stage puts"


def test_nothing_on_the_wire_goes_unread():
    for stage in (s for s in schema.STAGES if s.wire):
        for name in (*stage.puts, *stage.optional_puts):
            readers = [s.name for s in schema.STAGES if s is not stage and name in (*s.reads, *s.optional_reads)]
            assert readers, f"{stage.name} puts {name!r}, which no other stage reads"
    # The weight versions and lengths travel as tags only, never as stored fields.
    for name in (schema.MIN_WEIGHT_VERSION, schema.MAX_WEIGHT_VERSION, schema.RESPONSE_LENGTH, schema.FINISH_REASON):
        assert schema.FIELDS[name].tag and name not in schema.ROLLER.put_fields()


def test_declared_names_are_the_constants_and_trainer_stages_stay_off_the_wire():
    assert all(spec.name == name for name, spec in schema.FIELDS.items())
    assert {schema.FIELDS[n].pad_side for n in schema.TRAINER.read_fields()} == {"left", "right"}
    computed = {n for s in schema.STAGES if not s.wire for n in s.puts}
    on_wire = {n for s in schema.STAGES if s.wire for n in (*s.puts, *s.optional_puts)}
    assert computed and not computed & on_wire


class _CaptureClient:
    """A TransferQueue client that records the channel's puts and clears."""

    def __init__(self):
        self.puts, self.clears, self.consumes = [], [], []

    async def aput(self, data, partition, sample_ids=None, tags=None, timeout_s=None, consume=None):
        self.puts.append((data, partition, sample_ids, tags))
        self.consumes.append(consume)

    async def aclear(self, partition, sample_ids):
        self.clears.append((partition, list(sample_ids)))


def _result(n: int = 3, remax: bool = False) -> GroupResult:
    ids = torch.tensor([[0, 0, 5, 6, 7]])
    group = PromptGroup("s0.p1", 41, n, (5, 6, 7), {"answer": "a"},
                        prompt_fields={schema.INPUT_IDS: ids, schema.ATTENTION_MASK: (ids != 0).long()})
    outputs = [GenerationOutput(f"r{i}", list(range(1, 2 + i)), [-0.5] * (1 + i), [2] * (1 + i), "stop")
               for i in range(n)]
    fields = build_response_fields(outputs, [1.0, 0.0, 0.5][:n], pad_token_id=0)
    if remax:
        fields[schema.REMAX_BASELINE] = torch.full((n,), 0.5)
    return GroupResult(group, fields, [1.0, 0.0, 0.5][:n], (False, False, True)[:n], tuple(f"t{i}" for i in range(n)))


@pytest.mark.parametrize("put_text, remax", [(False, False), (True, True)])
def test_the_channel_puts_exactly_the_roller_contract(put_text, remax):
    client = _CaptureClient()
    channel = TQGroupChannel(client, "prompts", "samples", n=3, put_text=put_text)
    asyncio.run(channel.put_group(_result(remax=remax)))
    ((data, partition, sample_ids, tags),) = client.puts
    assert partition == "samples" and sample_ids is None  # new sample rows, one per sample
    assert client.consumes == [Consume("prompts", [41], ANSWERED_TASK)]  # the put marks its prompt row answered
    assert client.clears == [("prompts", [41])]  # then the prompt row goes
    expected = set(schema.ROLLER.put_fields()) | ({schema.RESPONSE_TEXT} if put_text else set()) \
        | ({schema.REMAX_BASELINE} if remax else set())
    assert set(data) == expected
    schema.check_batch(schema.ROLLER, data, tags)
    for name, value in data.items():
        spec = schema.FIELDS[name]
        if spec.dtype == "str":
            assert len(value) == 3
        else:
            assert str(value.dtype) == f"torch.{spec.dtype}" and value.dim() == len(spec.shape) and len(value) == 3
    assert torch.equal(data[schema.INPUT_IDS], torch.tensor([[0, 0, 5, 6, 7]] * 3))  # the prompt row, per sample
    assert [set(t) for t in tags] == [set(schema.ROLLER.put_tags())] * 3
    assert [t[schema.UID] for t in tags] == ["s0.p1"] * 3 and [t[schema.GREEDY] for t in tags] == [0, 0, 1]
    assert [t[schema.RESPONSE_LENGTH] for t in tags] == [1, 2, 3] and tags[0][schema.MIN_WEIGHT_VERSION] == 2


def test_check_batch_names_what_breaks_the_contract():
    data = {schema.INPUT_IDS: torch.zeros(2, 4, dtype=torch.int64), schema.ATTENTION_MASK: torch.ones(2, 4).long(),
            schema.GROUND_TRUTH: ["{}", "{}"]}
    tags = [{schema.UID: "a"}, {schema.UID: "b"}]
    schema.check_batch(schema.FEEDER, data, tags)
    with pytest.raises(ValueError, match=r"undeclared \['min_weight_version'\]"):
        schema.check_batch(schema.FEEDER, {**data, schema.MIN_WEIGHT_VERSION: torch.zeros(2).long()})
    with pytest.raises(ValueError, match=r"missing \['ground_truth'\]"):
        schema.check_batch(schema.FEEDER, {k: v for k, v in data.items() if k != schema.GROUND_TRUTH})
    with pytest.raises(ValueError, match="'attention_mask' must be int64"):
        schema.check_batch(schema.FEEDER, {**data, schema.ATTENTION_MASK: torch.ones(2, 4)})
    with pytest.raises(ValueError, match="'ground_truth' has batch=3"):
        schema.check_batch(schema.FEEDER, {**data, schema.GROUND_TRUTH: ["{}"] * 3})
    with pytest.raises(ValueError, match="'attention_mask' has prompt_len=5"):
        schema.check_batch(schema.FEEDER, {**data, schema.ATTENTION_MASK: torch.ones(2, 5).long()})
    with pytest.raises(ValueError, match="undeclared tag 'reward'"):
        schema.check_batch(schema.FEEDER, data, [{schema.UID: "a", schema.REWARD: 1.0}])
    with pytest.raises(ValueError, match="tag 'uid' must be str"):
        schema.check_batch(schema.FEEDER, data, [{schema.UID: 3}])
