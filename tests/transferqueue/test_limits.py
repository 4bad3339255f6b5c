"""Bounds on what requests may make the servers hold (``transferqueue.max_*``, ``reservation_lease_s``),
against a real index process over real sockets: a request past a bound gets an error reply naming the
bound and its value, the server keeps serving, and nothing it had accepted is lost."""

from __future__ import annotations

import dataclasses
import time

import msgpack
import pytest
import torch
import zmq

from transferqueue import LimitExceeded, TQClient, wire
from transferqueue.config import DEFAULT_MAX_SAMPLES, SAMPLES_HEADROOM, TransferQueueConfig
from transferqueue.index import MetadataIndex
from transferqueue.launch import start_transferqueue
from transferqueue.records import Consume
from transferqueue.storage import StorageUnit

REQ = 4096  # the smallest max_request_ids allowed


TIGHT = dict(num_storage_units=1, request_timeout_s=10.0, max_request_ids=REQ, max_parked=2, reservation_lease_s=3.0,
             sampler_modules=["tests.transferqueue.sampler_plugin"])


@pytest.fixture(scope="module")
def tight_tq():
    """One unit; an index with small bounds: 4096 ids a request, 2 parked long-polls, a 3 s reservation
    lease."""
    servers = start_transferqueue(TransferQueueConfig(**TIGHT))
    yield servers
    servers.shutdown()


@pytest.fixture
def sockets(tight_tq):
    """``connect(servers=tight_tq)``: a new DEALER socket to the index of ``servers`` (a new client
    connection, as the index sees it)."""
    ctx = zmq.Context()

    def connect(servers=tight_tq) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(servers.handle.index_address)
        return s

    yield connect
    ctx.destroy(linger=0)


def ask(sock: zmq.Socket, header: dict, wait_ms: int = 10_000) -> dict | None:
    sock.send(wire.pack(header))
    return msgpack.unpackb(sock.recv(), raw=False) if sock.poll(wait_ms) else None


def wait_for_lapse(client: TQClient, lease_s: float = 3.0) -> None:
    """Until the index holds no reservation (it drops lapsed ones every lease / 4)."""
    deadline = time.monotonic() + 3 * lease_s
    while client.status().reserved_ids and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.status().reserved_ids == 0


def test_one_request_cannot_allocate_past_max_request_ids(tight_tq, sockets):
    """A 60-byte ``reserve`` or ``prepare_put`` asking for 300000 ids is refused with the bound named; the
    index allocates nothing, keeps serving, and data put before reads back."""
    with TQClient(tight_tq.handle) as client:
        kept = client.put({"x": torch.arange(8).view(8, 1)}, partition="limits-a")
        before = client.status()
        sock = sockets()
        for header in ({"op": "reserve", "count": 300_000}, {"op": "prepare_put", "partition": "limits-a",
                                                            "ids": None, "count": 300_000}):
            reply = ask(sock, header)
            assert reply["ok"] is False and f"max_request_ids={REQ}" in reply["error"]
        col = {"name": "y", "dtype": "uint8", "shape": [], "nbytes": REQ + 1}
        for header in ({"op": "notify", "partition": "limits-a", "ids": list(range(REQ + 1)), "columns": [col]},
                       {"op": "get_meta", "partition": "limits-a", "fields": ["x"], "batch_size": REQ + 1,
                        "task": "t"}):
            assert f"max_request_ids={REQ}" in ask(sock, header)["error"]
        after = client.status()
        assert (after.produced, after.num_samples, after.reserved_ids) == (before.produced, before.num_samples,
                                                                          before.reserved_ids)
        assert ask(sock, {"op": "ping", "rid": 3}) == {"ok": True, "rid": 3}
        assert torch.equal(client.get_data(kept)["x"], torch.arange(8).view(8, 1))
        assert client.get_meta(["x"], 8, "t", "limits-a").sample_ids == kept.sample_ids
        client.clear("limits-a")


