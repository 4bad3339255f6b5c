"""The metadata index and samplers, in-process (the socket layer is tested in test_client.py)."""

from __future__ import annotations

import pytest

from transferqueue.index import MetadataIndex
from transferqueue.records import BatchMeta, Consume, chunk_sizes
from transferqueue.samplers import balanced_order, register_sampler


def col(name: str, n: int, shape=(2,), dtype="int64") -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": n * 8 * 2, "count": n, "split": False}


def put(ix: MetadataIndex, part: str, ids, fields=("input_ids",), tags=None):
    for f in fields:
        ix.notify(part, list(ids), [col(f, len(ids))], tags)


def make_groups(ix: MetadataIndex, part="p", n=4, uids=("A", "B", "C")) -> dict[str, list[int]]:
    """Allocate n samples per uid with arrival interleaved A0,B0,C0,A1,...; prompt fields ready for all."""
    ids = ix.prepare_put(part, None, n * len(uids), ["input_ids"])
    tags = [{"uid": uids[i % len(uids)]} for i in range(len(ids))]
    put(ix, part, ids, tags=tags)
    return {u: [i for i, t in zip(ids, tags, strict=True) if t["uid"] == u] for u in uids}


def test_group_complete_hands_out_only_whole_groups_in_group_order():
    ix = MetadataIndex()
    groups = make_groups(ix)
    # responses arrive interleaved: all of A and C, 2 of B
    order = [x for trio in zip(groups["A"], groups["B"][:2] + [None, None], groups["C"], strict=True) for x in trio]
    for sid in order:
        if sid is not None:
            put(ix, "p", [sid], fields=("responses",))
    fields = ["input_ids", "responses"]
    meta = ix.get_meta(fields, 8, "train", "p", "group_complete", {"group_size": 4})
    assert meta.sample_ids == groups["A"] + groups["C"]
    assert [t["uid"] for t in meta.tags] == ["A"] * 4 + ["C"] * 4
    # nothing complete is left: empty with a clear reason, never an error; consumed groups not re-served
    again = ix.get_meta(fields, 4, "train", "p", "group_complete")
    assert again.sample_ids == [] and "insufficient complete groups" in again.reason
    put(ix, "p", groups["B"][2:], fields=("responses",))
    assert ix.get_meta(fields, 4, "train", "p", "group_complete").sample_ids == groups["B"]


def test_group_complete_waits_with_only_one_group():
    ix = MetadataIndex()
    groups = make_groups(ix)
    put(ix, "p", groups["A"], fields=("responses",))
    meta = ix.get_meta(["input_ids", "responses"], 8, "train", "p", "group_complete")
    assert len(meta) == 0 and "insufficient complete groups: 4 samples" in meta.reason
    with pytest.raises(ValueError, match="group_size"):
        ix.get_meta(["input_ids", "responses"], 6, "train", "p", "group_complete", {"group_size": 4})


def test_consumption_is_per_task_and_resettable():
    ix = MetadataIndex()
    ids = ix.prepare_put("p", None, 6, ["x"])
    put(ix, "p", ids, fields=("x",))
    first = ix.get_meta(["x"], 4, "rollout", "p")
    assert first.sample_ids == ids[:4]
    assert ix.get_meta(["x"], 2, "rollout", "p").sample_ids == ids[4:]
    assert ix.get_meta(["x"], 1, "rollout", "p").reason.startswith("insufficient ready samples")
    assert ix.get_meta(["x"], 6, "train", "p").sample_ids == ids  # another task still sees them
    ix.reset_consumption("p", "rollout")
    ix.reset_consumption("p", "rollout")  # idempotent
    assert ix.get_meta(["x"], 6, "rollout", "p").sample_ids == ids
    assert ix.consumed == {"rollout": 12, "train": 6}


def test_unconsume_gives_samples_back_to_that_task_only():
    ix = MetadataIndex()
    ids = ix.prepare_put("p", None, 4, ["x"])
    put(ix, "p", ids, fields=("x",))
    assert ix.get_meta(["x"], 4, "rollout", "p").sample_ids == ids
    assert ix.get_meta(["x"], 4, "train", "p").sample_ids == ids
    ix.unconsume("p", "rollout", [ids[1], ids[3], 999])  # an undelivered reply's samples; unknown ids skipped
    ix.unconsume("p", "rollout", [ids[1]])  # not consumed any more: nothing changes
    assert ix.get_meta(["x"], 2, "rollout", "p").sample_ids == [ids[1], ids[3]]
    assert ix.get_meta(["x"], 1, "train", "p").reason.startswith("insufficient ready samples")
    assert ix.consumed == {"rollout": 4, "train": 4}


