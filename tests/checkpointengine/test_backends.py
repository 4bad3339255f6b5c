"""The same update sequence on every backend, with rollers in real processes.

v1: mixed dtypes (engine bf16), a chunked tensor, an empty one → both rollers get bit-exact bf16 casts.
v2: one roller fails its load → WeightSyncError names it and v2; the other commits v2.
v3: the update would leave an engine tensor unset → MissingWeightsError, both rollers see the abort.
v4: one roller never acks → WeightSyncTimeout names it and v4, within the timeout.
Plus: FSDP2-style Shard(0) rows from a 2-rank gloo group written straight into the shm slots.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import ce_procs  # noqa: E402

from checkpointengine import (  # noqa: E402
    MissingWeightsError,
    WeightNameMapper,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightSyncTimeout,
)
from checkpointengine.config import CheckpointEngineConfig  # noqa: E402

CTX = mp.get_context("spawn")


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    named = [(f"model.layers.{i}.w", torch.randn(16, 24, generator=g).bfloat16()) for i in range(4)]
    named += [
        ("model.norm.weight", torch.randn(24, generator=g)),
        ("model.bias", torch.randn(7, generator=g).half()),
        ("model.big", torch.randn(40, 50, generator=g)),  # 4000 bf16 bytes > 1024: chunked (shm/zmq)
        ("model.empty", torch.empty(0, 3)),
        ("model.ids", torch.arange(9)),
    ]
    return named


def _expected(named):
    out = {}
    for name, t in named:
        out[name] = ce_procs.digest(t.to(torch.bfloat16) if t.is_floating_point() else t)
    return out


def _collect(out, n: int, timeout_s: float = 60.0) -> list:
    items = []
    deadline = time.monotonic() + timeout_s
    while len(items) < n:
        try:
            item = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"only {len(items)}/{n} results: {items}") from None
        assert item[2] != "crashed", item[3]
        items.append(item)
    return items


@pytest.mark.parametrize("backend", ["shm", "zmq", "broadcast", "disk"])
def test_backend_update_sequence(backend, tmp_path):
    cfg = CheckpointEngineConfig(backend=backend, bucket_bytes=1024, dtype="bfloat16", timeout_s=30.0,
                                 disk_dir=str(tmp_path), group_backend="gloo")
    sender = WeightSender(cfg, ["r0", "r1"])
    out = CTX.Queue()
    scripts = {"r0": [(1, "ack"), (2, "ack"), (3, "ack"), (4, "never_ack")],
               "r1": [(1, "ack"), (2, "fail"), (3, "ack"), (4, "ack")]}
    procs = [CTX.Process(target=ce_procs.roller_main, args=(sender.handle.to_dict(), r, s, out), daemon=True)
             for r, s in scripts.items()]
    for p in procs:
        p.start()
    try:
        named = _tensors()
        report = sender.send(named, 1)
        assert sorted(report.acked) == ["r0", "r1"]
        assert report.num_bytes == sum(t.numel() * (2 if t.is_floating_point() else 8) for _, t in named)
        results = _collect(out, 2)
        for roller, version, outcome, got in results:
            assert (version, outcome) == (1, "ack")
            assert got == _expected(named), roller

        with pytest.raises(WeightSyncError, match="version 2 failed on \\['r1'\\].*injected") as info:
            sender.send(named, 2)
        assert info.value.failures.keys() == {"r1"}
        _collect(out, 2)
        assert sender.stats()["roller_weight_versions"] == {"r0": 2, "r1": 1}

        sender.mapper = WeightNameMapper(expected_names=[n for n, _ in named] + ["lm_head.weight"])
        with pytest.raises(MissingWeightsError, match="lm_head.weight.*untied"):
            sender.send(named, 3)
        assert {(v, o) for _, v, o, _ in _collect(out, 2)} == {(3, "aborted")}

        sender.mapper = WeightNameMapper()
        sender.cfg.timeout_s = 1.0  # r0's process exits after its script: under control.DISCONNECT_GRACE_S
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeout, match="weight_version 4: rollers \\['r0'\\] did not ack"):
            sender.send(named, 4)
        assert time.monotonic() - start < 10
        stats = sender.stats()
        assert (stats["num_syncs"], stats["num_failed_syncs"], stats["num_roller_failures"]) == (2, 3, 1)
        assert stats["total_bytes"] == 2 * report.num_bytes and stats["last_sync_s"] > 0
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        sender.close()
    if backend == "shm":
        assert not any(os.path.exists(p) for p in sender.handle.fields.shm_paths), "shm slots leaked"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shm_shards_from_two_ranks_arrive_whole():
    """Each rank of a 2-rank gloo group writes only its Shard(0) rows; the roller gets the full tensors."""
    out = CTX.Queue()
    cfg_kwargs = {"backend": "shm", "bucket_bytes": 1024, "dtype": "float32", "timeout_s": 30.0}
    port = _free_port()
    ranks = [CTX.Process(target=ce_procs.shard_rank_main, args=(r, 2, port, None, cfg_kwargs, out),
                         daemon=True) for r in range(2)]
    for p in ranks:
        p.start()
    roller = None
    try:
        kind, handle = out.get(timeout=60)
        assert kind == "handle", handle
        roller = CTX.Process(target=ce_procs.roller_main, args=(handle, "r0", [(1, "ack")], out), daemon=True)
        roller.start()
        results = [out.get(timeout=60) for _ in range(5)]
        crashed = [r for r in results if r[0] == "crashed" or r[2] == "crashed"]
        assert not crashed, crashed
        got = next(r[3] for r in results if r[0] == "r0")
        assert got == {n: ce_procs.digest(t.float() if t.is_floating_point() else t)
                       for n, t in ce_procs.shard_tensors()}  # engine dtype float32: the bf16 one is cast
        reports = {r[1]: r[2] for r in results if r[0] == "report"}
        assert reports[1] is None and reports[0] >= 3
        resend = {r[1]: r[2] for r in results if r[0] == "resend"}
        assert "already has weight_version 1" in resend[0] and "rank 0 could not start" in resend[1], resend
    finally:
        for p in [*ranks, roller]:
            if p is not None:
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()


def test_shm_slots_vanish_when_the_sender_is_killed():
    """A SIGKILLed sender (e.g. a Ray actor torn down) leaves nothing in /dev/shm."""
    from checkpointengine.storage import SHM_ROOT, ShmSlots

    out = CTX.Queue()
    proc = CTX.Process(target=ce_procs.hold_slots, args=(out,), daemon=True)
    proc.start()
    try:
        pid, paths = out.get(timeout=60)
        attached = ShmSlots.attach(paths, 4096)
        assert int(attached.buffer(1)[7]) == 42  # another process sees the bytes
        assert not list(SHM_ROOT.glob(f"hflow-ce-{pid}-*")), "slot files stay named on /dev/shm"
        attached.close()
    finally:
        proc.kill()
        proc.join(timeout=20)
    with pytest.raises(FileNotFoundError, match="gone"):
        ShmSlots.attach(paths, 4096)


def test_a_roller_whose_process_exits_leaves_the_update_at_once():
    """Roller processes that exited between updates without a Want for the next one (``dead`` after an update,
    ``early`` before any: only its receiver's Hello came): the next update to them fails them as disconnected
    within seconds (``control.DISCONNECT_GRACE_S``), not after ``timeout_s``, and the live roller gets it; so
    does a later update, after one that did not target them."""
    sender = WeightSender(CheckpointEngineConfig(backend="zmq", bucket_bytes=1024, timeout_s=60.0),
                          ["r0", "dead", "early"])
    out = CTX.Queue()
    handle = sender.handle.to_dict()
    procs = [CTX.Process(target=ce_procs.roller_main, args=(handle, "dead", [(1, "ack")], out), daemon=True),
             CTX.Process(target=ce_procs.connect_then_exit, args=(handle, "early", out), daemon=True)]
    receiver = WeightReceiver(sender.handle, "r0")
    acked: list[int] = []

    def live(versions):
        for v in versions:
            dict(receiver.receive(v))
            receiver.ack(v)
            acked.append(v)

    try:
        for p in procs:
            p.start()
        r0 = threading.Thread(target=live, args=([1, 2, 3, 4],), daemon=True)
        r0.start()
        named = _tensors()
        assert sorted(sender.send(named, 1, targets=["r0", "dead"]).acked) == ["dead", "r0"]
        assert sorted(item[1:3] for item in _collect(out, 2)) == [(-1, "exited"), (1, "ack")]
        for p in procs:
            p.join(timeout=30)  # their scripts are done: each closes its receiver and exits
            assert p.exitcode == 0
        for version, targets in ((2, None), (3, ["r0"]), (4, None)):
            start = time.monotonic()
            if targets is None:
                with pytest.raises(WeightSyncError, match="failed on \\['dead', 'early'\\].*disconnected") as info:
                    sender.send(named, version)
                assert all("disconnected" in e for e in info.value.failures.values())
            else:
                assert sender.send(named, version, targets=targets).acked == ["r0"]
            assert time.monotonic() - start < 10, version  # timeout_s is 60
        r0.join(timeout=10)
        assert acked == [1, 2, 3, 4]
        assert sender.stats()["roller_weight_versions"] == {"r0": 4, "dead": 1}
    finally:
        receiver.close()
        sender.close()
        for p in procs:
            if p.is_alive():
                p.kill()
