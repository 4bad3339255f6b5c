"""The admin endpoint on its own (no job): token files, refusals, bad requests, answers."""

from __future__ import annotations

import asyncio
import threading

import pytest

from controller.admin import ADDRESS_FILE, TOKEN_FILE, AdminError, AdminServer, pool_state, request_scale


class _Pool:
    def __init__(self):
        self.num_rollers = 1

    def state(self) -> dict:
        return {"pool_size": self.num_rollers, "rollers": []}


class _Keeper:
    """Stands in for ``controller.pool_keeper.PoolKeeper``: records the sizes asked for."""

    def __init__(self):
        self.pool = _Pool()
        self.asked: list[int] = []

    def check_target(self, num_rollers: int) -> None:
        if not 1 <= num_rollers <= 4:
            raise ValueError(f"rollers={num_rollers}: the pool holds 1 .. rollers.max_replicas=4 rollers")

    async def scale_to(self, num_rollers: int) -> None:
        self.asked.append(num_rollers)
        self.pool.num_rollers = num_rollers


@pytest.fixture
def served(tmp_path):
    keeper, loop = _Keeper(), asyncio.new_event_loop()
    server = AdminServer(keeper, tmp_path)
    loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield keeper, tmp_path
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    assert not (tmp_path / ADDRESS_FILE).exists()


def test_token_is_owner_only_and_a_wrong_or_missing_one_is_refused(served):
    keeper, run_dir = served
    assert (run_dir / TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    for token in ("wrong", ""):
        with pytest.raises(AdminError, match="HTTP 401"):
            request_scale(run_dir, 2, token=token)
    assert keeper.asked == []
    assert request_scale(run_dir, 3) == {"pool_size": 3, "rollers": []} and keeper.asked == [3]
    assert pool_state(run_dir)["pool_size"] == 3


@pytest.mark.parametrize("rollers", [0, 5, "2", True, None])
def test_bad_scale_request_names_the_field(served, rollers):
    keeper, run_dir = served
    with pytest.raises(AdminError, match="HTTP 400.*rollers"):
        request_scale(run_dir, rollers)
    assert keeper.asked == []


def test_no_job_is_a_clear_error(tmp_path):
    with pytest.raises(AdminError, match="no running job"):
        pool_state(tmp_path, token="x")