def test_a_storage_unit_refuses_a_put_naming_more_ids_than_max_request_ids(tight_tq, sockets):
    sock = sockets()
    sock.connect(tight_tq.handle.unit_addresses[0])
    sock.disconnect(tight_tq.handle.index_address)
    col = {"name": "z", "dtype": "uint8", "shape": [0], "nbytes": 0}
    reply = ask(sock, {"op": "put", "ids": list(range(0, 2 * (REQ + 1), 2)), "columns": [col]})
    assert reply["ok"] is False and f"max_request_ids={REQ}" in reply["error"]


def test_reserved_ids_are_bounded_per_client_and_in_all_then_lapse_when_clients_go_away(sockets):
    """Client A reserves up to its bound (8192) and is refused past it (the error names the bound); client
    B may reserve until the total bound (12288). Both go away: after the lease the index has dropped their
    reservations, a notify naming one of their ids is refused, and a new client reserves in full."""
    cfg = TransferQueueConfig(**TIGHT, max_client_reserved_ids=2 * REQ, max_reserved_ids=3 * REQ)
    with start_transferqueue(cfg) as servers, TQClient(servers.handle) as client:
        a, b = sockets(servers), sockets(servers)
        starts = [ask(a, {"op": "reserve", "count": REQ})["start"] for _ in range(2)]
        refused = ask(a, {"op": "reserve", "count": 1})
        assert refused["ok"] is False and f"max_client_reserved_ids={2 * REQ}" in refused["error"]
        assert ask(b, {"op": "reserve", "count": REQ})["ok"] is True
        refused = ask(b, {"op": "reserve", "count": 64})
        assert refused["ok"] is False and f"max_reserved_ids={3 * REQ}" in refused["error"]
        assert client.status().reserved_ids == 3 * REQ
        a.close()
        b.close()
        wait_for_lapse(client)
        c = sockets(servers)
        col = {"name": "x", "dtype": "int64", "shape": [], "nbytes": 8}
        late = ask(c, {"op": "notify", "partition": "limits-b", "ids": [starts[0]], "columns": [col], "new": True})
        assert late["ok"] is False and "reservation lapsed" in late["error"]
        assert all(ask(c, {"op": "reserve", "count": REQ})["ok"] for _ in range(2))


def test_a_client_keeps_putting_across_reservation_lapses(tight_tq):
    """A client reuses its reserved range while a put can finish before the range lapses, reserves anew
    when it could not, and never names a lapsed id: puts before, near and after the lease all succeed."""
    handle = dataclasses.replace(tight_tq.handle, request_timeout_s=0.5)
    with TQClient(handle) as client:
        reserves = lambda: client.status().requests.get("reserve", [0])[0]  # noqa: E731
        first = client.put({"x": torch.zeros(2, 1)}, partition="limits-c", timeout_s=0.5)
        n = reserves()
        second = client.put({"x": torch.ones(2, 1)}, partition="limits-c", timeout_s=0.5)
        assert second.sample_ids == [first.sample_ids[-1] + 1, first.sample_ids[-1] + 2] and reserves() == n
        time.sleep(2.2)  # the put (up to 1 s) could outlast the range's 3 s lease now
        third = client.put({"x": torch.ones(2, 1)}, partition="limits-c", timeout_s=0.5)
        assert reserves() == n + 1 and third.sample_ids[0] > second.sample_ids[-1] + 1
        wait_for_lapse(client)
        fourth = client.put({"x": torch.ones(2, 1)}, partition="limits-c", timeout_s=0.5)
        assert len(client.get_data(fourth)["x"]) == 2
        assert client.clear("limits-c") == 8


