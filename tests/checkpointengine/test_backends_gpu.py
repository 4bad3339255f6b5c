"""The ``broadcast`` backend over NCCL: trainer rank 0 on cuda:0, a roller process on cuda:1 (NCCL needs one
GPU per rank). The same bucket round trip as the gloo test; run where a machine with 2 GPUs is lent."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import ce_procs  # noqa: E402

from checkpointengine import WeightSender  # noqa: E402
from checkpointengine.config import CheckpointEngineConfig  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL broadcast needs 2 GPUs (one per rank)")
def test_broadcast_over_nccl_is_bit_exact():
    torch.cuda.set_device(0)
    cfg = CheckpointEngineConfig(backend="broadcast", dtype="bfloat16", timeout_s=60.0, group_backend="nccl")
    sender = WeightSender(cfg, ["r0"])
    out = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(
        target=ce_procs.roller_main, args=(sender.handle.to_dict(), "r0", [(1, "ack")], out, "cuda:1"), daemon=True)
    proc.start()
    try:
        g = torch.Generator().manual_seed(5)
        named = [(f"model.layers.{i}.w", torch.randn(256, 128, generator=g).cuda()) for i in range(3)]
        named.append(("model.norm.weight", torch.randn(128, generator=g).bfloat16().cuda()))
        report = sender.send(named, 1)
        assert report.acked == ["r0"]
        roller, version, outcome, got = out.get(timeout=60)
        assert (roller, version, outcome) == ("r0", 1, "ack")
        assert got == {name: ce_procs.digest(t.to(torch.bfloat16)) for name, t in named}
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        sender.close()
