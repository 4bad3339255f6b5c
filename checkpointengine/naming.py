"""Trainer names → engine names, tied embeddings, and the engine-dtype cast of the send side."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Wrapper prefixes that torch.compile, DDP and activation checkpointing add to parameter names.
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"


class MissingWeightsError(ValueError):
    """An update would leave engine parameters untouched (the message names them)."""


def engine_dtype_of(tensor: torch.Tensor, engine_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``tensor`` travels in: ``engine_dtype`` for floating tensors, its own dtype otherwise
    (integer and bool buffers are never cast)."""
    return engine_dtype if tensor.is_floating_point() else tensor.dtype


def to_engine_dtype(tensor: torch.Tensor, engine_dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` cast to the dtype it travels in, contiguous; the same object when nothing changes
    (an already-bf16 tensor is not copied)."""
    return tensor.to(engine_dtype_of(tensor, engine_dtype)).contiguous()


class WeightNameMapper:
    """Maps trainer parameter names to engine names and checks that an update covers the engine.

    ``tie_word_embeddings``: the engine shares ``lm_head.weight`` with ``model.embed_tokens.weight``.
    Then only the embedding travels: a trainer ``lm_head.weight`` is dropped when the embedding is
    also sent (both names → no warning) and renamed to the embedding when it comes alone.
    ``expected_names``: every engine parameter an update must cover (``None`` = no check); with tied
    embeddings ``lm_head.weight`` is not expected. ``renames``: extra exact renames applied after the
    wrapper prefixes are stripped.
    """

    def __init__(self, tie_word_embeddings: bool = False, expected_names: Collection[str] | None = None,
                 renames: dict[str, str] | None = None):
        self.tie_word_embeddings = tie_word_embeddings
        self.renames = dict(renames or {})
        expected = set(expected_names) if expected_names is not None else None
        if expected is not None and tie_word_embeddings:
            expected.discard(LM_HEAD_NAME)
        self.expected_names = expected

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> WeightNameMapper:
        """A mapper for a Hugging Face causal LM (engine side names = the model's state-dict keys)."""
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        names = [cls.strip(n) for n in model.state_dict().keys()]
        persistent = [n for n in names if "rotary_emb" not in n]
        return cls(tie_word_embeddings=tied, expected_names=persistent)

    @staticmethod
    def strip(name: str) -> str:
        """``name`` without wrapper prefixes (``_orig_mod.``, ``module.``, ...) anywhere in its path."""
        changed = True
        while changed:
            changed = False
            for prefix in WRAPPER_PREFIXES:
                if name.startswith(prefix):
                    name, changed = name[len(prefix):], True
        for prefix in WRAPPER_PREFIXES[:1] + WRAPPER_PREFIXES[2:]:
            name = name.replace("." + prefix, ".")
        return name

    def engine_name(self, name: str) -> str:
        """The engine name of trainer tensor ``name`` (prefixes stripped, ``renames`` applied)."""
        stripped = self.strip(name)
        return self.renames.get(stripped, stripped)

    def route(self, named: Iterable[tuple[str, T]]) -> Iterator[tuple[str, T]]:
        """Yield ``(engine_name, item)`` for a stream of ``(trainer_name, item)``, resolving tied
        embeddings: with ``tie_word_embeddings`` an ``lm_head.weight`` is dropped when the embedding is
        sent too (in any order: a head seen first is held back until the stream ends) and renamed to
        the embedding when it comes alone. Raises ValueError when two names map to one engine name."""
        seen: dict[str, str] = {}
        held: tuple[str, T] | None = None
        for name, item in named:
            engine = self.engine_name(name)
            if self.tie_word_embeddings and engine == LM_HEAD_NAME:
                if EMBED_NAME not in seen and held is None:
                    held = (name, item)
                continue
            if engine in seen:
                raise ValueError(f"trainer tensors {seen[engine]!r} and {name!r} both map to engine "
                                 f"tensor {engine!r}")
            seen[engine] = name
            if engine == EMBED_NAME:
                held = None
            yield engine, item
        if held is not None and EMBED_NAME not in seen:
            yield EMBED_NAME, held[1]

    def check_coverage(self, sent_engine_names: Collection[str]) -> None:
        """Raises MissingWeightsError naming every expected engine tensor absent from the update (e.g.
        the ``lm_head.weight`` of an untied model that was not sent)."""
        if self.expected_names is None:
            return
        missing = sorted(self.expected_names - set(sent_engine_names))
        if missing:
            hint = ""
            if LM_HEAD_NAME in missing and not self.tie_word_embeddings:
                hint = " (the engine's lm_head is untied: send lm_head.weight too)"
            raise MissingWeightsError(
                f"update leaves {len(missing)} engine tensors unset: {missing[:8]}{hint}")
