"""``Runtime.watch`` on its own (no pools): a TransferQueue server process that dies ends the running schedule
at once with ``ServerLost`` naming it and the run's resume point; a schedule that fails while a server is dead
reports that loss; otherwise the schedule's own outcome passes through, and a cancellation reaches it."""

from __future__ import annotations

import asyncio
import gc
import re
from types import SimpleNamespace

import pytest

from controller import runtime
from controller.job_checkpoint import CHECKPOINTS, JOB_FILE
from controller.runtime import Runtime
from transferqueue.records import ServerLost


class _Servers:
    """Stands in for ``TQServers``: ``check`` raises once ``dead`` is set."""

    def __init__(self):
        self.dead = False

    def check(self) -> None:
        if self.dead:
            raise ServerLost("storage unit 1", "TransferQueue storage unit 1 (pid 7, tcp://127.0.0.1:9) died: "
                             "killed by SIGKILL")


def _runtime(run_dir, servers: _Servers) -> Runtime:
    rt = Runtime.__new__(Runtime)  # no pools: watch uses only the config's run_dir and the servers
    rt.cfg, rt.tq_servers = SimpleNamespace(run_dir=str(run_dir)), servers
    return rt


@pytest.fixture(autouse=True)
def fast_watch(monkeypatch):
    monkeypatch.setattr(runtime, "WATCH_PERIOD_S", 0.01)


def test_a_dead_server_ends_the_schedule_after_it_unwound(tmp_path):
    servers, unwound = _Servers(), []

    async def schedule():
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)  # a step that finishes before the schedule ends
            unwound.append(True)

    async def main():
        asyncio.get_running_loop().call_later(0.1, setattr, servers, "dead", True)
        await _runtime(tmp_path, servers).watch(schedule())

    with pytest.raises(ServerLost, match="storage unit 1 .* killed by SIGKILL; what it held is lost, so the run "
                                         r"stops: no job checkpoint was written yet \(trainer.save_every\)") as lost:
        asyncio.run(main())
    assert lost.value.server == "storage unit 1" and unwound == [True]


def test_a_schedule_failing_on_a_dead_server_reports_the_loss_and_the_resume_point(tmp_path):
    (tmp_path / CHECKPOINTS / "step_2").mkdir(parents=True)
    (tmp_path / CHECKPOINTS / "step_2" / JOB_FILE).write_text("{}")
    servers = _Servers()

    async def schedule():
        servers.dead = True
        raise RuntimeError("a client's request found the unit gone")

    resume = re.escape(f"--resume {tmp_path} continues it from its job checkpoint of step 2")
    with pytest.raises(ServerLost, match=resume) as lost:
        asyncio.run(_runtime(tmp_path, servers).watch(schedule()))
    assert isinstance(lost.value.__cause__, RuntimeError)


def test_without_a_dead_server_the_outcome_and_a_cancellation_pass_through(tmp_path):
    rt, unwound = _runtime(tmp_path, _Servers()), []

    async def done():
        return 7

    async def fails():
        raise ValueError("the schedule's own error")

    async def waits():
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)
            unwound.append(True)

    async def cancelled() -> None:
        task = asyncio.ensure_future(rt.watch(waits()))
        await asyncio.sleep(0.05)
        task.cancel()
        await task

    assert asyncio.run(rt.watch(done())) == 7
    with pytest.raises(ValueError, match="own error"):
        asyncio.run(rt.watch(fails()))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())
    assert unwound == [True]


def test_an_error_the_schedule_ends_with_while_it_stops_is_retrieved_not_left_to_asyncio(tmp_path, caplog):
    """A stop sent to every process of the job can kill a trainer rank while its step runs: the step then ends
    with the rank's error rather than the cancellation. The stop goes on (CancelledError), the error is one log
    line, and asyncio has no unretrieved task exception to print as a traceback (it did, 2 runs in 5, in
    test_stop's SIGTERM-to-every-process test)."""
    unhandled = []

    async def schedule():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # the step finishes, then fails: its rank was killed
            raise RuntimeError("trainer rank 0 was lost in train_step") from None

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
        watching = asyncio.ensure_future(_runtime(tmp_path, _Servers()).watch(schedule()))
        await asyncio.sleep(0.1)
        watching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watching
        gc.collect()  # a task whose exception nobody retrieved reports it when it is collected
        await asyncio.sleep(0)

    with caplog.at_level("INFO", logger="controller.runtime"):
        asyncio.run(main())
    assert unhandled == []
    assert "the schedule ended with RuntimeError: trainer rank 0 was lost in train_step while it stopped" in caplog.text
