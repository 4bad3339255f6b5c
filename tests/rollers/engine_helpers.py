"""Helpers shared by the rollers tests (imported as ``tests.rollers.engine_helpers``)."""

from __future__ import annotations

import asyncio

import torch

from common.models import ModelConfig, load_model

TIMEOUT_S = 90  # below pytest-timeout's 120 s; generous for a loaded 2-core machine


def run(coro, timeout_s: float = TIMEOUT_S):
    """Run ``coro`` on a fresh event loop with a timeout (no test may hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def spiced_tiny(seed: int = 0) -> torch.nn.Module:
    """The tiny Llama with its matrices re-drawn from N(0, 0.2²) (seeded): varied, non-degenerate outputs,
    EOS not too likely."""
    model = load_model(ModelConfig(path="tiny"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model
