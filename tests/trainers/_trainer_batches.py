"""Synthetic training batches for the trainer-worker tests (tiny model vocabulary)."""

from __future__ import annotations

import socket

import torch

from common import schema


def float64_random(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64 with its matrices redrawn as N(0, 0.2²) (seed 0), in train mode: small,
    well-conditioned weights whose outputs differ clearly between inputs, for exact-equality tests."""
    model = model.to(torch.float64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.2)
    return model.train()


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


# Adam's first steps move a weight by about ``lr * sign(g)``: an element whose gradient is near zero moves
# by ~lr one way or the other depending on float summation order (thread count, BLAS kernel), so weights
# after an Adam step cannot be compared tightly. With ``eps`` far above every |g| the step is
# ``lr * m / eps``: linear in the gradients, so two runs whose gradients agree within float error also
# agree in their weight updates within float error. Tests that compare updates use this (and lr 1, so the
# updates are large against the weights' float resolution).
LINEAR_ADAM_EPS = 1.0
LINEAR_ADAM_LR = 1.0


def _set_linear_adam(worker) -> None:
    for group in worker.actor_optimizer.param_groups:
        group["eps"] = LINEAR_ADAM_EPS


def linear_adam(worker_or_group) -> None:
    """Make the actor optimizer of a worker (or of every rank of a group) well-conditioned: see above."""
    if hasattr(worker_or_group, "execute"):
        worker_or_group.execute(_set_linear_adam)
    else:
        _set_linear_adam(worker_or_group)


def assert_same_updates(before_a: dict, after_a: dict, before_b: dict, after_b: dict) -> None:
    """The weight updates ``after - before`` of two runs agree (relative to the update's own size), every
    tensor moved, and both runs hold the same parameter names."""
    assert sorted(after_a) == sorted(after_b) == sorted(before_a) == sorted(before_b)
    for name in after_a:
        delta_a, delta_b = after_a[name] - before_a[name], after_b[name] - before_b[name]
        scale = delta_a.abs().max().item()
        assert scale > 1e-4, f"{name} did not move (max |update| {scale:g})"
        torch.testing.assert_close(delta_b, delta_a, atol=1e-4 * scale, rtol=1e-3, msg=name)


def with_training_fields(worker_or_group, batch: dict) -> dict:
    """``batch`` plus ``old_log_probs`` (and ``ref_log_prob``), ``advantages``, ``returns``."""
    out = dict(batch)
    out.update(worker_or_group.compute_log_prob(out))
    fields, _ = worker_or_group.compute_advantages(out)
    out.update(fields)
    return out
