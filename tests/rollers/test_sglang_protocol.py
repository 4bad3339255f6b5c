"""SGLang wire records: request parsing/validation, answers, versions, stream events (no server)."""

from __future__ import annotations

import pytest
import torch

from rollers import sglang_protocol as proto
from rollers.engine import GenerationOutput, GenerationRequest, SamplingParams

VOCAB = 100


def _body(**overrides):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    body.update(overrides)
    return body


def test_sampling_round_trip():
    for sp in (SamplingParams(max_new_tokens=7), SamplingParams(max_new_tokens=3, temperature=0.0, top_p=0.5,
                                                                top_k=5, seed=11, stop_token_ids=(2, 9),
                                                                ignore_eos=True)):
        assert proto.sampling_from_sglang(proto.sampling_to_sglang(sp)) == sp


def test_generate_body_parses_back():
    req = GenerationRequest("r1", (4, 5, 6), SamplingParams(max_new_tokens=5, seed=3))
    parsed = proto.parse_generate_body(proto.generate_body(req, stream=True), VOCAB, default_rid="x")
    assert parsed.request == req and parsed.stream and parsed.return_logprob
    assert proto.parse_generate_body(_body(), VOCAB, default_rid="x").request.request_id == "x"


@pytest.mark.parametrize("body, needle", [
    (_body(input_idz=[1]), "unknown or unsupported field"),
    (_body(text="hello"), "unknown or unsupported field"),
    (_body(sampling_params={"max_new_tokens": -1}), "max_new_tokens must be >= 1"),
    (_body(sampling_params={"max_new_token": 3}), "unknown or unsupported field"),
    (_body(sampling_params={"max_new_tokens": True}), "must be an integer"),
    (_body(sampling_params={"max_new_tokens": 4, "n": 2}), "n must be 1"),
    (_body(sampling_params={"max_new_tokens": 4, "top_p": 0}), "top_p"),
    (_body(sampling_params={"max_new_tokens": 4, "temperature": "hot"}), "temperature must be"),
    (_body(input_ids=[]), "input_ids is empty"),
    (_body(input_ids=[[1, 2]]), "batch requests"),
    (_body(input_ids=[1, VOCAB]), "outside the vocabulary"),
    (_body(input_ids="1 2"), "input_ids must be a list"),
    (_body(stream="yes"), "stream must be a boolean"),
    (_body(top_logprobs_num=5), "top_logprobs_num"),
    (_body(sampling_params={"temperature": float("nan")}), "temperature must be a finite number"),
    (_body(sampling_params={"temperature": float("inf")}), "temperature must be a finite number"),
    (_body(sampling_params={"top_p": float("nan")}), "top_p"),
    (_body(sampling_params={"sampling_seed": 2**64}), "seed must be"),
    (_body(sampling_params={"stop_token_ids": [-3]}), "stop_token_ids"),
    ([1, 2], "request body must be an object"),
])
def test_bad_generate_bodies_name_the_field(body, needle):
    with pytest.raises(proto.ProtocolError, match=needle):
        proto.parse_generate_body(body, VOCAB, default_rid="x")


def test_flags_and_group_names_are_typed():
    """A string "false" must not read as true, and a list group name must be a 400, not a server error."""
    assert proto.body_flag({}, "flush_cache", True) and not proto.body_flag({"flush_cache": None}, "flush_cache", False)
    with pytest.raises(proto.ProtocolError, match="flush_cache must be a boolean"):
        proto.body_flag({"flush_cache": "false"}, "flush_cache", True)
    assert proto.body_group_name({}) == proto.DEFAULT_GROUP_NAME
    for bad in ([1], "", {"a": 1}, 3):
        with pytest.raises(proto.ProtocolError, match="group_name must be a non-empty string"):
            proto.body_group_name({"group_name": bad})


def test_null_sampling_values_mean_defaults():
    parsed = proto.parse_generate_body(_body(sampling_params={"max_new_tokens": 2, "temperature": None}), VOCAB, "x")
    assert parsed.request.sampling.temperature == 1.0


def test_answer_round_trip_with_version_spans():
    out = GenerationOutput("r", output_ids=[5, 6, 7, 8], output_log_probs=[-0.1, -0.2, -0.3, -0.4],
                           weight_versions=[3, 3, 4, 4], finish_reason="length", prompt_tokens=2)
    answer = proto.output_to_sglang(out, current_version=4, return_logprob=True)
    meta = answer["meta_info"]
    assert meta["weight_version"] == "4" and meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["weight_versions"] == [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4}]
    assert meta["output_token_logprobs"][1] == [-0.2, 6, None]
    assert proto.parse_generate_output(answer, "r", None) == out


