"""What a model allows a generation engine: its EOS ids and its context length (prompt + response tokens),
read from the transformers config alone (no weights), so the controller can check data and config at start
with the numbers the torch engine will use; and the torch engine's checks of a request
(``check_request_fits``) and of new weights (``staged_weights``) against the model."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rollers.engine import GenerationRequest


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


def check_request_fits(request: GenerationRequest, vocab_size: int, max_seq_len: int) -> None:
    """Raise ValueError naming the field unless ``request`` fits a model of ``vocab_size`` tokens and a
    context of ``max_seq_len`` tokens: token ids and stop ids in ``[0, vocab_size)``, ``top_k`` at most
    ``vocab_size``, and a prompt shorter than ``max_seq_len`` (at least one token of room)."""
    rid, sampling, vocab = request.request_id, request.sampling, vocab_size
    if len(request.input_ids) >= max_seq_len:
        raise ValueError(
            f"request {rid!r}: prompt of {len(request.input_ids)} tokens leaves no room for a response "
            f"within max_seq_len={max_seq_len} (the model's context length)"
        )
    bad = [t for t in request.input_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"request {rid!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
    bad = [t for t in sampling.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"request {rid!r}: stop_token_ids {bad[:5]} outside the vocabulary [0, {vocab})")
    if sampling.top_k > vocab:
        raise ValueError(f"request {rid!r}: top_k={sampling.top_k} exceeds the vocabulary size {vocab} "
                         "(use -1 to turn top-k off)")


def staged_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target parameter or buffer, new tensor) for each of ``named_tensors``, every one checked before any is
    copied: names are ``model.state_dict`` keys (KeyError for another), shapes must match (ValueError)."""
    targets = model.state_dict(keep_vars=True)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, tensor in named_tensors:
        if name not in targets:
            raise KeyError(f"load_weights: unknown tensor {name!r} (not in the model's state_dict)")
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(target.shape)}"
            )
        staged.append((target, tensor))
    return staged