def test_long_polls_past_max_parked_are_refused_and_the_parked_ones_still_answered(tight_tq, sockets):
    waiting = [sockets(), sockets()]
    ask_meta = {"op": "get_meta", "partition": "limits-d", "fields": ["x"], "batch_size": 1, "task": "t",
                "timeout_s": 20.0}
    for i, s in enumerate(waiting):
        s.send(wire.pack(dict(ask_meta, rid=i)))
    time.sleep(0.3)
    refused = ask(sockets(), dict(ask_meta, rid=9))
    assert refused["ok"] is False and "max_parked=2" in refused["error"]
    with TQClient(tight_tq.handle) as client:
        client.put({"x": torch.zeros(1, 1)}, partition="limits-d")
        client.put({"x": torch.zeros(1, 1)}, partition="limits-d")
        got = [msgpack.unpackb(s.recv(), raw=False) if s.poll(10_000) else None for s in waiting]
        assert [len(g["meta"]["sample_ids"]) for g in got] == [1, 1]
        client.clear("limits-d")


def test_a_sampler_failing_while_its_request_waits_gets_an_error_reply_not_a_dead_index(tight_tq, sockets):
    """A custom sampler that raises when a parked request expires: the old loop let the exception out of
    ``tick`` and the index process died; now the request gets an error reply and the index keeps serving."""
    sock = sockets()
    reply = ask(sock, {"op": "get_meta", "partition": "limits-e", "fields": ["x"], "batch_size": 1, "task": "t",
                       "sampler": "fails_when_retried", "timeout_s": 0.3, "rid": 1})
    with TQClient(tight_tq.handle) as client:
        client.put({"x": torch.zeros(1, 1)}, partition="limits-e")  # the partition exists: samplers run
    reply = ask(sock, {"op": "get_meta", "partition": "limits-e", "fields": ["x"], "batch_size": 2, "task": "t",
                       "sampler": "fails_when_retried", "timeout_s": 0.3, "rid": 2})
    assert reply is not None and reply["ok"] is False and "failing on purpose" in reply["error"]
    assert ask(sock, {"op": "ping", "rid": 3}) == {"ok": True, "rid": 3}
    assert tight_tq.alive()


def test_long_names_are_refused_by_the_index_and_the_units(tight_tq, sockets):
    """A partition, task or field name of 2000 characters is refused with the bound named (a name is kept
    for as long as its partition, task or field lives)."""
    long = "n" * 2000
    col = {"name": "x", "dtype": "uint8", "shape": [], "nbytes": 1}
    sock = sockets()
    for header in ({"op": "prepare_put", "partition": long, "ids": None, "count": 1},
                   {"op": "notify", "partition": "limits-f", "ids": [0], "columns": [dict(col, name=long)]},
                   {"op": "get_meta", "partition": "limits-f", "fields": ["x"], "batch_size": 1, "task": long}):
        reply = ask(sock, header)
        assert reply["ok"] is False and "max_name_chars=1024" in reply["error"], header["op"]
    unit = sockets()
    unit.connect(tight_tq.handle.unit_addresses[0])
    unit.disconnect(tight_tq.handle.index_address)
    unit.send_multipart([wire.pack({"op": "put", "ids": [0], "columns": [dict(col, name=long)]}), b"\0"])
    assert unit.poll(10_000)
    reply = msgpack.unpackb(unit.recv(), raw=False)
    assert reply["ok"] is False and "max_name_chars=1024" in reply["error"]


def test_a_notify_cannot_rewrite_a_field_or_merge_tags_without_adding_one(tight_tq, sockets):
    """Fields are write-once in ``notify`` too (not only in ``prepare_put``, which a client may skip): a
    notify naming a field the samples have, or no field at all, is refused, so repeating one cannot grow
    a sample's tags without bound; the samples keep their tags."""
    with TQClient(tight_tq.handle) as client:
        meta = client.put({"x": torch.zeros(2, 1)}, partition="limits-g", tags=[{"uid": "a"}, {"uid": "a"}])
        sock = sockets()
        col = {"name": "x", "dtype": "float32", "shape": [1], "nbytes": 8}
        tags = [{"uid": "a", "pad": "p" * 1000}] * 2
        for cols, why in (([col], "write-once"), ([], "non-empty")):
            reply = ask(sock, {"op": "notify", "partition": "limits-g", "ids": meta.sample_ids, "columns": cols,
                               "tags": tags})
            assert reply["ok"] is False and why in reply["error"]
        assert [s["tags"] for s in client.sample_info("limits-g")] == [{"uid": "a"}, {"uid": "a"}]
        client.clear("limits-g")