def test_clear_is_idempotent_and_cleared_ids_are_never_served_again():
    ix = MetadataIndex()
    a = ix.prepare_put("a", None, 4, ["x"])
    put(ix, "a", a, fields=("x",))
    assert ix.clear("a", a[:2]) == a[:2]
    assert ix.clear("a", a[:2]) == []
    assert ix.get_meta(["x"], 2, "t", "a").sample_ids == a[2:]
    ix.reset_consumption("a", "t")
    assert ix.get_meta(["x"], 3, "t", "a").sample_ids == []
    assert ix.clear("a") == a[2:] and ix.clear("a") == []
    b = ix.prepare_put("a", None, 4, ["x"])  # same partition name again: fresh ids
    assert set(b).isdisjoint(a)
    with pytest.raises(ValueError, match="cleared"):
        ix.prepare_put("a", a[:1], 1, ["y"])
    with pytest.raises(ValueError, match="unknown or cleared"):
        ix.notify("a", a[:1], [col("y", 1)], None)


def test_fields_are_write_once_and_dtype_stable():
    ix = MetadataIndex()
    ids = ix.prepare_put("p", None, 2, ["x"])
    put(ix, "p", ids, fields=("x",))
    with pytest.raises(ValueError, match="already written"):
        ix.prepare_put("p", ids, 2, ["x"])
    ids2 = ix.prepare_put("p", None, 2, ["x"])
    with pytest.raises(ValueError, match="dtype"):
        ix.notify("p", ids2, [col("x", 2, dtype="float32") | {"nbytes": 16}], None)


def test_fixed_shape_field_becomes_variable():
    ix = MetadataIndex()
    ids = ix.prepare_put("p", None, 2, ["x"])
    ix.notify("p", ids, [col("x", 2, shape=(2,))], None)
    assert ix.partitions["p"].schemas["x"].shape == [2]
    more = ix.prepare_put("p", None, 2, ["x"])
    ix.notify("p", more, [{"name": "x", "dtype": "int64", "shapes": [[3], [1]], "nbytes": 32, "count": 2}], None)
    assert ix.partitions["p"].schemas["x"].variable
    sub = ix.subscription(ix.partitions["p"], "t", ["x"])
    assert [sub.length(i) for i in ids + more] == [2, 2, 3, 1]  # token counts for seqlen balancing


def test_reserved_ids_are_created_once_at_notify():
    ix = MetadataIndex()
    start = ix.reserve(4)
    ids = [start, start + 1]
    ix.notify("p", ids, [col("x", 2)], [{"uid": "a"}, {"uid": "a"}], new=True)
    assert ix.partitions["p"].schemas["x"].shape == [2] and ix.produced == 2
    with pytest.raises(ValueError, match="already used"):
        ix.notify("p", ids, [col("y", 2)], None, new=True)
    with pytest.raises(ValueError, match="not reserved"):
        ix.notify("p", [start + 10], [col("x", 1)], None, new=True)
    ix.clear("p", ids)
    with pytest.raises(ValueError, match="already used or cleared"):
        ix.notify("q", ids[:1], [col("x", 1)], None, new=True)
    ix.notify("q", [start + 2, start + 3], [col("x", 2)], None, new=True)  # the rest of the range
    assert ix.reservations.used == {}


def test_seqlen_balanced_partitions_equal_counts_and_near_equal_tokens():
    lengths = [100, 1, 50, 50, 2, 99, 3, 97]
    order = balanced_order(lengths, 4)
    assert sorted(order) == list(range(8))
    chunks = [order[i:i + 2] for i in range(0, 8, 2)]
    sums = [sum(lengths[p] for p in c) for c in chunks]
    assert max(sums) - min(sums) <= 5, sums

    ix = MetadataIndex()
    ids = ix.prepare_put("p", None, 8, ["responses"])
    ix.notify("p", ids, [{"name": "responses", "dtype": "int8", "shapes": [[n] for n in lengths],
                          "nbytes": sum(lengths), "count": 8}], None)
    meta = ix.get_meta(["responses"], 8, "train", "p", "seqlen_balanced", {"num_ranks": 4})
    per_rank = [sum(lengths[ids.index(i)] for i in m.sample_ids) for m in meta.chunk(4)]
    assert max(per_rank) - min(per_rank) <= 5 and [len(m) for m in meta.chunk(4)] == [2, 2, 2, 2]


def test_custom_sampler_plugs_in():
    class Newest:
        def select(self, view, batch_size, options):
            ids = list(view.ready_ids())
            return ids[-batch_size:] if len(ids) >= batch_size else "not enough"

    register_sampler("test-newest", Newest())
    with pytest.raises(ValueError, match="already registered"):
        register_sampler("test-newest", Newest())
    ix = MetadataIndex()
    ids = ix.prepare_put("p", None, 5, ["x"])
    put(ix, "p", ids, fields=("x",))
    assert ix.get_meta(["x"], 2, "t", "p", "test-newest").sample_ids == ids[-2:]
    with pytest.raises(ValueError, match="unknown sampler"):
        ix.get_meta(["x"], 2, "t", "p", "nope")


