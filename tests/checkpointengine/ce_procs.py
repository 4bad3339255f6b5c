"""Process entry points for the checkpoint-engine tests (importable by spawned children).

Children get results back through a ``multiprocessing`` queue: that is the test harness talking to
itself, not a socket of the project.
"""

from __future__ import annotations

import hashlib
import os
import traceback

import torch


def digest(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """(dtype, shape, sha256 of the bytes) of a tensor: what a roller reports back."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), hashlib.sha256(raw).hexdigest()


def greedy_ids(model, prompt, n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` by plain full forwards (the reference decode of these tests)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def roller_main(handle: dict, roller: str, script: list[tuple[int, str]], out, device: str = "cpu") -> None:
    """Run ``script``: (version, action) with action ack | fail | never_ack | expect_abort; report
    (roller, version, outcome, digests) for each step. ``device``: where received tensors land."""
    from common.env import set_torch_threads

    set_torch_threads(1)
    from checkpointengine import WeightReceiver, WeightSyncAborted, WeightSyncHandle

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    receiver = WeightReceiver(WeightSyncHandle.from_dict(handle), roller, device=device)
    try:
        for version, action in script:
            try:
                got = {name: digest(t) for name, t in receiver.receive(version)}
            except WeightSyncAborted as exc:
                out.put((roller, version, "aborted", str(exc)))
                continue
            if action == "ack":
                receiver.ack(version)
            elif action == "fail":
                receiver.fail(version, "injected load failure")
            out.put((roller, version, action, got))
    except BaseException:
        out.put((roller, -1, "crashed", traceback.format_exc()))
    finally:
        receiver.close()


def connect_then_exit(handle: dict, roller: str, out) -> None:
    """A roller that connects its receiver, stays a second (its ``Hello`` goes out), reports, and exits
    without ever asking for an update."""
    import time

    from checkpointengine import WeightReceiver, WeightSyncHandle

    receiver = WeightReceiver(WeightSyncHandle.from_dict(handle), roller)
    time.sleep(1.0)
    receiver.close()
    out.put((roller, -1, "exited", None))


def shard_rank_main(rank: int, world: int, port: int, handle: dict | None, cfg_kwargs: dict, out) -> None:
    """One trainer rank of a gloo group writing its Shard(0) rows of ``shard_tensors()`` as version 1."""
    import torch.distributed as dist

    from common.env import set_torch_threads

    set_torch_threads(1)
    from checkpointengine import WeightSender, WeightSyncHandle
    from checkpointengine.bucket import RowShard
    from checkpointengine.config import CheckpointEngineConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sender = None
    try:
        cfg = CheckpointEngineConfig(**cfg_kwargs)
        if rank == 0:
            sender = WeightSender(cfg, ["r0"])
            out.put(("handle", sender.handle.to_dict()))
        objs = [sender.handle.to_dict() if rank == 0 else None]
        dist.broadcast_object_list(objs, src=0)  # the controller's job in production
        if rank != 0:
            sender = WeightSender(cfg, rank=rank, handle=WeightSyncHandle.from_dict(objs[0]))
        shards = []
        for name, full in shard_tensors():
            per = -(-full.shape[0] // world)
            lo, hi = min(rank * per, full.shape[0]), min((rank + 1) * per, full.shape[0])
            shards.append(RowShard(name, full[lo:hi].clone(), lo, tuple(full.shape)))
        report = sender.send_shards(shards, 1)
        out.put(("report", rank, None if report is None else report.num_buckets))
        try:  # version 1 again: the leader refuses before starting; every rank must get an error, not hang
            sender.send_shards(shards, 1)
            out.put(("resend", rank, "no error"))
        except (ValueError, RuntimeError) as exc:
            out.put(("resend", rank, f"{type(exc).__name__}: {exc}"))
    except BaseException:
        out.put(("crashed", rank, traceback.format_exc()))
    finally:
        dist.barrier()
        if sender is not None:
            sender.close()
        dist.destroy_process_group()


def shard_tensors() -> list[tuple[str, torch.Tensor]]:
    """Full tensors that every rank can rebuild (seeded): uneven rows, a chunked one, mixed dtypes."""
    g = torch.Generator().manual_seed(5)
    return [
        ("model.embed_tokens.weight", torch.randn(37, 16, generator=g)),
        ("model.norm.weight", torch.randn(16, generator=g)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(9, 300, generator=g)),  # > bucket: chunked
        ("model.layers.0.mlp.bias", torch.randn(1, 5, generator=g).bfloat16()),
        ("model.position_ids", torch.arange(11)),
    ]


def hold_slots(out) -> None:
    """Create shm slots, write a byte, report (pid, paths), then wait to be killed (at most 60 s)."""
    import time

    from checkpointengine.storage import ShmSlots

    slots = ShmSlots.create(2, 4096)
    slots.buffer(1)[7] = 42
    out.put((os.getpid(), slots.paths))
    time.sleep(60)
