"""FSDP2 model plumbing for the trainer ranks: process group, sharded construction, forwards, weight access.

Construction (torchtitan's recipe, PyTorch FSDP2 ``fully_shard``)::

    build_on_meta(hf_config)          no memory allocated
      -> fully_shard(each decoder layer), fully_shard(root)
      -> materialize(to_empty on cpu/cuda)   uninitialised local shards, rotary buffers rebuilt
      -> set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)
                                      rank 0 loads the checkpoint with ``common.models.load_model`` and
                                      broadcasts; the other ranks never read the weights from disk

Every rank holds ``Shard(0)`` rows of every parameter (``DTensor``). Gradients are reduce-scattered as
sums (``set_gradient_divide_factor(1.0)`` with more than one rank, SUM-only collectives so gloo works): the
loss on each rank is already normalised by the *global* token count, so the sum over ranks is the gradient
of the global mini-batch loss. A one-rank group reduces once per optimizer step
(``trainers.update.synced_micro_batches``).

Parameter names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``).
With tied embeddings (``tie_word_embeddings``, e.g. the tiny model and SmolLM2) ``lm_head.weight`` *is*
``model.embed_tokens.weight``: ``named_parameters`` lists it once, as ``model.embed_tokens.weight``, and
so do :func:`named_local_shards` and :func:`named_full_tensors`; a receiver that loads these names into an
HF model with tied embeddings gets ``lm_head`` through the tie.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Iterator
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from common import models, net, schema
from trainers.batching import position_ids_from_mask, shared_prompt_layout, within_extent
from trainers.losses import entropy_from_logits, log_probs_from_logits

logger = logging.getLogger(__name__)

POLICY = "policy"
CRITIC = "critic"


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
                     timeout_s: float) -> None:
    """Join the default process group (gloo on CPU, nccl on GPU) over TCP at ``master_addr:master_port``.

    Idempotent when this process already belongs to a group of the same rank and size; raises
    RuntimeError when it belongs to a different one. ``timeout_s`` bounds every collective. A gloo group
    binds the interface ``common.net.gloo_interface`` picks (ValueError naming the address when none fits).
    """
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"this process is already rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"asked to be rank {rank} of {world_size}"
            )
        return
    # Our own store: torch's tcp:// init method would listen on every interface (see common/net.py).
    store = net.tcp_store(master_addr, master_port, world_size, rank == 0, timeout_s)
    with net.gloo_interface(master_addr, f"trainer rank {rank}") if backend == "gloo" else contextlib.nullcontext():
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard(model: torch.nn.Module) -> None:
    """Free the unsharded parameters left after a forward under ``no_grad`` (the root keeps its own
    unsharded after forward). Needed before reading parameters or saving optimizer state."""
    for module in fsdp_modules(model):
        module.reshard()


def _hf_config(model_cfg: models.ModelConfig, kind: str):
    hf_config = models.load_hf_config(model_cfg)
    if kind == CRITIC:
        hf_config = copy.deepcopy(hf_config)
        hf_config.num_labels = 1
        hf_config.classifier_dropout = 0.0
    return hf_config


def _build_meta(model_cfg: models.ModelConfig, kind: str) -> torch.nn.Module:
    hf_config = _hf_config(model_cfg, kind)
    if kind == POLICY:
        return models.build_on_meta(hf_config, dtype=model_cfg.torch_dtype)
    if kind == CRITIC:
        from transformers import AutoModelForTokenClassification

        with torch.device("meta"):
            return AutoModelForTokenClassification.from_config(hf_config, dtype=model_cfg.torch_dtype)
    raise ValueError(f"unknown model kind {kind!r}; expected {POLICY!r} or {CRITIC!r}")


def _rank0_state_dict(model_cfg: models.ModelConfig, kind: str, fsdp_model: torch.nn.Module) -> dict:
    """Full weights on rank 0: the policy checkpoint; for the critic, its backbone plus a zero value head."""
    policy = models.load_model(model_cfg, device="cpu")
    state = policy.state_dict()
    if kind == POLICY:
        return state
    expected = {name for name, _ in fsdp_model.named_parameters()}
    head = {name: torch.zeros(tuple(p.shape), dtype=model_cfg.torch_dtype)
            for name, p in fsdp_model.named_parameters() if not name.startswith("model.")}
    backbone = {name: t for name, t in state.items() if name in expected}
    return {**backbone, **head}


def build_fsdp_model(model_cfg: models.ModelConfig, kind: str, device: torch.device) -> torch.nn.Module:
    """A ``kind`` model (``policy``: the causal LM; ``critic``: the same backbone with a scalar value head,
    Hugging Face's ``*ForTokenClassification`` with one label, head initialised to zero) sharded with
    FSDP2 over the default process group, weights loaded on rank 0 and broadcast. Returned in eval mode
    (no dropout: log-probs must not depend on it). Parameters in ``model.dtype``; with a different
    ``model.compute_dtype``, FSDP2 mixed precision: forwards and backwards in it, gradients reduced in
    float32. Collective: every rank must call it.
    """
    model = _build_meta(model_cfg, kind)
    layers = decoder_layers(model)
    mixed = {} if model_cfg.torch_compute_dtype == model_cfg.torch_dtype else {"mp_policy": MixedPrecisionPolicy(
        param_dtype=model_cfg.torch_compute_dtype, reduce_dtype=torch.float32)}
    for layer in layers:
        fully_shard(layer, **mixed)
    fully_shard(model, **mixed)
    models.materialize(model, device)
    for module in fsdp_modules(model):
        if dist.get_world_size() > 1:  # one rank: nothing to divide (a factor there divides a copy of every grad)
            module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM/AVG: plain SUM
    state = _rank0_state_dict(model_cfg, kind, model) if dist.get_rank() == 0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model.eval()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """A Hugging Face decoder's layers (``model.model.layers``: Llama, Qwen2, Mistral, ... and their
    ``*ForTokenClassification``); raises TypeError for a model without them."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no model.layers; cannot shard it per decoder layer")
    return layers


