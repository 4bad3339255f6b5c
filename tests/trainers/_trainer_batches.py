"""Synthetic training batches for the trainer-worker tests (tiny model vocabulary)."""

from __future__ import annotations

import socket

import torch

from common import schema


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batch(num_groups: int = 2, n: int = 4, prompt_len: int = 6, response_len: int = 5, seed: int = 0,
               vocab: int = 52) -> dict:
    """``num_groups`` prompts × ``n`` samples: random left-padded prompts (0-2 pads), right-padded responses
    of random valid length 1..response_len, a 0/1 score on the last valid token, ``uid`` per group."""
    g = torch.Generator().manual_seed(seed)
    batch_n = num_groups * n
    prompts = torch.randint(4, vocab, (num_groups, prompt_len), generator=g).repeat_interleave(n, dim=0)
    pads = torch.randint(0, 3, (num_groups,), generator=g).repeat_interleave(n)
    attention_mask = (torch.arange(prompt_len)[None, :] >= pads[:, None]).long()
    input_ids = torch.where(attention_mask.bool(), prompts, torch.zeros_like(prompts))
    responses = torch.randint(4, vocab, (batch_n, response_len), generator=g)
    lengths = torch.randint(1, response_len + 1, (batch_n,), generator=g)
    response_mask = (torch.arange(response_len)[None, :] < lengths[:, None]).long()
    responses = torch.where(response_mask.bool(), responses, torch.zeros_like(responses))
    scores = torch.zeros(batch_n, response_len)
    scores[torch.arange(batch_n), lengths - 1] = torch.randint(0, 2, (batch_n,), generator=g).float()
    return {
        schema.INPUT_IDS: input_ids,
        schema.ATTENTION_MASK: attention_mask,
        schema.RESPONSES: responses,
        schema.RESPONSE_MASK: response_mask,
        schema.TOKEN_LEVEL_SCORES: scores,
        schema.UID: [f"p{i // n}" for i in range(batch_n)],
    }


def single_rank_group(backend: str = "gloo"):
    """Generator for a module fixture: this pytest process as rank 0 of a 1-rank group (gloo or nccl)."""
    import torch.distributed as dist

    from trainers.fsdp import init_distributed

    if backend == "nccl":
        torch.cuda.set_device(0)
    init_distributed(0, 1, "127.0.0.1", free_port(), backend, 120)
    try:
        yield
    finally:
        dist.destroy_process_group()


def with_training_fields(worker_or_group, batch: dict) -> dict:
    """``batch`` plus ``old_log_probs`` (and ``ref_log_prob``), ``advantages``, ``returns``."""
    out = dict(batch)
    out.update(worker_or_group.compute_log_prob(out))
    fields, _ = worker_or_group.compute_advantages(out)
    out.update(fields)
    return out