# ------------------------------------------------------------------------------- the index's memory

BOUND = 3 * REQ  # max_samples of ``bounded_tq``


@pytest.fixture(scope="module")
def bounded_tq():
    """One unit; an index that holds at most ``BOUND`` samples and 2 uncleared partitions per client."""
    servers = start_transferqueue(TransferQueueConfig(**TIGHT, max_samples=BOUND, max_client_partitions=2))
    yield servers
    servers.shutdown()


def prepare_put(partition: str, count: int = REQ) -> dict:
    return {"op": "prepare_put", "partition": partition, "ids": None, "count": count}


def test_prepare_puts_from_fresh_sockets_cannot_grow_the_index_past_max_samples(bounded_tq, sockets):
    """The pattern that grew an index from 294 to 1,209 MB in 28 s (issue 44): ``prepare_put``s without ids,
    each allocating a full request's ids, into new partitions, each from a fresh socket (so no per-client
    bound applies). Past ``max_samples`` each gets a typed error reply (``limit`` names the key, the message
    its value) and creates nothing; the index keeps serving and keeps what it had; a client's put into the
    full index raises ``LimitExceeded`` and leaves nothing behind; clearing gives the room back."""
    with TQClient(bounded_tq.handle) as client:
        kept = client.put({"x": torch.arange(8).view(8, 1)}, partition="kept")
        replies = [ask(sockets(bounded_tq), dict(prepare_put(f"grow-{i}"), rid=i)) for i in range(12)]
        assert [r["ok"] for r in replies] == [True, True] + [False] * 10  # 8 + 2 * 4096 held; 4096 more won't fit
        for r in replies[2:]:
            assert r["limit"] == "max_samples" and f"max_samples={BOUND}" in r["error"]
            assert r["error"].startswith("LimitExceeded: prepare_put: the index holds 8200 samples")
        status = client.status()
        assert status.num_samples == 8 + 2 * REQ and set(status.partitions) == {"kept", "grow-0", "grow-1"}
        with pytest.raises(LimitExceeded, match=f"max_samples={BOUND}") as refused:
            client.put({"y": torch.zeros(REQ, 2)}, partition="kept")
        assert refused.value.key == "max_samples"
        assert client.status().num_samples == 8 + 2 * REQ
        assert client.unit_stats(0)["fields"] == 1  # the refused put's "y" was undone on the unit
        assert torch.equal(client.get_data(kept)["x"], torch.arange(8).view(8, 1))
        client.clear("grow-0")
        assert ask(sockets(bounded_tq), prepare_put("grow-again"))["ok"] is True
        for name in ("kept", "grow-1", "grow-again"):
            client.clear(name)
        assert client.status().num_samples == 0


def test_partitions_per_client_are_bounded_and_given_back_by_clear(bounded_tq, sockets):
    """One client connection may hold ``max_client_partitions`` partitions it created: the next one it
    creates is refused (typed, nothing created) while its partitions take more samples and another client
    creates its own; clearing one of them gives the slot back."""
    a, b = sockets(bounded_tq), sockets(bounded_tq)
    assert ask(a, prepare_put("a0", 1))["ok"] and ask(a, prepare_put("a1", 1))["ok"]
    refused = ask(a, prepare_put("a2", 1))
    assert refused["ok"] is False and refused["limit"] == "max_client_partitions"
    assert "created 2 partitions not cleared yet" in refused["error"] and "max_client_partitions=2" in refused["error"]
    assert ask(a, prepare_put("a0", 1))["ok"] and ask(b, prepare_put("b0", 1))["ok"]
    assert ask(b, {"op": "sample_info", "partition": "a2"})["ok"] is False  # the refused one was never made
    assert ask(a, {"op": "clear", "partition": "a1"})["ok"]
    assert ask(a, prepare_put("a2", 1))["ok"]
    for name in ("a0", "a2", "b0"):
        assert ask(b, {"op": "clear", "partition": name})["ok"]