def test_cumulative_and_incremental_events_give_the_same_output():
    full = GenerationOutput("r", [5, 6, 7], [-1.0, -2.0, -3.0], [0, 0, 1], "stop", 2)
    first = GenerationOutput("r", [5], [-1.0], [0], None, 2)
    e1, e2 = (proto.output_to_sglang(o, 0, True) for o in (first, full))
    cumulative = proto.parse_generate_output(e2, "r", proto.parse_generate_output(e1, "r", None))
    delta = dict(e2, output_ids=e2["output_ids"][1:])
    delta["meta_info"] = dict(e2["meta_info"], output_token_logprobs=e2["meta_info"]["output_token_logprobs"][1:])
    incremental = proto.parse_generate_output(delta, "r", proto.parse_generate_output(e1, "r", None))
    assert cumulative == incremental == full
    assert full.min_weight_version == 0 and full.max_weight_version == 1


def test_versions_without_spans_come_from_each_event():
    """Older SGLang sends only ``meta_info.weight_version``: tokens new in an event carry that version."""
    e1 = proto.output_to_sglang(GenerationOutput("r", [5], [-1.0], [0], None, 1), 0, True)
    e2 = proto.output_to_sglang(GenerationOutput("r", [5, 6], [-1.0, -2.0], [0, 0], "length", 1), 2, True)
    for event, version in ((e1, "0"), (e2, "2")):
        del event["meta_info"]["weight_versions"]
        event["meta_info"]["weight_version"] = version
    out = proto.parse_generate_output(e2, "r", proto.parse_generate_output(e1, "r", None))
    assert out.weight_versions == [0, 2]


def test_malformed_answers_raise():
    good = proto.output_to_sglang(GenerationOutput("r", [5], [-1.0], [0], "stop", 1), 0, True)
    with pytest.raises(proto.ProtocolError, match="completion_tokens"):
        proto.parse_generate_output(dict(good, output_ids=[5, 6, 7]), "r", None)
    with pytest.raises(proto.ProtocolError, match="lacks or mistypes"):
        proto.parse_generate_output({"output_ids": [5]}, "r", None)
    bad_reason = dict(good, meta_info=dict(good["meta_info"], finish_reason={"type": "exploded"}))
    with pytest.raises(proto.ProtocolError, match="finish_reason.type"):
        proto.parse_generate_output(bad_reason, "r", None)
    with pytest.raises(proto.ProtocolError, match="answered an error"):
        proto.parse_generate_output({"error": {"message": "boom"}}, "r", None)


def test_weight_version_strings():
    assert proto.parse_weight_version("12") == 12 and proto.parse_weight_version(3) == 3
    assert proto.parse_weight_version("default") == 0  # SGLang's launch default
    with pytest.raises(proto.ProtocolError, match="integer string"):
        proto.parse_weight_version("v1")


def test_tensor_specs_and_dtypes():
    specs = proto.parse_tensor_specs(["a", "b"], ["bfloat16", "torch.float32"], [[2, 3], []])
    assert specs[0] == proto.TensorSpec("a", torch.bfloat16, (2, 3)) and specs[1].shape == ()
    assert proto.dtype_to_sglang(torch.bfloat16) == "bfloat16"
    with pytest.raises(proto.ProtocolError, match="one length"):
        proto.parse_tensor_specs(["a"], ["float32", "float32"], [[1]])
    with pytest.raises(proto.ProtocolError, match="not a torch dtype"):
        proto.parse_tensor_specs(["a"], ["float33"], [[1]])
    with pytest.raises(proto.ProtocolError, match="negative"):
        proto.parse_tensor_specs(["a"], ["float32"], [[-1]])
    with pytest.raises(proto.ProtocolError, match="unaligned"):
        proto._bucket_layout([proto.TensorSpec("a", torch.uint8, (3,)), proto.TensorSpec("b", torch.float32, (1,))])


def test_input_longer_than_the_context_is_refused_before_its_ids_are_read():
    assert len(proto.parse_generate_body(_body(input_ids=[1] * 9), VOCAB, "x", max_input_len=10).request.input_ids) == 9
    huge = _body(input_ids=[1] * 2_000_000 + [VOCAB])  # the out-of-vocabulary id at the end is never reached
    with pytest.raises(proto.ProtocolError, match="2000001 tokens leave no room for a response within the context "
                                                  "length of 10"):
        proto.parse_generate_body(huge, VOCAB, "x", max_input_len=10)
