"""TorchEngine prefix reuse: a request that continues a finished one prefills only its new tokens.

What is checked is well-conditioned whatever tokens get sampled: every sampled token's log-prob equals a
teacher-forced forward over the whole context (a slot holding another sequence's keys/values, or a prefix
at the wrong positions, breaks that by far more than the tolerance), and greedy turns equal HF ``generate``.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from common.models import ModelConfig, apply_chat_template, load_tokenizer
from rollers.engine import GenerationRequest, SamplingParams
from rollers.torch_engine import TorchEngine
from tests.rollers.engine_helpers import run, spiced_tiny
from tests.rollers.test_torch_engine import hf_greedy, teacher_forced_log_probs

OBSERVATION = (5, 6, 7)  # stands in for an environment's tokens between two turns


@pytest.fixture(scope="module")
def tiny():
    tok = load_tokenizer(ModelConfig(path="tiny"))
    prompts = [apply_chat_template(tok, f"say {w} {d}") for w, d in zip("abcdefgh", "01234567", strict=True)]
    return spiced_tiny(), tok, prompts


def sampled(rid: str, ids, seed: int, max_new_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, tuple(ids), SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0,
                                                             seed=seed, ignore_eos=True))


async def conversation(engine: TorchEngine, name: str, prompt, turns: int, rng: random.Random) -> list[tuple]:
    """``turns`` turns of 2-6 sampled tokens each, every next request = the context so far + the sampled
    tokens + ``OBSERVATION``, with random waits between turns (tool latency); returns (context, output) per
    turn."""
    context, record = tuple(prompt), []
    for turn in range(turns):
        out = await engine.generate(sampled(f"{name}/t{turn}", context, seed=rng.randrange(2**31),
                                            max_new_tokens=rng.randint(2, 6)))
        record.append((context, out))
        context = (*context, *out.output_ids, *OBSERVATION)
        await asyncio.sleep(rng.random() * 0.01)
    return record


def check_log_probs(model, record) -> None:
    for context, out in record:
        expected = teacher_forced_log_probs(model, context, out.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.output_log_probs), expected, atol=1e-4, rtol=0)


def test_a_continuation_prefills_only_its_new_tokens(tiny):
    model, tok, prompts = tiny

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=2)
        try:
            record = await conversation(engine, "c", prompts[0], turns=3, rng=random.Random(0))
            return record, engine.stats()
        finally:
            await engine.shutdown()

    record, stats = run(body())
    check_log_probs(model, record)
    # Each later turn reuses everything the slot held: the previous context + all but the last sampled token.
    held = [len(ctx) + len(out.output_ids) - 1 for ctx, out in record[:-1]]
    assert stats["num_reused_tokens"] == sum(held)
    new = [len(record[0][0])] + [len(ctx) - h for (ctx, _), h in zip(record[1:], held, strict=True)]
    assert stats["num_prefill_tokens"] == sum(new) == len(record[0][0]) + 2 * (1 + len(OBSERVATION))
    assert stats["num_cached_prefixes"] == 1


def test_greedy_turns_equal_hf_generate(tiny):
    model, tok, prompts = tiny

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=3)
        try:
            outs, context = [], tuple(prompts[1])
            for turn in range(3):
                out = await engine.generate(GenerationRequest(f"g{turn}", context,
                                                              SamplingParams(max_new_tokens=6, temperature=0)))
                outs.append((context, out.output_ids))
                context = (*context, *out.output_ids, *OBSERVATION)
            return outs, engine.stats()["num_reused_tokens"]
        finally:
            await engine.shutdown()

    outs, reused = run(body())
    assert reused > 0
    for context, output in outs:
        assert output == hf_greedy(model, context, 6)[: len(output)]


class Conversation:
    """One conversation's context so far; ``held`` = what its slot keeps after a turn (the context and all
    sampled tokens but the last, whose keys/values were never computed)."""

    def __init__(self, name: str, prompt) -> None:
        self.name, self.context, self.record, self.held = name, tuple(prompt), [], 0

    async def turn(self, engine: TorchEngine, max_new_tokens: int) -> None:
        out = await engine.generate(sampled(f"{self.name}/t{len(self.record)}", self.context,
                                            seed=len(self.record), max_new_tokens=max_new_tokens))
        self.record.append((self.context, out))
        self.held = len(self.context) + len(out.output_ids) - 1
        self.context = (*self.context, *out.output_ids, *OBSERVATION)


def test_prefixes_are_swapped_relocated_and_evicted_as_placed(tiny):
    """Four slots, turns in a fixed order (``ignore_eos`` fixes every length, so where each prefix sits
    follows from the placement rules alone, not from timing): a prefix moved into a newcomer's slot, out of
    its way to an empty slot or to an older prefix's slot, must still be reused in full and give
    teacher-forced log-probs; an evicted one must not be reused."""
    model, tok, prompts = tiny
    a, b, c, d, e, f = (Conversation(name, prompts[i]) for i, name in enumerate("abcdef"))

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=4)

        async def turns(*plan) -> int:  # (conversation, max_new_tokens) at once; returns the tokens reused
            before = engine.stats()["num_reused_tokens"]
            await asyncio.gather(*[conv.turn(engine, n) for conv, n in plan])
            return engine.stats()["num_reused_tokens"] - before

        try:
            reused = {}
            # a finishes first: the release swaps b into slot 0 and leaves a's prefix in slot 1 -> [b a - -]
            reused["a0 b0"] = await turns((a, 3), (b, 5))
            reused["c0"] = await turns((c, 2))  # b's prefix moves out of slot 0 to empty slot 2 -> [c a b -]
            held = {"a": a.held, "b": b.held}
            reused["a1"] = await turns((a, 2))  # a's prefix is swapped into slot 0 -> [a c b -]
            reused["b1"] = await turns((b, 2))  # and b's, from where it was moved -> [b c a -]
            # three newcomers: b's prefix moves to empty slot 3; c's and a's have nowhere older to go: evicted
            reused["d0 e0 f0"] = await turns((d, 2), (e, 2), (f, 2))
            reused["a2"] = await turns((a, 2))  # evicted; the d/e/f prefix in slot 0 evicts b's (the oldest)
            held |= {"d": d.held, "e": e.held, "f": f.held}
            for conv in (d, e, f):
                reused[f"{conv.name}1"] = await turns((conv, 2))
            held["a'"] = a.held
            reused["a3"] = await turns((a, 2))
            reused["b2"] = await turns((b, 2))
            return reused, held, engine.stats()
        finally:
            await engine.shutdown()

    reused, held, stats = run(body())
    assert reused == {"a0 b0": 0, "c0": 0, "a1": held["a"], "b1": held["b"], "d0 e0 f0": 0, "a2": 0,
                      "d1": held["d"], "e1": held["e"], "f1": held["f"], "a3": held["a'"], "b2": 0}
    assert stats["num_cached_prefixes"] == 4
    for conv in (a, b, c, d, e, f):
        check_log_probs(model, conv.record)


def test_random_interleavings_keep_every_slot_right(tiny):
    """Eight conversations at once on four slots with random tool waits: whatever swaps, relocations and
    evictions the timing produces, every turn's log-probs must be the teacher-forced ones."""
    model, tok, prompts = tiny

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=4)
        try:
            rng = random.Random(7)
            return await asyncio.gather(*[conversation(engine, f"c{i}", prompts[i], turns=4,
                                                       rng=random.Random(rng.random())) for i in range(8)])
        finally:
            await engine.shutdown()

    for record in run(body()):
        check_log_probs(model, record)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_weight_update_drops_cached_prefixes_unless_paused_in_place(tiny, mode):
    """A finished turn's keys/values are the old weights': an update under a retract (or abort) pause drops
    them, so the next turn prefills its whole context under the new weights; an in_place pause keeps every
    key/value as it is, these too, so the next turn reuses them (an agent loop's tool-waiting trajectories are
    not re-prefilled after each fully-async sync)."""
    _, tok, prompts = tiny
    model, new = spiced_tiny(), spiced_tiny(seed=1)  # not the module's model: load_weights changes it

    async def body():
        engine = TorchEngine(model, tok, max_batch_slots=2)
        try:
            first = await engine.generate(sampled("a", prompts[2], seed=1, max_new_tokens=4))
            before = engine.stats()
            await engine.pause(mode)
            await engine.load_weights(new.state_dict().items(), weight_version=1)
            await engine.resume()
            context = (*prompts[2], *first.output_ids, *OBSERVATION)
            second = await engine.generate(sampled("b", context, seed=2, max_new_tokens=4))
            return context, second, before, engine.stats()
        finally:
            await engine.shutdown()

    context, second, before, after = run(body())
    assert before["num_cached_prefixes"] == 1 and second.weight_versions == [1] * 4
    reused = after["num_reused_tokens"] - before["num_reused_tokens"]
    if mode == "in_place":
        assert reused == len(context) - len(OBSERVATION) - 1  # the prompt and all but the last sampled token
    else:
        assert reused == 0
        check_log_probs(new, [(context, second)])