def test_a_notify_past_max_samples_changes_nothing_and_its_reserved_ids_stay_usable():
    ix = MetadataIndex(TransferQueueConfig(max_request_ids=REQ, max_samples=REQ))
    ix.prepare_put("p", None, REQ - 2, [])
    start = ix.reserve(4, b"A")
    col = {"name": "x", "dtype": "uint8", "shape": [1], "nbytes": 4}
    with pytest.raises(LimitExceeded, match=f"notify: the index holds {REQ - 2} samples; 4 more") as refused:
        ix.notify("q", list(range(start, start + 4)), [col], [{"uid": 0}] * 4, new=True)
    assert refused.value.key == "max_samples" and isinstance(refused.value, ValueError)
    assert (ix.num_samples, set(ix.partitions), ix.reservations.total) == (REQ - 2, {"p"}, 64)
    ix.clear("p", list(range(2)))
    ix.notify("q", list(range(start, start + 4)), [col], [{"uid": 0}] * 4, new=True)
    assert ix.num_samples == REQ and ix.partitions_by_owner == {b"": 2}


def test_max_samples_is_sized_from_the_job_with_headroom_unless_set():
    """0 (the default): a TransferQueue alone holds ``DEFAULT_MAX_SAMPLES``; a job sizes it to
    ``SAMPLES_HEADROOM`` x what its admission can hold, at least one full request; a bound the user set is
    kept, and refused at start when the job could not fit in it."""
    cfg = TransferQueueConfig()
    assert cfg.max_samples == 0 and cfg.sample_bound == DEFAULT_MAX_SAMPLES
    assert cfg.sized_for(100_000).max_samples == SAMPLES_HEADROOM * 100_000
    assert cfg.sized_for(10).max_samples == cfg.max_request_ids
    assert cfg.sized_for(10).limits()["max_samples"] == cfg.max_request_ids  # what the index process is given
    explicit = TransferQueueConfig(max_samples=1 << 18)
    assert explicit.sized_for(1000) is explicit
    with pytest.raises(ValueError, match="transferqueue.max_samples=262144 is below the 300000 samples"):
        explicit.sized_for(300_000)


# ---------------------------------------------------------------------------------- in-process bounds


def test_partitions_are_bounded():
    ix = MetadataIndex(TransferQueueConfig(max_partitions=2))
    ix.prepare_put("a", None, 1, [])
    ix.prepare_put("b", None, 1, [])
    with pytest.raises(ValueError, match="max_partitions=2"):
        ix.prepare_put("c", None, 1, [])
    ix.clear("a")
    ix.prepare_put("c", None, 1, [])  # a cleared partition makes room


def test_a_storage_unit_forgets_a_field_once_nothing_of_it_is_stored():
    """Every put may bring new field names: a unit drops a field's table when its last rows are cleared."""
    unit = StorageUnit("tcp://127.0.0.1:0", 1 << 20)
    try:
        for i in range(3):
            col = {"name": f"f{i}", "dtype": "uint8", "shape": [4], "nbytes": 8}
            unit.handle(b"A", {"op": "put", "ids": [2 * i, 2 * i + 1], "columns": [col]}, [zmq.Frame(bytes(8))])
            unit.handle(b"A", {"op": "clear", "ids": [2 * i, 2 * i + 1]}, [])
        assert unit.tables == {} and unit.stored_bytes == 0
    finally:
        unit.close()


def _col(name: str, n: int) -> dict:
    return {"name": name, "dtype": "int64", "shape": [], "nbytes": 8 * n, "count": n, "split": False}


