"""``controller.pool.find_orphans`` against real TransferQueue servers (no Ray): a group whose roller left
is re-issued exactly when its samples never reached the index — never when they did, even once the group
was trained and its samples cleared before the prompt row was looked at (the race a roller dying between
its put and its clear opened)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common import schema
from controller.pool import find_orphans
from rollers.tq_channel import ANSWERED_TASK, ROLLOUT_TASK
from transferqueue.client import TQClient
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue
from transferqueue.records import Consume


@pytest.fixture(scope="module")
def tq():
    servers = start_transferqueue(TransferQueueConfig(num_storage_units=1, capacity_bytes=16 * 1024**2))
    client = TQClient(servers.handle)
    yield client
    client.close()
    servers.shutdown()


def _take_prompt_rows(client: TQClient, uids: list[str]) -> dict[str, int]:
    """Put one prompt row per uid and take them all as the rollers do; uid -> prompt row id."""
    client.put({schema.INPUT_IDS: torch.ones(len(uids), 3, dtype=torch.int64)}, "prompts",
               tags=[{schema.UID: u} for u in uids])
    meta = client.get_meta([schema.INPUT_IDS], len(uids), ROLLOUT_TASK, "prompts")
    return {t[schema.UID]: sid for t, sid in zip(meta.tags, meta.sample_ids, strict=True)}


def _put_group(client: TQClient, uid: str, prompt_row: int | None) -> list[int]:
    """A roller's put of group ``uid`` (2 samples); ``prompt_row``: the row it answers, marked in the same step."""
    consume = None if prompt_row is None else Consume("prompts", [prompt_row], ANSWERED_TASK)
    return client.put({schema.RESPONSES: torch.ones(2, 4, dtype=torch.int64)}, "samples",
                      tags=[{schema.UID: uid}] * 2, consume=consume).sample_ids


def test_a_group_put_before_its_roller_left_is_never_reissued_even_once_trained(tq):
    rows = _take_prompt_rows(tq, ["trained", "waiting", "lost", "held"])
    trained = _put_group(tq, "trained", rows["trained"])  # then the roller died: its prompt row stays
    _put_group(tq, "waiting", rows["waiting"])             # likewise, its samples not trained yet
    tq.clear("samples", trained)                            # trained and cleared before anyone looked

    async def held_by_live() -> set[str]:
        return {"held"}

    orphans = asyncio.run(find_orphans(tq, "prompts", 1000, held_by_live, grace_s=0.0))
    assert orphans == {"lost": [rows["lost"]]}  # no samples: re-issued; never "trained" nor "waiting"
    left = {i["tags"][schema.UID] for i in tq.sample_info("prompts")}
    assert left == {"lost", "held"}  # the answered rows are cleared (the re-issue clears "lost"'s)
    assert asyncio.run(find_orphans(tq, "prompts", 1000, held_by_live, grace_s=0.0)) == {"lost": [rows["lost"]]}
    tq.clear("prompts")


def test_without_the_mark_the_trained_group_would_be_reissued(tq):
    """The same window with a put that does not mark its prompt row: the group is taken for an orphan. This
    is what the mark prevents (and why the put and the mark are one index step)."""
    rows = _take_prompt_rows(tq, ["trained"])
    tq.clear("samples", _put_group(tq, "trained", None))

    async def held_by_live() -> set[str]:
        return set()

    assert asyncio.run(find_orphans(tq, "prompts", 1000, held_by_live, grace_s=0.0)) == {"trained": [rows["trained"]]}
    tq.clear("prompts")


class _Method:
    def __init__(self, result):
        self.result = result

    def remote(self, *args):
        async def answer():
            return self.result
        return answer()


class _DrainingActor:
    """What ``RollerPool.drain`` calls on a roller actor, answered at once."""

    def __init__(self, failures):
        self.drain, self.stats = _Method(["uid-held"]), _Method({"num_groups": 3.0})
        self.drain_failures = _Method(failures)


def test_a_group_that_failed_on_a_draining_roller_is_logged(monkeypatch, caplog):
    """The controller drains failures from live rollers only: a roller leaving by scale-down hands its failed
    groups to ``drain``, which logs them (the roller itself logs them at debug)."""
    import logging

    import ray

    from controller.config import load_config
    from controller.pool import RollerPool
    from rollers.roller import FailedGroup

    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: None)
    failure = FailedGroup("uid7", 7, "reward", ("reward raised ValueError: bad",), "")
    pool = RollerPool(load_config(preset="tiny"), lambda name: _DrainingActor([failure]))
    pool.place(1)
    with caplog.at_level(logging.WARNING, logger="controller.pool"):
        handed_back = asyncio.run(pool.drain("roller0", timeout_s=1.0))
    assert handed_back == ["uid-held"] and pool.members == {} and pool.retired_stats["num_groups"] == 3.0
    expected = "group uid7 failed in reward on roller roller0 as it left the pool: reward raised ValueError"
    assert expected in caplog.text
