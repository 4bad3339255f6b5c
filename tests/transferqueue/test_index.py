"""The metadata index and samplers, in-process (the socket layer is tested in test_client.py)."""

from __future__ import annotations

import pytest

from transferqueue.index import MetadataIndex
from transferqueue.records import BatchMeta, chunk_sizes
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
    meta = ix.get_meta("p", fields, 8, "train", "group_complete", {"group_size": 4})
    assert meta.sample_ids == groups["A"] + groups["C"]
    assert [t["uid"] for t in meta.tags] == ["A"] * 4 + ["C"] * 4
    # nothing complete is left: empty with a clear reason, never an error; consumed groups not re-served
    again = ix.get_meta("p", fields, 4, "train", "group_complete")
    assert again.sample_ids == [] and "insufficient complete groups" in again.reason
    put(ix, "p", groups["B"][2:], fields=("responses",))
    assert ix.get_meta("p", fields, 4, "train", "group_complete").sample_ids == groups["B"]


def test_group_complete_waits_with_only_one_group():
    ix = MetadataIndex()
    groups = make_groups(ix)
    put(ix, "p", groups["A"], fields=("responses",))
    meta = ix.get_meta("p", ["input_ids", "responses"], 8, "train", "group_complete")
    assert len(meta) == 0 and "insufficient complete groups: 4 samples" in meta.reason
    with pytest.raises(ValueError, match="group_size"):
        ix.get_meta("p", ["input_ids", "responses"], 6, "train", "group_complete", {"group_size": 4})


def test_consumption_is_per_task_and_resettable():
    ix = MetadataIndex()
    ids = ix.prepare_put("p", None, 6, ["x"])
    put(ix, "p", ids, fields=("x",))
    first = ix.get_meta("p", ["x"], 4, "rollout")
    assert first.sample_ids == ids[:4]
    assert ix.get_meta("p", ["x"], 2, "rollout").sample_ids == ids[4:]
    assert ix.get_meta("p", ["x"], 1, "rollout").reason.startswith("insufficient ready samples")
    assert ix.get_meta("p", ["x"], 6, "train").sample_ids == ids  # another task still sees them
    ix.reset_consumption("p", "rollout")
    ix.reset_consumption("p", "rollout")  # idempotent
    assert ix.get_meta("p", ["x"], 6, "rollout").sample_ids == ids
    assert ix.consumed == {"rollout": 12, "train": 6}


def test_clear_is_idempotent_and_cleared_ids_are_never_served_again():
    ix = MetadataIndex()
    a = ix.prepare_put("a", None, 4, ["x"])
    put(ix, "a", a, fields=("x",))
    assert ix.clear("a", a[:2]) == a[:2]
    assert ix.clear("a", a[:2]) == []
    assert ix.get_meta("a", ["x"], 2, "t").sample_ids == a[2:]
    ix.reset_consumption("a", "t")
    assert ix.get_meta("a", ["x"], 3, "t").sample_ids == []
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
    assert ix.reserved == {}


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
    meta = ix.get_meta("p", ["responses"], 8, "train", "seqlen_balanced", {"num_ranks": 4})
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
    assert ix.get_meta("p", ["x"], 2, "t", "test-newest").sample_ids == ids[-2:]
    with pytest.raises(ValueError, match="unknown sampler"):
        ix.get_meta("p", ["x"], 2, "t", "nope")


def test_chunking_three_samples_for_four_workers():
    assert chunk_sizes(3, 4) == [1, 1, 1, 0]
    meta = BatchMeta("p", [7, 8, 9], ["x"], [{"uid": "a"}, {"uid": "b"}, {"uid": "c"}])
    parts = meta.chunk(4)
    assert [len(p) for p in parts] == [1, 1, 1, 0]
    joined = BatchMeta.concat(parts)
    assert joined.sample_ids == [7, 8, 9] and joined.tags == meta.tags