def test_fields_per_partition_and_tasks_are_bounded_and_a_refused_notify_changes_nothing():
    ix = MetadataIndex(TransferQueueConfig(max_fields=3, max_tasks=2))
    start = ix.reserve(4)
    ix.notify("p", [start, start + 1], [_col("a", 2), _col("b", 2)], None, new=True)
    with pytest.raises(ValueError, match="max_fields=3"):
        ix.notify("p", [start + 2, start + 3], [_col("c", 2), _col("d", 2)], None, new=True)
    assert ix.reservations.used[start] == bytearray([1, 1, 0, 0]) and sorted(ix.partitions["p"].bits) == ["a", "b"]
    ix.notify("p", [start + 2, start + 3], [_col("a", 2), _col("c", 2)], None, new=True)  # 3 fields: fine
    ix.get_meta(["a"], 1, "t1", "p")
    ix.get_meta(["a"], 1, "t2", "p")
    with pytest.raises(ValueError, match="max_tasks=2"):
        ix.get_meta(["a"], 1, "t3", "p")
    assert ix.get_meta(["a"], 1, "t1", "p").sample_ids == [start + 1]  # known tasks still served


def test_subscriptions_are_a_bounded_cache_that_evicts_the_least_recently_used():
    """Past ``max_subscriptions`` a new (task, field set) evicts the least recently used view; an evicted
    view is rebuilt on its next get_meta with the same answer (consumption lives in the samples)."""
    ix = MetadataIndex(TransferQueueConfig(max_subscriptions=2))
    start = ix.reserve(6)
    ix.notify("p", list(range(start, start + 6)), [_col("a", 6), _col("b", 6), _col("c", 6)], None, new=True)
    assert ix.get_meta(["a"], 2, "t", "p").sample_ids == [start, start + 1]
    ix.get_meta(["b"], 1, "u", "p")
    ix.get_meta(["a"], 1, "u", "p")  # (t, a) is now the least recently used
    ix.get_meta(["c"], 1, "v", "p")
    part = ix.partitions["p"]
    assert len(part.subs) == 2 and (ix.task_bits["t"], part.bits["a"]) not in part.subs
    assert ix.get_meta(["a"], 2, "t", "p").sample_ids == [start + 2, start + 3]


@pytest.mark.parametrize("key,value", [("max_request_ids", 100), ("max_request_ids", 0), ("max_fields", -1),
                                       ("max_client_reserved_ids", 5000), ("max_reserved_ids", 1 << 19),
                                       ("reservation_lease_s", 0), ("max_parked", 1.5), ("max_tasks", True),
                                       ("max_samples", -1), ("max_samples", 100), ("max_client_partitions", 0)])
def test_bounds_are_validated(key, value):
    with pytest.raises(ValueError, match=f"transferqueue.{key}"):
        TransferQueueConfig(**{key: value})


def test_zero_byte_rows_count_their_bookkeeping_against_the_units_capacity():
    """Rows of zero bytes take no buffer but do take chunks: puts of them are answered ``full`` once their
    bookkeeping would pass ``capacity_bytes`` (before, they grew a unit's memory without bound), and
    clearing them gives the room back."""
    from transferqueue.records import Full
    from transferqueue.storage import CHUNK_COST

    unit = StorageUnit("tcp://127.0.0.1:0", 64 * CHUNK_COST)
    scattered = list(range(0, 64, 2))  # 32 runs: one chunk each
    col = {"name": "f0", "dtype": "uint8", "shape": [0], "nbytes": 0}
    try:
        unit.handle(b"A", {"op": "put", "ids": scattered, "columns": [col]}, [zmq.Frame(b"")])
        unit.handle(b"A", {"op": "put", "ids": scattered, "columns": [dict(col, name="f1")]}, [zmq.Frame(b"")])
        with pytest.raises(Full, match="bookkeeping"):
            unit.handle(b"A", {"op": "put", "ids": scattered, "columns": [dict(col, name="f2")]}, [zmq.Frame(b"")])
        assert unit.meta_bytes == 64 * CHUNK_COST and unit.used_bytes == 0
        unit.handle(b"A", {"op": "clear", "ids": scattered, "fields": ["f0"]}, [])
        unit.handle(b"A", {"op": "put", "ids": scattered, "columns": [dict(col, name="f2")]}, [zmq.Frame(b"")])
        unit.handle(b"A", {"op": "clear", "ids": scattered}, [])
        assert unit.meta_bytes == 0 and unit.tables == {}
    finally:
        unit.close()


