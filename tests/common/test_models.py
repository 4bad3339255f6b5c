import time

import pytest
import torch

from common import models
from common.env import cache_dir


def test_tiny_model_forward(tiny_model_config):
    tok = models.load_tokenizer(tiny_model_config)
    model = models.load_model(tiny_model_config)
    ids = models.apply_chat_template(tok, "repeat the word a")
    assert tok.decode(ids).endswith("assistant :")
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))
    assert torch.isfinite(logits).all()


def test_tiny_model_is_deterministic_per_seed(tiny_model_config):
    a = models.load_model(tiny_model_config)
    b = models.load_model(tiny_model_config)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_meta_device_materialize_matches_eager(tiny_model_config):
    eager = models.load_model(tiny_model_config)
    meta = models.build_on_meta(models.load_hf_config(tiny_model_config))
    assert next(meta.parameters()).is_meta
    model = models.materialize(meta)
    model.load_state_dict(eager.state_dict())
    ids = torch.tensor([[5, 7, 8, 11, 12]])
    torch.testing.assert_close(model(ids).logits, eager(ids).logits)


def test_model_config_validation(tmp_path):
    with pytest.raises(ValueError, match="model.dtype"):
        models.ModelConfig(path="tiny", dtype="float8")
    with pytest.raises(ValueError, match="model.path"):
        models.ModelConfig(path="/no/such/dir")
    (tmp_path / ".metadata").write_bytes(b"")  # a DCP trainer checkpoint (trainer.save_every) is no model
    with pytest.raises(ValueError, match="trainer checkpoint.*hflow-async export"):
        models.ModelConfig(path=str(tmp_path))
    with pytest.raises(ValueError, match="model.compute_dtype='bf16'"):
        models.ModelConfig(path="tiny", compute_dtype="bf16")


def test_compute_dtype_is_what_rollers_hold():
    plain = models.ModelConfig(path="tiny")
    assert plain.resolved_compute_dtype() == "float32" and plain.for_inference().dtype == "float32"
    mixed = models.ModelConfig(path="tiny", compute_dtype="bfloat16")
    assert mixed.torch_dtype == torch.float32 and mixed.torch_compute_dtype == torch.bfloat16
    held = mixed.for_inference()
    assert held.dtype == "bfloat16" and held.torch_compute_dtype == torch.bfloat16
    assert (plain.precision, mixed.precision) == ("float32", "bfloat16 compute, float32 weights")
    assert next(models.load_model(held).parameters()).dtype == torch.bfloat16


@pytest.mark.slow
def test_smollm2_loads_from_wheel_and_answers():
    cfg = models.ModelConfig(path=models.SMOLLM2)
    t0 = time.perf_counter()
    model_dir = models.smollm2_dir()  # converts on first use, reuses the cache after
    assert (model_dir / "model.safetensors").is_file()
    assert model_dir.is_relative_to(cache_dir())
    tok = models.load_tokenizer(cfg)
    model = models.load_model(cfg)
    ids = models.apply_chat_template(tok, "What is 3 + 4? Answer with a number.")
    out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert "7" in text
    # The cached conversion is reused: a second resolve is a directory check, and a load is fast.
    mtime = (model_dir / "model.safetensors").stat().st_mtime
    t1 = time.perf_counter()
    assert models.smollm2_dir() == model_dir
    models.load_model(cfg)
    assert (model_dir / "model.safetensors").stat().st_mtime == mtime
    assert time.perf_counter() - t1 < max(10.0, t1 - t0)


@pytest.mark.parametrize("native", [True, False])
def test_auto_compute_dtype_is_bf16_mixed_precision_where_the_device_multiplies_bf16(monkeypatch, native):
    """model.compute_dtype=auto (the default): bfloat16 compute over float32 parameters where the trainer's
    device multiplies bf16 natively, else the parameter dtype; the tiny model always keeps its dtype."""
    devices = []
    monkeypatch.setattr(models, "native_bf16", lambda device: devices.append(device) or native)
    real = models.ModelConfig(path=models.SMOLLM2)
    assert real.compute_dtype == "auto" and real.dtype == "float32"
    assert real.resolved_compute_dtype("cpu") == ("bfloat16" if native else "float32") and devices == ["cpu"]
    assert real.for_inference().dtype == real.for_inference().compute_dtype == real.resolved_compute_dtype()
    assert models.ModelConfig(path=models.SMOLLM2, compute_dtype="float32").resolved_compute_dtype() == "float32"
    assert models.ModelConfig(path=models.SMOLLM2, compute_dtype="").resolved_compute_dtype() == "float32"
    assert models.ModelConfig(path=models.SMOLLM2, dtype="float16").resolved_compute_dtype() == "float16"
    assert models.ModelConfig(path="tiny").resolved_compute_dtype("cuda") == "float32"


@pytest.mark.parametrize(("avx512_bf16", "amx", "expected"),
                         [(True, False, True), (False, True, True), (False, False, False)])
def test_native_bf16_on_cpu_needs_avx512_bf16_or_amx(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert models.native_bf16("cpu") is expected


@pytest.mark.parametrize("native", [True, False])
def test_native_bf16_on_cuda_does_not_count_emulation(monkeypatch, native):
    """Pre-Ampere GPUs emulate bf16: is_bf16_supported(including_emulation=False) is the question asked."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kw: asked.append(kw) or native)
    assert models.native_bf16("cuda") is native and asked == [{"including_emulation": False}]
