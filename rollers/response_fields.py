"""Finished engine outputs as the sample contract's response fields, and the per-sample seeds and forced
lengths that make a sample depend only on (``rollout.seed``, uid, index).

``build_response_fields`` is what the roller builds for a group (``rollers.roller``); the channel puts its
fields and turns its per-sample values into tags (``common.schema.ROLLER``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

import torch

from common import schema
from rollers.config import RolloutConfig
from rollers.engine import GenerationOutput


def sample_seed(base_seed: int, uid: str, index: int, num_prefix_tokens: int = 0) -> int:
    """The sampling seed of sample ``index`` of group ``uid`` (62 bits, from blake2b).

    Depends only on (``rollout.seed``, uid, index) — not on batch composition or which roller runs it —
    and on ``num_prefix_tokens`` for a continuation after an abort, so a resumed sample does not replay
    the random stream of its first part.
    """
    digest = hashlib.blake2b(f"{base_seed}:{uid}:{index}:{num_prefix_tokens}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def forced_response_length(rollout: RolloutConfig, uid: str, index: int) -> int | None:
    """The response length (tokens) sample ``index`` of group ``uid`` is forced to decode, or None when
    ``rollout.forced_response_lengths`` is empty. Drawn from that mixture (a bucket by weight, then uniform
    in ``[min_tokens, max_tokens]``) with a generator seeded by (``rollout.seed``, uid, index) only."""
    buckets = rollout.forced_response_lengths
    if not buckets:
        return None
    digest = hashlib.blake2b(f"length:{rollout.seed}:{uid}:{index}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    _, low, high = rng.choices(buckets, weights=[b[0] for b in buckets])[0]
    return rng.randint(low, high)


def response_digest(fields: dict[str, Any], row: int) -> str:
    """A short hex digest of sample ``row``'s valid response tokens (lets the controller compare runs
    token for token without seeing tensors)."""
    length = int(fields[schema.RESPONSE_LENGTH][row])
    tokens = fields[schema.RESPONSES][row, :length].to(torch.int64).numpy().tobytes()
    return hashlib.blake2b(tokens, digest_size=8).hexdigest()


def build_response_fields(
    outputs: Sequence[GenerationOutput], scores: Sequence[float], pad_token_id: int, pad_to: int | None = None
) -> dict[str, Any]:
    """The response fields of the sample schema (``common/schema.py``) for finished engine outputs.

    ``outputs``: one per sample, each with >= 1 token and ``finish_reason`` set; ``scores``: one reward
    per sample; ``pad_to``: response width (default: the longest output). Returns, with B samples and
    L = width: ``responses`` (B, L) int64 right-padded with ``pad_token_id``; ``response_mask`` (B, L)
    int64, 1 on the output's own tokens (through the stop token inclusive) and 0 on padding — positional,
    so pads are excluded even when ``pad_token_id`` is an EOS id; ``rollout_log_probs`` (B, L) fp32,
    0 on padding; ``token_level_scores`` (B, L) fp32, the reward on the last valid token;
    ``min_weight_version``/``max_weight_version``/``response_length`` (B,) int64; ``finish_reason``
    list of B str. Raises ValueError for mismatched lengths, empty or unfinished outputs, or an output
    longer than ``pad_to``.
    """
    if len(outputs) != len(scores) or not outputs:
        raise ValueError(f"need one score per output and at least one output: {len(outputs)} vs {len(scores)}")
    lengths = [len(o.output_ids) for o in outputs]
    width = max(lengths) if pad_to is None else pad_to
    for out, length in zip(outputs, lengths, strict=True):
        if length == 0 or out.finish_reason not in schema.FINISH_REASONS:
            raise ValueError(f"output {out.request_id!r}: {length} tokens, finish_reason={out.finish_reason!r}; "
                             f"need >= 1 token and one of {list(schema.FINISH_REASONS)}")
        if not length == len(out.output_log_probs) == len(out.weight_versions):
            raise ValueError(f"output {out.request_id!r}: {length} tokens but {len(out.output_log_probs)} "
                             f"log-probs and {len(out.weight_versions)} weight versions")
        if length > width:
            raise ValueError(f"output {out.request_id!r} has {length} tokens, more than pad_to={width}")
    batch = len(outputs)
    responses = torch.full((batch, width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((batch, width), dtype=torch.int64)
    log_probs = torch.zeros((batch, width), dtype=torch.float32)
    token_scores = torch.zeros((batch, width), dtype=torch.float32)
    for row, (out, length, score) in enumerate(zip(outputs, lengths, scores, strict=True)):
        responses[row, :length] = torch.tensor(out.output_ids, dtype=torch.int64)
        mask[row, :length] = 1
        log_probs[row, :length] = torch.tensor(out.output_log_probs, dtype=torch.float32)
        token_scores[row, length - 1] = float(score)
    return {
        schema.RESPONSES: responses,
        schema.RESPONSE_MASK: mask,
        schema.ROLLOUT_LOG_PROBS: log_probs,
        schema.TOKEN_LEVEL_SCORES: token_scores,
        schema.MIN_WEIGHT_VERSION: torch.tensor([o.min_weight_version for o in outputs], dtype=torch.int64),
        schema.MAX_WEIGHT_VERSION: torch.tensor([o.max_weight_version for o in outputs], dtype=torch.int64),
        schema.RESPONSE_LENGTH: torch.tensor(lengths, dtype=torch.int64),
        schema.FINISH_REASON: [o.finish_reason for o in outputs],
    }
