"""Splitting a training batch: data-parallel shards, PPO mini-batches and micro-batches, by ``uid`` group.

A *batch* here is a mapping of sample-schema fields (``common/schema.py``): tensors with the batch
as their first dimension, plus per-sample lists (``uid``, ``finish_reason``). A ``TensorDict`` is accepted
too and turned into a plain dict by :func:`as_batch_dict`.

How one training batch of ``G`` prompt groups is cut (``m = trainer.ppo_mini_batch_size`` prompts,
``M = trainer.num_ranks``)::

    groups (first-appearance order of uid):  g0 g1 g2 g3 | g4 g5 g6 g7        m = 4, M = 2
    global mini-batches:                     mini 0      | mini 1
    rank 0 gets                              g0 g1       | g4 g5
    rank 1 gets                              g2 g3       | g6 g7

Each rank's slice is its share of every global mini-batch, concatenated, together with the number of its
samples in each mini-batch (``mini_batch_sizes``), so every rank steps the optimizer on the same global
mini-batch. Groups are never split (so a group-local advantage estimator runs on each rank's own rows,
without gathering the batch: ``trainers/advantage_stage.py``). When ``m`` is not a multiple of ``M`` (or a mini-batch has fewer than
``M`` groups) ranks get unequal shares; the worker then pads with fully masked micro-batches so every rank
runs the same number of forward/backward passes (collectives must match), and the loss — normalised by the
global token count — is unchanged. A rank whose share of a mini-batch is empty contributes zero gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common import schema


def as_batch_dict(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A plain ``dict`` view of ``batch`` (a dict or a ``TensorDict``); raises TypeError for anything else.

    TensorDict non-tensor entries (e.g. ``uid`` stored with ``set_non_tensor``) come back as Python lists.
    """
    try:
        from tensordict import TensorDictBase
    except ImportError:  # pragma: no cover - tensordict is a dependency
        TensorDictBase = ()  # noqa: N806
    if isinstance(batch, TensorDictBase):
        out: dict[str, Any] = {}
        for key in batch.keys():
            value = batch.get(key)
            if not isinstance(value, torch.Tensor):
                value = batch.get_non_tensor(key)
                value = list(value) if not isinstance(value, str) else [value]
            out[key] = value
        return out
    if isinstance(batch, Mapping):
        return dict(batch)
    raise TypeError(f"a batch must be a dict or a TensorDict, got {type(batch).__name__}")


def batch_size(batch: Mapping[str, Any]) -> int:
    """Number of samples: the first dimension of ``responses`` (or of the first field).

    Raises ValueError if the batch is empty or its fields disagree on the batch size.
    """
    if not batch:
        raise ValueError("the batch has no fields")
    sizes = {key: (value.shape[0] if isinstance(value, torch.Tensor) else len(value)) for key, value in batch.items()}
    size = sizes.get(schema.RESPONSES, next(iter(sizes.values())))
    wrong = {key: n for key, n in sizes.items() if n != size}
    if wrong:
        raise ValueError(f"batch fields disagree on the batch size {size}: {wrong}")
    return size


def select(batch: Mapping[str, Any], indices: Sequence[int] | torch.Tensor) -> dict[str, Any]:
    """The samples ``indices`` of ``batch`` (tensors indexed on dim 0, lists element-wise), in that order."""
    idx = torch.as_tensor(list(indices) if not isinstance(indices, torch.Tensor) else indices, dtype=torch.long)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.index_select(0, idx.to(value.device))
        else:
            out[key] = [value[i] for i in idx.tolist()]
    return out