def test_seqlen_balanced_work_is_bound_by_the_batch_not_by_num_ranks():
    """``num_ranks`` past the batch size (here 2**40) gives the order it gives at the batch size, at once
    (it used to build lists of ``num_ranks`` entries inside the index)."""
    ix = MetadataIndex()
    start = ix.reserve(4)
    ids = list(range(start, start + 4))
    ix.notify("p", ids, [{"name": "x", "dtype": "int64", "shapes": [[5], [1], [7], [2]], "nbytes": 120,
                          "count": 4, "split": False}], None, new=True)
    view = ix.subscription(ix.partitions["p"], "t", ["x"])
    from transferqueue.samplers import SAMPLERS

    sampler = SAMPLERS.get("seqlen_balanced")
    assert sampler.select(view, 4, {"num_ranks": 2**40}) == sampler.select(view, 4, {"num_ranks": 4})


def test_p2p_links_per_unit_are_bounded():
    from transferqueue.p2p import UnitP2P

    p2p = UnitP2P("gloo", "cpu", "127.0.0.1", 5.0, max_links=1)
    try:
        p2p.links["held"] = None  # one link held already
        header = {"link": "next", "backend": "gloo", "node": "elsewhere"}
        with pytest.raises(ValueError, match="max_p2p_links=1"):
            p2p.connect(header, "here")
        with pytest.raises(ValueError, match="max_name_chars=1024"):
            p2p.connect(dict(header, link="l" * 2000), "here")
    finally:
        p2p.links.clear()
        p2p.close()


# ------------------------------------------- refused requests leave no partition; the sample bound's floor


def _refused_notifies(ix: MetadataIndex, owner: bytes) -> list[tuple[str, dict]]:
    """Notifies of new samples into partitions that do not exist yet, each refused by a different check
    that runs after the partition's bounds: (what the error says, notify's keyword arguments)."""
    start = ix.reserve(4, owner)
    col = {"name": "x", "dtype": "uint8", "shape": [1], "nbytes": 2}
    answered = Consume("elsewhere", [], "answered")  # a task no request has named yet
    return [
        ("was not reserved", dict(sample_ids=[10**6, 10**6 + 1], columns=[col], tags=None)),
        ("1 tag dicts for 2 samples", dict(sample_ids=[start, start + 1], columns=[col], tags=[{"uid": 0}])),
        ("uid is a str or int", dict(sample_ids=[start, start + 1], columns=[col], tags=[{"uid": 1.5}] * 2)),
        ("max_fields=2", dict(sample_ids=[start, start + 1], tags=None,
                              columns=[dict(col, name=f"f{i}") for i in range(3)])),
        ("was not reserved", dict(sample_ids=[10**6], columns=[dict(col, nbytes=1)], tags=None, consume=answered)),
    ]


def test_a_refused_new_sample_notify_creates_no_partition_and_takes_none_of_the_clients_quota():
    """Each refused notify of new samples into new partitions (unreserved ids, a tag count, a uid type, too
    many fields, with a ``consume`` naming a new task) leaves the index as it was: no partition, no slot of
    the client's ``max_client_partitions``, no task. The client then creates its full quota of partitions
    (it was refused ``max_client_partitions`` after two refused notifies) and the reserved ids stay usable."""
    ix = MetadataIndex(TransferQueueConfig(max_client_partitions=2, max_fields=2))
    refusals = _refused_notifies(ix, b"A")
    reserved = (dict(ix.reservations.by_owner), ix.reservations.total)
    for i, (why, kwargs) in enumerate(refusals):
        with pytest.raises(ValueError, match=why):
            ix.notify(f"q{i}", new=True, owner=b"A", **kwargs)
    assert (ix.partitions, ix.partitions_by_owner, ix.task_bits, ix.num_samples) == ({}, {}, {}, 0)
    assert (dict(ix.reservations.by_owner), ix.reservations.total) == reserved
    start = min(ix.reservations.used)
    col = {"name": "x", "dtype": "uint8", "shape": [1], "nbytes": 4}
    ix.notify("q0", list(range(start, start + 4)), [col], None, new=True, owner=b"A")
    assert ix.prepare_put("p", None, 1, [], owner=b"A") == [start + 4]
    assert ix.partitions_by_owner == {b"A": 2} and ix.num_samples == 5
    with pytest.raises(LimitExceeded, match="max_client_partitions=2"):
        ix.prepare_put("p2", None, 1, [], owner=b"A")


