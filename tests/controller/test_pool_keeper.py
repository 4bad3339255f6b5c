"""``PoolKeeper``'s join timing on its own (a stand-in pool, no Ray): a roller that joins gets a row with its
time to active, and its time to the first trained group is found by uid, also when the keeper learns the
roller's groups only after the step that trained one (the end-to-end check is in test_elastic.py)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from controller.config import load_config
from controller.metrics import JobMetrics
from controller.pool import ACTIVE, Member
from controller.pool_keeper import PoolKeeper


class _Pool:
    """Stands in for ``controller.pool.RollerPool``: a join is at once; ``put[name]`` is what the roller
    answers to ``recent_put_uids``."""

    def __init__(self):
        self.members: dict[str, Member] = {}
        self.put: dict[str, list[str]] = {}

    def next_name(self) -> str:
        return f"roller{len(self.members)}"

    def live(self) -> list[Member]:
        return list(self.members.values())

    def size(self) -> int:
        return sum(m.state == ACTIVE for m in self.members.values())

    async def join(self, name: str, trainer_lock, weight_version) -> Member:
        await asyncio.sleep(0.02)  # placed, weights pushed, started
        self.members[name] = member = Member(name, actor=None, state=ACTIVE)
        self.put[name] = []
        return member

    async def call(self, member: Member, method: str, *args, timeout_s=None):
        assert method == "recent_put_uids"
        return list(self.put[member.name])


def test_first_trained_group_of_a_joined_roller_is_matched_by_uid():
    async def main():
        pool = _Pool()
        stages = SimpleNamespace(cfg=load_config(preset="tiny"), metrics=JobMetrics(),
                                 rt=SimpleNamespace(pool=pool), trainer_lock=asyncio.Lock(), weight_version=0)
        keeper = PoolKeeper(stages)
        asked = time.monotonic()
        await keeper.scale_to(1)
        (row,) = keeper.joins
        assert row["roller"] == "roller0" and row["reason"] == "scale_up"
        assert 0.015 <= row["join_to_active_s"] <= time.monotonic() - asked
        assert row["join_to_first_trained_s"] is None
        keeper.note_trained(["u1", "u2"])  # a step of groups other rollers generated
        pool.put["roller0"] = ["u9"]
        await keeper.credit_joins()
        assert row["join_to_first_trained_s"] is None and keeper.first_trained == []
        await asyncio.sleep(0.05)
        before = time.monotonic()
        keeper.note_trained(["u3", "u4"])  # u4 is roller0's: learnt only below, after a later step
        after = time.monotonic()
        await asyncio.sleep(0.05)
        keeper.note_trained(["u5", "u9"])
        pool.put["roller0"] = ["u4", "u9"]
        await keeper.credit_joins()
        assert before - asked - 0.01 <= row["join_to_first_trained_s"] <= after - asked  # the u4 step
        assert row["join_to_first_trained_s"] > row["join_to_active_s"]
        assert keeper.first_trained == [row]  # for the next step record; the summary holds ``joins``
        keeper.note_trained(["u6"])  # nobody waits any more: nothing is kept
        assert not keeper._trained

    asyncio.run(main())
