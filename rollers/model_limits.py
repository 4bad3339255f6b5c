"""What a model's config allows a generation engine: its EOS ids and its context length (prompt + response
tokens), read from the transformers config alone (no weights), so the controller can check data and
config at start with the numbers the torch engine will use."""

from __future__ import annotations

import torch


def collect_eos_ids(model: torch.nn.Module, tokenizer_or_eos_ids) -> frozenset[int]:
    """Every EOS id of ``model`` (its ``generation_config`` and ``config`` may list several) plus those
    of ``tokenizer_or_eos_ids``: a tokenizer (its ``eos_token_id``), one id, or an iterable of ids."""
    ids: set[int] = set()

    def add(value) -> None:
        if value is None:
            return
        if isinstance(value, int):
            ids.add(value)
        else:
            ids.update(int(v) for v in value)

    if hasattr(tokenizer_or_eos_ids, "eos_token_id"):
        add(tokenizer_or_eos_ids.eos_token_id)
    else:
        add(tokenizer_or_eos_ids)
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        add(getattr(cfg, "eos_token_id", None))
    return frozenset(ids)


def context_length(config) -> int:
    """The longest prompt + response (tokens) a ``TorchEngine`` serves for a model of this transformers
    ``config`` by default: ``max_position_embeddings`` (4096 when unset), capped at a sliding window.
    Raises ValueError for layers the engine cannot run."""
    window = attention_window(config)
    length = position_limit(config)
    return min(length, window) if window is not None else length


def position_limit(config) -> int:
    """``max_position_embeddings`` of ``config`` (4096 when unset)."""
    return int(getattr(config, "max_position_embeddings", 0) or 4096)


def attention_window(config) -> int | None:
    """The model's sliding-window size (None without one); ValueError for layers the engine cannot run.

    Below the window, sliding-window attention equals full causal attention, so the engine serves such
    models with ``max_seq_len`` capped at the window (see ``rollers.torch_engine``).
    """
    unsupported = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if unsupported:
        raise ValueError(f"TorchEngine runs full/sliding attention layers only; the model has {unsupported}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        uses_window = "sliding_attention" in layer_types
    else:
        uses_window = getattr(config, "use_sliding_window", True)
    window = getattr(config, "sliding_window", None)
    return int(window) if uses_window and window else None