def test_chunking_three_samples_for_four_workers():
    assert chunk_sizes(3, 4) == [1, 1, 1, 0]
    meta = BatchMeta("p", [7, 8, 9], ["x"], [{"uid": "a"}, {"uid": "b"}, {"uid": "c"}])
    parts = meta.chunk(4)
    assert [len(p) for p in parts] == [1, 1, 1, 0]
    joined = BatchMeta.concat(parts)
    assert joined.sample_ids == [7, 8, 9] and joined.tags == meta.tags


def test_claim_of_a_contiguous_run_across_two_reserved_ranges():
    ix = MetadataIndex()
    a, b = ix.reserve(4), ix.reserve(4)
    assert b == a + 4
    ix.notify("p", list(range(a + 2, a + 6)), [col("x", 4)], None, new=True)  # 2 ids of each range
    ix.notify("p", [a, a + 1, b + 2, b + 3], [col("x", 4)], None, new=True)  # the rest, not contiguous
    assert ix.reservations.used == {} and ix.reservations.starts == [] and ix.produced == 8
    assert sorted(ix.partitions["p"].samples) == list(range(a, a + 8))


def test_claim_of_a_run_with_a_used_or_unreserved_id_marks_nothing():
    ix = MetadataIndex()
    start = ix.reserve(8)
    ix.notify("p", [start + 3], [col("x", 1)], None, new=True)
    with pytest.raises(ValueError, match=f"sample id {start + 3} was not reserved, or was already used"):
        ix.notify("p", list(range(start + 1, start + 5)), [col("x", 4)], None, new=True)
    with pytest.raises(ValueError, match=f"sample id {start + 8} was not reserved"):
        ix.notify("p", list(range(start + 4, start + 9)), [col("x", 5)], None, new=True)
    with pytest.raises(ValueError, match="duplicates"):
        ix.notify("p", [start, start], [col("x", 2)], None, new=True)
    assert ix.reservations.used[start] == bytearray([0, 0, 0, 1, 0, 0, 0, 0]) and ix.produced == 1
    assert list(ix.partitions["p"].samples) == [start + 3] and ix.bytes_stored == col("x", 1)["nbytes"]
    ix.notify("p", [start + 1, start + 2], [col("x", 2)], None, new=True)  # the ids themselves are intact
    ix.notify("p", list(range(start + 4, start + 8)) + [start], [col("x", 5)], None, new=True)
    assert ix.reservations.used == {} and ix.produced == 8


def test_new_samples_get_their_own_tags_and_bytes():
    ix = MetadataIndex()
    start = ix.reserve(3)
    ids = [start, start + 1, start + 2]
    var = {"name": "r", "dtype": "int8", "shapes": [[5], [1], [2]], "nbytes": 8, "count": 3}
    ix.notify("p", ids, [col("x", 3), var], [{"w": 1, "uid": "a"}, {}, {"w": 2}], new=True)
    ix.notify("p", ids[1:], [col("y", 2)], [{"uid": "b"}, {"uid": "b", "k": 0}])
    samples = ix.partitions["p"].samples
    assert [list(samples[i].tags.items()) for i in ids] == [[("uid", "a"), ("w", 1)], [("uid", "b")],
                                                           [("w", 2), ("uid", "b"), ("k", 0)]]
    assert [samples[i].nbytes for i in ids] == [16 + 5, 16 + 1 + 16, 16 + 2 + 16]
    assert [samples[i].lengths for i in ids] == [{"r": 5}, {"r": 1}, {"r": 2}]
    assert ix.bytes_stored == sum(s.nbytes for s in samples.values()) and ix.partitions["p"].uid_counts == {"a": 1,
                                                                                                          "b": 2}
    with pytest.raises(ValueError, match="uid must be a str or int, got NoneType"):
        ix.notify("p", ids[:1], [col("z", 1)], [{"uid": None}])
    assert samples[ids[0]].tags["uid"] == "a" and "z" not in ix.partitions["p"].bits


def test_clear_with_repeated_ids_removes_each_once():
    ix = MetadataIndex()
    ids = ix.prepare_put("p", None, 3, ["x"])
    put(ix, "p", ids, fields=("x",))
    assert ix.clear("p", [ids[0], ids[0], ids[2]]) == [ids[0], ids[2]]
    assert ix.cleared == 2 and ix.bytes_stored == col("x", 1)["nbytes"]