def _sequence(batch: dict) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    prompts, responses = batch[schema.INPUT_IDS], batch[schema.RESPONSES]
    ids = torch.cat([prompts, responses], dim=1)
    mask = torch.cat([batch[schema.ATTENTION_MASK].to(prompts.dtype), torch.ones_like(responses)], dim=1)
    return ids, mask, prompts.shape[1], responses.shape[1]


def _attention_mask_4d(model: torch.nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """``allowed`` ``(rows, 1, q, k)`` bool as the model's attention takes it: as is for SDPA (the default),
    an additive fp32 mask (0 where allowed, the fp32 minimum elsewhere) for eager attention. Raises
    ValueError for any other attention implementation (e.g. flash-attention, which takes no 4-D mask)."""
    implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min)
    raise ValueError(f"trainer.prefix_grouper=true needs sdpa or eager attention (a 4-D attention mask); the "
                     f"model uses {implementation!r}: set trainer.prefix_grouper=false")


@contextlib.contextmanager
def _logits_at(model: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Within the block, a forward of the Hugging Face causal LM ``model`` computes its logits at
    ``positions`` only: the flat indices ``row * width + column`` (int64 ``(N,)``) into its ``(rows, width)``
    input; called with ``logits_to_keep=0``, its ``logits`` are then ``(1, N, vocab)`` in that order.

    A forward hook on the decoder (``model.model``) replaces its ``last_hidden_state`` ``(rows, width,
    hidden)`` by those positions' rows ``(1, N, hidden)`` before the output head: the head and everything after
    it (log-softmax, entropy: the vocabulary-wide work) then run on the tokens that need them, not on every
    padded column and observation token. Differentiable (``index_select``). Raises TypeError for a model
    without ``model.model``."""
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, torch.nn.Module):
        raise TypeError(f"{type(model).__name__} has no decoder at model.model; cannot select its logits")

    def select(module, args, output):
        hidden = output.last_hidden_state
        output.last_hidden_state = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions).unsqueeze(0)
        return output

    handle = decoder.register_forward_hook(select)
    try:
        yield
    finally:
        handle.remove()


def response_log_probs(model: torch.nn.Module, batch: dict, temperature: float, with_entropy: bool = False,
                       entropy_grad: bool = False, share_prompts: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities of ``responses`` given the prompt, at temperature ``temperature``.

    ``batch``: ``input_ids``/``attention_mask`` ``(batch, prompt_len)`` left-padded, ``responses``
    ``(batch, response_len)``, and ``response_mask`` ``(batch, response_len)`` if it has one. Returns
    ``log_probs`` ``(batch, response_len)`` fp32, natural log of ``softmax(logits / T)`` at the sampled token
    (``T <= 0`` means greedy: raw logits, as the rollers do), and the entropy of the same distribution
    ``(batch, response_len)`` if ``with_entropy`` else None (differentiable only with ``entropy_grad``, else
    computed on detached logits to save the graph). Both are computed on the tokens ``response_mask`` marks
    (model tokens: every token a loss, KL or metric reads; all tokens without a mask) and 0 elsewhere: padding
    and a multi-turn trajectory's observation tokens are context only, and the output head and the
    vocabulary-wide softmax run on the marked tokens alone (:func:`_logits_at`; the main cost of a small
    model's training forward on CPU, whose vocabulary is wide). Position ids are ``cumsum(attention_mask) -
    1``, so left padding does not change the result.

    ``share_prompts`` (``trainer.prefix_grouper``): one forward row per distinct prompt, its samples'
    responses after it (``trainers.batching.shared_prompt_layout``; one row per sample where such a row would be
    too wide); the same values.
    """
    responses = batch[schema.RESPONSES]
    mask = batch.get(schema.RESPONSE_MASK)
    wanted = mask.to(responses.device) != 0 if mask is not None else torch.ones_like(responses, dtype=torch.bool)
    layout = shared_prompt_layout(batch) if share_prompts else None
    if layout is not None:
        wanted = wanted & layout.valid
        with _logits_at(model, layout.source[wanted]):
            out = model(input_ids=layout.input_ids, attention_mask=_attention_mask_4d(model, layout.attention_mask),
                        position_ids=layout.position_ids, logits_to_keep=0, use_cache=False)
    else:
        ids, mask_2d, prompt_len, resp_len = _sequence(batch)
        # the output at column prompt_len - 1 + j predicts response token j
        source = (torch.arange(ids.shape[0], device=ids.device)[:, None] * ids.shape[1] + prompt_len - 1
                  + torch.arange(resp_len, device=ids.device)[None, :])
        with _logits_at(model, source[wanted]):
            out = model(input_ids=ids, attention_mask=mask_2d, position_ids=position_ids_from_mask(mask_2d),
                        logits_to_keep=0, use_cache=False)
    logits = out.logits[0].float()
    if temperature > 0 and temperature != 1.0:  # dividing by 1 would change nothing and cost a pass
        logits = logits / temperature

    def spread(values: torch.Tensor) -> torch.Tensor:  # (N,) on the wanted tokens -> (batch, response_len)
        return values.new_zeros(responses.shape).masked_scatter(wanted, values)

    log_probs = spread(log_probs_from_logits(logits, responses[wanted]))
    entropy = spread(entropy_from_logits(logits if entropy_grad else logits.detach())) if with_entropy else None
    return log_probs, entropy


def response_values(critic: torch.nn.Module, batch: dict, share_prompts: bool = False) -> torch.Tensor:
    """Critic values ``(batch, response_len)`` fp32: the value head at the position *before* each response
    token (the state in which that token was chosen), as GAE (Schulman et al. 2016) expects.
    ``share_prompts``: one forward row per distinct prompt, as in :func:`response_log_probs`; values are computed
    on every token up to a sample's last valid one (observation tokens included) and are 0 after it."""
    layout = shared_prompt_layout(batch) if share_prompts else None
    if layout is not None:
        out = critic(input_ids=layout.input_ids, attention_mask=_attention_mask_4d(critic, layout.attention_mask),
                     position_ids=layout.position_ids, use_cache=False)
        values = out.logits[..., 0].reshape(-1)[layout.source].float()
        return torch.where(layout.valid, values, 0.0)
    ids, mask, prompt_len, resp_len = _sequence(batch)
    out = critic(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False)
    values = out.logits[:, prompt_len - 1 : prompt_len + resp_len - 1, 0].float()
    return torch.where(within_extent(batch), values, 0.0) if share_prompts else values


class LocalShard(NamedTuple):
    """One rank's rows of one parameter: ``tensor`` holds rows ``[row_offset, row_offset + len(tensor))``
    of the full parameter of shape ``full_shape`` (rows are contiguous: FSDP2 shards dim 0 in
    ``torch.chunk`` order). ``tensor`` may have zero rows on high ranks when rows < ranks."""

    name: str
    tensor: torch.Tensor
    row_offset: int
    full_shape: tuple[int, ...]


def named_local_shards(model: torch.nn.Module) -> Iterator[LocalShard]:
    """This rank's ``Shard(0)`` piece of every parameter (HF names, tied weights once; see the module
    docstring). Local, no communication; the tensors are views of the live parameters (detached)."""
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            raise TypeError(f"parameter {name} is not sharded (a forward under no_grad without reshard()?)")
        if param.placements != (Shard(0),):
            raise TypeError(f"parameter {name} has placements {param.placements}, expected (Shard(0),)")
        local = param.to_local().detach()
        rows, world, rank = param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank()
        offset = min(rank * math.ceil(rows / world), rows)
        assert local.shape[0] == min(math.ceil(rows / world), rows - offset), (name, local.shape, offset)
        yield LocalShard(name, local, offset, tuple(param.shape))


def named_full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every parameter, gathered one at a time (``DTensor.full_tensor()``).

    Collective: every rank must iterate it to the end, in step. Only rank 0 yields; the other ranks'
    iterators yield nothing (they take part in the gathers and finish).
    """
    rank = dist.get_rank()
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if rank == 0:
            yield name, full.detach()
