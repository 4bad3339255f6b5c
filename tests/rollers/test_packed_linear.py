"""PackedLinear: prepacked-weight linears for CPU decoding equal nn.Linear, follow weight loads, and leave
training to the plain kernel; the torch engine's log-probs after a weight load come from the new weights."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from torch import nn

from common.models import ModelConfig, apply_chat_template, load_tokenizer
from rollers.engine import GenerationRequest, SamplingParams
from rollers.packed_linear import PACKED_ROWS, PackedLinear, pack_linears, packing_available
from rollers.torch_engine import TorchEngine
from tests.rollers.engine_helpers import run, spiced_tiny

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


def _linear(seed: int = 0, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(64, 96, bias=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (4, 64), (8, 64), (8, 1, 64), (2, 16, 64), (32, 64), (33, 64),
                                   (64, 64), (256, 64), (2, 150, 64)])
def test_equals_nn_linear_and_packs_only_for_its_row_range(shape, dtype):
    linear = _linear().to(dtype)
    packed = PackedLinear(linear)
    x = torch.randn(shape).to(dtype)
    with torch.no_grad():
        got, expected = packed(x), linear(x)
    assert got.dtype == dtype
    # bf16 outputs: another summation order may round the last of 8 mantissa bits the other way
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(got, expected, **tolerance)
    rows = x.numel() // 64
    assert (packed._packed is not None) == (rows in PACKED_ROWS.get(dtype, ())), rows


def test_shares_the_parameters_and_repacks_after_an_in_place_load_or_a_new_parameter():
    linear = _linear(bias=False)
    packed = PackedLinear(linear)
    assert packed.weight is linear.weight and packed.bias is None
    x = torch.randn(8, 64)
    with torch.no_grad():
        before = packed(x)
        linear.weight.copy_(torch.randn(96, 64))  # what a weight load does
        after = packed(x)
    torch.testing.assert_close(after, x @ linear.weight.detach().T, rtol=1e-5, atol=1e-5)
    assert (after - before).abs().max() > 1.0  # really another weight
    packed.weight = nn.Parameter(torch.randn(96, 64))
    with torch.no_grad():
        torch.testing.assert_close(packed(x), x @ packed.weight.detach().T, rtol=1e-5, atol=1e-5)
    packed.weight.data = torch.randn(96, 64)  # new storage, same parameter, version unchanged
    with torch.no_grad():
        torch.testing.assert_close(packed(x), x @ packed.weight.detach().T, rtol=1e-5, atol=1e-5)


def test_training_takes_the_plain_kernel_and_its_gradients():
    linear = _linear()
    packed = PackedLinear(copy.deepcopy(linear))
    x = torch.randn(8, 64)
    packed(x).square().sum().backward()
    linear(x).square().sum().backward()
    assert packed._packed is None
    assert torch.equal(packed.weight.grad, linear.weight.grad)
    assert torch.equal(packed.bias.grad, linear.bias.grad)


def test_pack_linears_keeps_names_ties_and_logits():
    model = spiced_tiny()
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == linears > 0
    assert pack_linears(model) == 0  # already packed: nothing to replace
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert list(model.state_dict()) == keys
    embeddings, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert (embeddings is head) == (
        reference.get_input_embeddings().weight is reference.get_output_embeddings().weight
    )
    ids = torch.randint(0, model.config.vocab_size, (8, 1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_engine_log_probs_after_a_weight_load_come_from_the_new_weights():
    """Eight slots decode eight rows at a time (the packed kernel); after ``load_weights`` the log-probs
    equal a teacher-forced forward of an unpacked model holding the new weights."""
    tok = load_tokenizer(ModelConfig(path="tiny"))
    prompts = [apply_chat_template(tok, f"say {i} {i + 1}") for i in range(8)]
    new = spiced_tiny(seed=1)
    new_weights = [(name, tensor.clone()) for name, tensor in new.state_dict().items()]

    async def body():
        engine = TorchEngine(spiced_tiny(seed=0), tok, max_batch_slots=8)

        async def generate_all(tag: str):
            return await asyncio.gather(*[
                engine.generate(GenerationRequest(f"{tag}{i}", tuple(p), SamplingParams(
                    max_new_tokens=12, temperature=1.0, seed=i, ignore_eos=True)))
                for i, p in enumerate(prompts)
            ])

        try:
            await generate_all("old")  # packs the old weights
            await engine.pause()
            await engine.load_weights(new_weights, weight_version=1)
            await engine.resume()
            return await generate_all("new")
        finally:
            await engine.shutdown()

    for prompt, out in zip(prompts, run(body()), strict=True):
        ids = torch.tensor([[*prompt, *out.output_ids]])
        with torch.no_grad():
            logits = new(ids).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.output_log_probs), expected, atol=1e-4, rtol=0)
        assert out.weight_versions == [1] * 12