def _check_bookkeeping(ix: MetadataIndex) -> None:
    """Incremental state equals state rebuilt from the samples: bytes, uid counts, every subscription."""
    from collections import Counter

    from transferqueue.index import Subscription

    assert ix.bytes_stored == sum(s.nbytes for p in ix.partitions.values() for s in p.samples.values())
    for part in ix.partitions.values():
        uids = Counter(s.tags["uid"] for s in part.samples.values() if "uid" in s.tags)
        assert part.uid_counts == dict(uids)
        for (bit, mask), sub in part.subs.items():
            fresh = Subscription(part, bit, mask, sub.field_names)
            fresh.add_many(part.samples.values())
            assert set(sub.ready) == set(fresh.ready)
            assert {k: set(v) for k, v in sub.groups.items()} == {k: set(v) for k, v in fresh.groups.items()}
            assert set(sub.complete) == set(fresh.complete) and sub.complete_samples == fresh.complete_samples


def test_random_puts_gets_and_clears_keep_subscriptions_consistent():
    import random

    rng = random.Random(0)
    ix = MetadataIndex()
    free: list[int] = []
    for _ in range(400):
        op = rng.random()
        live = [i for p in ix.partitions.values() for i in p.samples]
        if op < 0.1 or len(free) < 6:
            start = ix.reserve(rng.randint(1, 10))
            free += range(start, ix.next_id)
        elif op < 0.45:
            n = rng.randint(1, 6)
            ids = free[:n] if rng.random() < 0.7 else rng.sample(free, n)
            tags = None if rng.random() < 0.3 else [{"uid": rng.choice("abcd")} for _ in ids]
            ix.notify("p", ids, [col(rng.choice("xy"), n)], tags, new=True)
            free = [i for i in free if i not in ids]
        elif op < 0.6 and live:
            ids = rng.sample(live, rng.randint(1, min(4, len(live))))
            field = rng.choice("xyz")
            try:
                ix.notify("p", ids, [col(field, len(ids))], [{"uid": rng.choice("abcde")} for _ in ids])
            except ValueError as exc:
                assert "already" in str(exc) or "write-once" in str(exc) or "cleared" in str(exc)
        elif op < 0.8:
            fields = rng.sample(["x", "y", "z"], rng.randint(1, 2))
            ix.get_meta(fields, rng.randint(1, 3), rng.choice(["t1", "t2"]), "p",
                        rng.choice(["sequential", "group_complete"]))
        elif op < 0.97 and live:
            ix.clear("p", rng.sample(live, rng.randint(1, min(5, len(live)))))
        else:
            ix.clear("p")
        _check_bookkeeping(ix)
    assert ix.produced == ix.cleared + sum(len(p.samples) for p in ix.partitions.values())


def test_sample_moved_into_a_complete_group_is_counted():
    ix = MetadataIndex()
    ids = ix.prepare_put("p", None, 2, ["x"])
    put(ix, "p", ids, fields=("x",), tags=[{"uid": "a"}, {}])
    sub = ix.subscription(ix.partitions["p"], "train", ["x"])
    assert sub.complete == {"a": 1, ("sample", ids[1]): 1} and sub.complete_samples == 2
    put(ix, "p", ids[1:], fields=("y",), tags=[{"uid": "a"}])  # joins group a, which stays complete
    assert sub.complete == {"a": 2} and sub.complete_samples == 2
    meta = ix.get_meta(["x"], 2, "train", "p", "group_complete", {"group_size": 2})
    assert meta.sample_ids == ids and sub.complete_samples == 0


def test_a_put_that_consumes_marks_other_samples_in_the_same_step():
    """``notify(consume=...)``: a roller's samples and the mark on its prompt row appear together; a mark on a
    cleared row is skipped; a bad ``consume`` rejects the whole notify before anything changes."""
    ix = MetadataIndex()
    rows = ix.prepare_put("prompts", None, 2, ["input_ids"])
    put(ix, "prompts", rows)
    assert ix.get_meta(["input_ids"], 2, "rollout", "prompts").sample_ids == rows
    ix.clear("prompts", [rows[1]])
    samples = ix.prepare_put("samples", None, 2, ["responses"])
    ix.notify("samples", samples, [col("responses", 2)], [{"uid": "g"}] * 2,
              consume=Consume("prompts", rows, "answered"))
    [info] = ix.sample_info("prompts", None, 10)
    assert info["id"] == rows[0] and info["consumed_by"] == ["rollout", "answered"]
    assert len(ix.get_meta(["input_ids"], 1, "answered", "prompts")) == 0  # consumed by that task
    more = ix.prepare_put("samples", None, 1, ["responses"])
    with pytest.raises(ValueError, match="partition must be a non-empty string"):
        ix.notify("samples", more, [col("responses", 1)], None, consume=Consume("", rows, "answered"))
    assert ix.sample_info("samples", more, 10)[0]["fields"] == []  # the rejected notify changed nothing
    with pytest.raises(ValueError, match="consume must be a map"):
        Consume.from_wire({"partition": "prompts", "ids": rows})