def concat(batches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Samples of ``batches`` one after the other; every batch must have the same fields."""
    if not batches:
        raise ValueError("concat needs at least one batch")
    keys = list(batches[0])
    out: dict[str, Any] = {}
    for key in keys:
        parts = [b[key] for b in batches]
        if isinstance(parts[0], torch.Tensor):
            out[key] = torch.cat(parts, dim=0)
        else:
            out[key] = [x for part in parts for x in part]
    return out


def uid_groups(uid: Sequence[Any]) -> list[list[int]]:
    """Sample indices of each ``uid`` group, groups in order of first appearance, samples in batch order."""
    groups: dict[Any, list[int]] = {}
    for i, u in enumerate(uid):
        groups.setdefault(u, []).append(i)
    return list(groups.values())


@dataclass(frozen=True)
class RankShard:
    """One rank's slice of a batch: sample ``indices`` into the full batch (mini-batch by mini-batch) and
    how many of them fall into each global mini-batch (``mini_batch_sizes``, sums to ``len(indices)``)."""

    indices: list[int]
    mini_batch_sizes: list[int]


def shard_for_ranks(uid: Sequence[Any], num_ranks: int, ppo_mini_batch_size: int) -> list[RankShard]:
    """Cut a batch into ``num_ranks`` data-parallel shards of whole uid groups (see the module docstring).

    ``uid``: per-sample group ids; ``ppo_mini_batch_size``: prompts (groups) per global mini-batch.
    Within a mini-batch, groups are dealt to ranks in contiguous runs of near-equal length (the first
    ranks take one more when it does not divide). Raises ValueError if there are fewer groups than ranks.
    """
    if num_ranks < 1 or ppo_mini_batch_size < 1:
        raise ValueError(f"num_ranks and ppo_mini_batch_size must be >= 1, got {num_ranks}, {ppo_mini_batch_size}")
    groups = uid_groups(uid)
    if len(groups) < num_ranks:
        raise ValueError(f"a batch of {len(groups)} uid groups cannot feed trainer.num_ranks={num_ranks} ranks")
    shards = [RankShard([], []) for _ in range(num_ranks)]
    for start in range(0, len(groups), ppo_mini_batch_size):
        mini = groups[start : start + ppo_mini_batch_size]
        per_rank, extra = divmod(len(mini), num_ranks)
        pos = 0
        for rank, shard in enumerate(shards):
            take = per_rank + (1 if rank < extra else 0)
            rows = [i for group in mini[pos : pos + take] for i in group]
            pos += take
            shard.indices.extend(rows)
            shard.mini_batch_sizes.append(len(rows))
    return shards


def local_mini_batch_sizes(uid: Sequence[Any], groups_per_mini_batch: int) -> tuple[list[int], list[int]]:
    """``(order, sizes)`` that cut a rank-local batch into mini-batches of ``groups_per_mini_batch`` whole
    uid groups: ``order`` lists sample indices group by group, ``sizes`` the samples per mini-batch."""
    groups = uid_groups(uid)
    order: list[int] = []
    sizes: list[int] = []
    for start in range(0, len(groups), groups_per_mini_batch):
        rows = [i for group in groups[start : start + groups_per_mini_batch] for i in group]
        order.extend(rows)
        sizes.append(len(rows))
    return order, sizes


def _lengths(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: real prompt tokens (``attention_mask``) and the response up to its last valid token
    (``response_mask``; full width without one), both ``(batch,)`` int64."""
    prompt = batch[schema.ATTENTION_MASK].ne(0).sum(dim=1)
    mask = _valid_responses(batch)
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    extent = (mask * cols).amax(dim=1) if mask.shape[1] else torch.zeros_like(prompt)
    return prompt.cpu(), extent.cpu()


def length_order(batch: Mapping[str, Any]) -> list[int]:
    """Sample indices of ``batch`` by the length of each sample's sequence, shortest first (stable): real
    prompt tokens (``attention_mask``) plus the response up to its last valid token (``response_mask``).
    Micro-batches cut in this order hold samples of similar length, so :func:`trim_padding` drops most of
    their padding (verl's dynamic batch size rearranges by length for the same reason). Without a
    ``response_mask`` (a forward-only batch may lack one) every response counts as full width."""
    prompt, extent = _lengths(batch)
    return torch.argsort(prompt + extent, stable=True).tolist()


def micro_batch_plan(batch: Mapping[str, Any] | None, micro_batch_size: int, max_token_len: int = 0,
                     share_prompts: bool = False) -> tuple[list[int], list[slice]]:
    """How a batch is cut into micro-batches: ``(order, slices)``, ``order`` = :func:`length_order` and the
    slices consecutive runs of it, each at most ``micro_batch_size`` samples and, when ``max_token_len`` > 0
    (verl's dynamic batch size, ``ppo_max_token_len_per_gpu``), at most ``max_token_len`` tokens as the
    forward will see them after :func:`trim_padding`: rows × (longest prompt + longest response). A sample
    longer than the budget alone gets a micro-batch of its own. Every sample is in exactly one slice.

    With samples of very different lengths (multi-turn trajectories) a fixed count puts a few long ones
    with short ones padded to their width; the budget keeps short samples many to a pass and long ones
    few. The loss is unchanged by the cut (``trainers.update``: sums normalised by the global token count).

    ``share_prompts`` (the forward of :func:`shared_prompt_layout`): ``order`` keeps the samples of one
    prompt (:func:`prompt_groups`) together, groups by their packed length (prompt + all responses), so a
    micro-batch shares each prompt among as many samples as it can; the budget counts what that forward
    sees: rows × (longest prompt + the longest row's responses), or one row per sample where that row would be
    wider than :data:`SHARED_ROW_MAX_TOKENS` (the forward then does not share).

    ``batch`` ``None`` or empty (a rank without samples in a mini-batch): ``([], [])``.
    """
    if not batch:
        return [], []
    prompt, extent = _lengths(batch)
    if share_prompts:
        groups = prompt_groups(batch)
        packed = [int(prompt[g[0]]) + sum(int(extent[i]) for i in g) for g in groups]
        order = [i for k in sorted(range(len(groups)), key=packed.__getitem__) for i in groups[k]]
        group_of = {i: k for k, members in enumerate(groups) for i in members}
    else:
        order = torch.argsort(prompt + extent, stable=True).tolist()  # length_order
    if max_token_len <= 0:
        return order, micro_batch_slices(len(order), micro_batch_size)

    def tokens(rows: dict[int, int], samples: int, wp: int, we: int) -> int:
        shared_width = wp + max(rows.values())
        return len(rows) * shared_width if share_prompts and shared_width <= SHARED_ROW_MAX_TOKENS \
            else samples * (wp + we)

    slices, start, widest_prompt, widest_response, rows = [], 0, 0, 0, {}
    for i, index in enumerate(order):
        p, e = int(prompt[index]), int(extent[index])
        key = group_of[index] if share_prompts else i  # rows: row key -> its responses' tokens
        grown = rows | {key: rows.get(key, 0) + e}
        wp, we = max(widest_prompt, p), max(widest_response, e)
        if i > start and (i - start + 1 > micro_batch_size or tokens(grown, i - start + 1, wp, we) > max_token_len):
            slices.append(slice(start, i))
            start, wp, we, grown = i, p, e, {key: e}
        widest_prompt, widest_response, rows = wp, we, grown
    if order:
        slices.append(slice(start, len(order)))
    return order, slices


def _valid_responses(batch: Mapping[str, Any]) -> torch.Tensor:
    """``(batch, response_len)`` bool: ``response_mask != 0``, or all true without a ``response_mask``."""
    mask = batch.get(schema.RESPONSE_MASK)
    return mask.ne(0) if mask is not None else torch.ones_like(batch[schema.RESPONSES], dtype=torch.bool)


def trim_padding(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` without the padding columns no sample needs: prompt columns left of every sample's first
    real token (``input_ids``, ``attention_mask``: ``(batch, prompt_len)``, left-padded) and response columns
    right of every sample's last valid token (``response_mask`` ≠ 0, none without one; at least one column is kept), cut from
    every other tensor ``(batch, response_len, ...)`` — the schema's response fields and per-token outputs of
    earlier stages. Exact for everything computed on valid tokens: positions ids count real tokens
    (:func:`position_ids_from_mask`) and attention is causal, so a valid token never sees a cut
    column. Per-token results come back narrower: ``(batch, kept_response_len)``."""
    mask = _valid_responses(batch)
    width = mask.shape[1]
    valid = mask.any(dim=0).nonzero()
    keep = int(valid.max()) + 1 if len(valid) else min(width, 1)
    real = batch[schema.ATTENTION_MASK].ne(0).any(dim=0).nonzero()
    start = int(real.min()) if len(real) else 0
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in (schema.INPUT_IDS, schema.ATTENTION_MASK):
            value = value[:, start:]
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == width:
            value = value[:, :keep]
        out[key] = value
    return out


def micro_batch_slices(num_samples: int, micro_batch_size: int) -> list[slice]:
    """Consecutive slices of at most ``micro_batch_size`` samples covering ``range(num_samples)``."""
    return [slice(i, min(i + micro_batch_size, num_samples)) for i in range(0, num_samples, micro_batch_size)]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions ``(batch, seq_len)`` counting only real tokens: ``cumsum(mask) - 1``, 0 on left padding,
    so a prompt has the same positions with or without left pads."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def within_extent(batch: Mapping[str, Any], extent: torch.Tensor | None = None) -> torch.Tensor:
    """``(batch, response_len)`` bool: the response tokens up to each sample's last valid one (``response_mask``
    ≠ 0; every column without one), interior masked tokens included. ``extent``: :func:`_lengths`'s, if the
    caller has it."""
    if extent is None:
        _, extent = _lengths(batch)
    cols = torch.arange(batch[schema.RESPONSES].shape[1])
    return (cols[None, :] < extent[:, None]).to(batch[schema.RESPONSES].device)


SHARED_ROW_MAX_TOKENS = 2048
"""The widest row :func:`shared_prompt_layout` builds. A shared row's attention costs its width squared (its
mask is ``width × width``), one row per sample ``n × (P + R)²``: sharing a short prompt among many long
responses would cost more attention (and mask memory) than the prompt tokens it saves. Below ~2-3k tokens a
forward's linear layers dominate for models of SmolLM2's width and up (a 576-wide layer: attention passes them
at ~3k), so up to this width sharing only saves."""


def prompt_groups(batch: Mapping[str, Any]) -> list[list[int]]:
    """Sample indices of ``batch`` with the same prompt (real tokens of ``input_ids``: ``attention_mask`` ≠ 0),
    groups in first-appearance order, samples in batch order. The ``rollout.n`` samples of a prompt group
    share one; so do two groups whose prompts happen to be equal, which changes nothing computed on them."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (ids, mask) in enumerate(zip(batch[schema.INPUT_IDS].tolist(),
                                            batch[schema.ATTENTION_MASK].tolist(), strict=True)):
        groups.setdefault(tuple(t for t, m in zip(ids, mask, strict=True) if m), []).append(index)
    return list(groups.values())


@dataclass(frozen=True)
class SharedPromptLayout:
    """A batch laid out for a shared-prompt forward (PrefixGrouper, Liu et al. 2025, arXiv:2506.05433): one
    row per prompt group, its prompt once and every sample's response after it,
    ``[left-padded prompt | response 1 | response 2 | ... | right pad]``, where response ``i`` attends to the
    prompt and to itself only. ``n`` samples of a ``P``-token prompt cost ``P + sum(R_i)`` tokens instead of
    ``n * P + sum(R_i)``; every output equals the one-row-per-sample forward's (same attention context and
    positions), so gradients do too.

    ``input_ids``/``position_ids``: ``(rows, width)`` int64; ``attention_mask``: ``(rows, 1, width, width)``
    bool, True where query (dim 2) may attend to key (dim 3) — the 4-D mask Hugging Face models take as is;
    a padding query attends to itself only, so no softmax row is empty. ``source``: ``(batch,
    response_len)`` int64, for each response token the flat index ``row * width + column`` of the position
    whose output predicts it (the last prompt token for the first, else the previous response token);
    ``valid``: ``(batch, response_len)`` bool, the tokens up to each sample's last valid one (``source`` is
    0 elsewhere). ``prompt_width``: the prompt columns (the batch's ``prompt_len``); the first output column
    any response needs is ``prompt_width - 1``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    source: torch.Tensor
    valid: torch.Tensor
    prompt_width: int


def shared_prompt_layout(batch: Mapping[str, Any]) -> SharedPromptLayout | None:
    """:class:`SharedPromptLayout` of ``batch`` (``input_ids``/``attention_mask`` ``(batch, prompt_len)``
    left-padded with at least one real token each, ``responses`` ``(batch, response_len)``, optional
    ``response_mask``): groups by :func:`prompt_groups`; each response is kept up to its last valid token
    (interior masked tokens, such as a tool's output, stay as context). None when its widest row would exceed
    :data:`SHARED_ROW_MAX_TOKENS` (then one row per sample costs less)."""
    prompts, prompt_mask, responses = batch[schema.INPUT_IDS], batch[schema.ATTENTION_MASK], batch[schema.RESPONSES]
    num, width_p = prompts.shape
    lengths = _lengths(batch)
    prompt_len, extent = (t.tolist() for t in lengths)
    groups = prompt_groups(batch)
    width = width_p + max(sum(extent[i] for i in g) for g in groups)
    if width > SHARED_ROW_MAX_TOKENS:
        return None
    device = prompts.device
    ids = torch.zeros((len(groups), width), dtype=torch.int64, device=device)
    pos = torch.zeros_like(ids)
    segment = torch.full_like(ids, -1)  # -1 padding, 0 prompt, s >= 1 the s-th response of the row
    source = torch.zeros((num, responses.shape[1]), dtype=torch.int64, device=device)
    prompt_pos = position_ids_from_mask(prompt_mask)
    for row, members in enumerate(groups):
        first = members[0]
        ids[row, :width_p] = prompts[first]
        pos[row, :width_p] = prompt_pos[first]
        segment[row, :width_p] = torch.where(prompt_mask[first] != 0, 0, -1)
        col = width_p
        for s, i in enumerate(members, start=1):
            e = extent[i]
            if e == 0:
                continue
            ids[row, col:col + e] = responses[i, :e]
            pos[row, col:col + e] = torch.arange(prompt_len[i], prompt_len[i] + e, device=device)
            segment[row, col:col + e] = s
            source[i, 0] = row * width + width_p - 1
            source[i, 1:e] = row * width + torch.arange(col, col + e - 1, device=device)
            col += e
    cols = torch.arange(width, device=device)
    causal = cols[None, :] <= cols[:, None]  # (query, key): key not after query
    q, k = segment[:, :, None], segment[:, None, :]
    allowed = causal & (((k == 0) & (q >= 0)) | ((k == q) & (k > 0)))
    allowed |= torch.eye(width, dtype=torch.bool, device=device)
    return SharedPromptLayout(ids, pos, allowed.unsqueeze(1), source, within_extent(batch, lengths[1]), width_p)