def test_a_refused_prepare_put_creates_no_partition():
    ix = MetadataIndex(TransferQueueConfig(max_request_ids=REQ, max_samples=REQ, max_client_partitions=1))
    ix.prepare_put("p", None, REQ - 1, [], owner=b"B")
    for count, why in ((2, "max_samples"), (-1, "non-negative"), (REQ + 1, "max_request_ids")):
        with pytest.raises(ValueError, match=why):
            ix.prepare_put("q", None, count, [], owner=b"A")
    assert set(ix.partitions) == {"p"} and ix.partitions_by_owner == {b"B": 1}
    assert ix.prepare_put("q", None, 1, [], owner=b"A") == [REQ - 1]


def test_a_standalone_index_holds_one_full_request_and_names_its_default_bound(monkeypatch):
    """``max_samples`` 0 outside a job: the bound is ``DEFAULT_MAX_SAMPLES`` or ``max_request_ids`` if that is
    larger (a prepare_put of 2**21 ids into an empty index with max_request_ids=2**21 was refused), and a
    refusal says the bound is that default (it said ``max_samples=1048576`` while the key was 0)."""
    big = TransferQueueConfig(max_request_ids=1 << 21, max_client_reserved_ids=1 << 22)
    assert big.sample_bound == 1 << 21 and MetadataIndex(big).max_samples == 1 << 21
    assert TransferQueueConfig().sample_bound == DEFAULT_MAX_SAMPLES
    # The same at a size a test can fill: a default of 2 * REQ samples, requests of up to 4 * REQ ids.
    monkeypatch.setattr("transferqueue.config.DEFAULT_MAX_SAMPLES", 2 * REQ)
    ix = MetadataIndex(TransferQueueConfig(max_request_ids=4 * REQ))
    assert ix.prepare_put("p", None, 4 * REQ, []) == list(range(4 * REQ))
    with pytest.raises(LimitExceeded, match=f"the index holds {4 * REQ} samples; 1 more") as refused:
        ix.prepare_put("p", None, 1, [])
    message = str(refused.value)
    assert refused.value.key == "max_samples" and f"max_samples={4 * REQ}" not in message
    assert "transferqueue.max_samples=0" in message and f"max({2 * REQ}, max_request_ids={4 * REQ})" in message
    explicit = MetadataIndex(TransferQueueConfig(max_request_ids=REQ, max_samples=REQ))
    explicit.prepare_put("p", None, REQ, [])
    with pytest.raises(LimitExceeded, match=f"1 more would pass transferqueue.max_samples={REQ} "):
        explicit.prepare_put("p", None, 1, [])


def test_the_max_samples_key_doc_names_the_request_floor_and_the_standalone_default():
    from common.settings import doc_of
    from controller.config_docs import config_fields

    doc = doc_of(config_fields()["transferqueue.max_samples"])
    assert "max_request_ids" in doc and f"2^{DEFAULT_MAX_SAMPLES.bit_length() - 1}" in doc and len(doc) <= 110


def test_the_benchmark_index_holds_every_sample_the_meta_bench_puts():
    """``--meta-samples`` past the standalone default (2^20) was refused mid-bench; 1000 still gives a valid
    config (an explicit max_samples is at least max_request_ids)."""
    from bench.transferqueue_bench import meta_config

    assert meta_config(3_000_000).sample_bound == 3_000_000
    assert meta_config(1000).sample_bound == meta_config(1000).max_request_ids
