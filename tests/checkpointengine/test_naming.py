"""Trainer → engine names: wrapper prefixes, tied embeddings in either order, coverage, config checks."""

from __future__ import annotations

import pytest
import torch

from checkpointengine.config import CheckpointEngineConfig
from checkpointengine.naming import EMBED_NAME, LM_HEAD_NAME, MissingWeightsError, WeightNameMapper
from common.models import ModelConfig, TinyModelConfig, load_model


def _route(mapper, names):
    return [engine for engine, _ in mapper.route((n, i) for i, n in enumerate(names))]


def test_wrapper_prefixes_and_renames():
    mapper = WeightNameMapper(renames={"model.norm.weight": "model.final_norm.weight"})
    assert mapper.engine_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert mapper.engine_name("module.model.norm.weight") == "model.final_norm.weight"
    assert mapper.engine_name("model.submodule.x") == "model.submodule.x"


@pytest.mark.parametrize("order", [[EMBED_NAME, "x", LM_HEAD_NAME], [LM_HEAD_NAME, "x", EMBED_NAME]])
def test_tied_head_travels_once_in_either_order(order):
    mapper = WeightNameMapper(tie_word_embeddings=True)
    assert sorted(_route(mapper, order)) == sorted([EMBED_NAME, "x"])


def test_tied_head_alone_becomes_the_embedding():
    mapper = WeightNameMapper(tie_word_embeddings=True)
    items = list(mapper.route([(LM_HEAD_NAME, "head"), ("x", "x")]))
    assert items == [("x", "x"), (EMBED_NAME, "head")]


def test_untied_keeps_both_and_rejects_collisions():
    mapper = WeightNameMapper()
    assert _route(mapper, [EMBED_NAME, LM_HEAD_NAME]) == [EMBED_NAME, LM_HEAD_NAME]
    with pytest.raises(ValueError, match="both map to engine tensor"):
        _route(mapper, ["module.a", "a"])


def test_coverage_from_a_model():
    tiny = TinyModelConfig(vocab_size=32, tie_word_embeddings=False)
    untied = load_model(ModelConfig(path="tiny", tiny=tiny))
    mapper = WeightNameMapper.for_model(untied)
    names = list(untied.state_dict())
    mapper.check_coverage(names)
    with pytest.raises(MissingWeightsError, match="lm_head.weight.*untied"):
        mapper.check_coverage([n for n in names if n != LM_HEAD_NAME])
    tied = load_model(ModelConfig(path="tiny", tiny=TinyModelConfig(vocab_size=32)))
    WeightNameMapper.for_model(tied).check_coverage([n for n in tied.state_dict() if n != LM_HEAD_NAME])
    assert WeightNameMapper().check_coverage([]) is None  # no expectations, nothing to flag


def test_config_rejects_bad_values_naming_the_key():
    for kwargs, key in [({"backend": "nfs"}, "checkpointengine.backend"), ({"num_slots": 1}, "num_slots"),
                        ({"group_backend": "mpi"}, "group_backend"), ({"bucket_bytes": 10}, "bucket_bytes"),
                        ({"timeout_s": 0}, "timeout_s"), ({"dtype": "int8"}, "checkpointengine.dtype")]:
        with pytest.raises(ValueError, match=key):
            CheckpointEngineConfig(**kwargs)
    assert torch.bfloat16 == getattr(torch, CheckpointEngineConfig(dtype="bfloat16").dtype)
