"""Small collectives over the trainer ranks' default process group (gloo on CPU, NCCL on GPU).

Every function here is collective: all ranks call it, in the same order, with tensors of the same dtype.
No Python objects are pickled: strings travel as padded UTF-8 byte tensors.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch
import torch.distributed as dist


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce(values: Sequence[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    """Element-wise ``op`` (SUM, MAX, MIN) of a short list of numbers over all ranks, in float64."""
    t = torch.tensor(list(values), dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, in rank order; ranks may hold different row counts,
    trailing dimensions must agree. Returns a tensor on ``x``'s device."""
    device = _comm_device()
    counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([x.shape[0]], dtype=torch.long, device=device))
    sizes = [int(c.item()) for c in counts]
    padded = torch.zeros((max(sizes), *x.shape[1:]), dtype=x.dtype, device=device)
    padded[: x.shape[0]] = x.to(device)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)], dim=0).to(x.device)


def all_gather_strings(items: Sequence[str]) -> list[str]:
    """Concatenate every rank's list of strings, in rank order (UTF-8 bytes in a padded uint8 tensor)."""
    encoded = [s.encode("utf-8") for s in items]
    width = int(all_reduce([max((len(b) for b in encoded), default=0)], dist.ReduceOp.MAX)[0])
    table = torch.zeros((len(encoded), width + 1), dtype=torch.uint8)
    for i, b in enumerate(encoded):
        table[i, 0] = 1  # marks a real row; bytes follow
        table[i, 1 : 1 + len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else 0
    gathered = all_gather_rows(table)
    return [bytes(row[1:].tolist()).rstrip(b"\x00").decode("utf-8") for row in gathered]


def uid_groups_rank_local(uid: Sequence[str]) -> bool:
    """Whether every ``uid`` group lies on one rank (no uid on two ranks); the same answer on every rank.

    Gathers one 8-byte BLAKE2b hash per distinct uid of each rank (not the uids, nor any sample): a hash
    collision of two different uids on two ranks can only answer False, the safe answer. One rank: True
    without communication."""
    if dist.get_world_size() == 1:
        return True
    hashes = [int.from_bytes(hashlib.blake2b(u.encode("utf-8"), digest_size=8).digest(), "little", signed=True)
              for u in sorted({str(u) for u in uid})]
    every = all_gather_rows(torch.tensor(hashes, dtype=torch.int64))
    return every.unique().numel() == every.numel()


def global_masked_stats(x: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, float]:
    """``{prefix}/mean|max|min`` of ``x`` over the valid tokens of ``mask`` on *all* ranks (0.0 each when
    no rank has a valid token). ``x``, ``mask``: ``(batch, response_len)``."""
    valid = x.detach()[mask.bool()].double()
    total, count = all_reduce([valid.sum().item(), valid.numel()])
    high = all_reduce([valid.max().item() if valid.numel() else float("-inf")], dist.ReduceOp.MAX)[0]
    low = all_reduce([valid.min().item() if valid.numel() else float("inf")], dist.ReduceOp.MIN)[0]
    if count == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": total / count, f"{prefix}/max": high, f"{prefix}/min": low}


def broadcast_json(obj: dict | None) -> dict:
    """Rank 0's ``obj`` (JSON-serialisable; None on the other ranks) on every rank, as UTF-8 JSON bytes in a
    uint8 tensor (no pickle). Without a process group (one process) ``obj`` itself."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert obj is not None, "rank 0 must pass the object"
        return obj
    data = json.dumps(obj).encode() if obj is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=_comm_device())
    dist.broadcast(size, src=0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=_comm_device())
    if obj is not None:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().numpy()))
