"""Version handshake: no deadlock across consecutive versions, every wait bounded and named, joins.

Rollers run in threads here (the socket path is the same as across processes, which
``test_backends`` covers); each thread's outcome is checked after it is joined.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import zmq

from checkpointengine import (
    WeightReceiver,
    WeightSender,
    WeightSyncAborted,
    WeightSyncError,
    WeightSyncTimeout,
)
from checkpointengine.config import CheckpointEngineConfig

NAMED = [("model.w", torch.arange(12.0).view(3, 4)), ("model.b", torch.ones(4))]


def _cfg(timeout_s=10.0, backend="zmq"):
    return CheckpointEngineConfig(backend=backend, bucket_bytes=1024, timeout_s=timeout_s)


class RollerThread(threading.Thread):
    """Receives ``versions`` in turn, acking each after ``ack_delay_s``; records outcomes or the error."""

    def __init__(self, handle, name, versions, ack_delay_s=0.0, initial_weight_version=0):
        super().__init__(daemon=True)
        self.receiver = WeightReceiver(handle, name, initial_weight_version=initial_weight_version)
        self.versions, self.ack_delay_s = versions, ack_delay_s
        self.done: list[int] = []
        self.error: BaseException | None = None

    def run(self):
        try:
            for v in self.versions:
                got = dict(self.receiver.receive(v))
                assert torch.equal(got["model.w"], NAMED[0][1])
                time.sleep(self.ack_delay_s)
                self.receiver.ack(v)
                self.done.append(v)
        except BaseException as exc:
            self.error = exc
        finally:
            self.receiver.close()


def test_roller_already_wanting_next_version_does_not_deadlock():
    """Trainer at 586 waits for acks while a fast roller already wants 587: both versions complete."""
    sender = WeightSender(_cfg(), ["fast", "slow"])
    fast = RollerThread(sender.handle, "fast", [586, 587], initial_weight_version=585)
    slow = RollerThread(sender.handle, "slow", [586, 587], ack_delay_s=0.5, initial_weight_version=585)
    try:
        fast.start()
        slow.start()
        assert sorted(sender.send(NAMED, 586).acked) == ["fast", "slow"]
        assert sorted(sender.send(NAMED, 587).acked) == ["fast", "slow"]
        for t in (fast, slow):
            t.join(timeout=10)
            assert t.error is None and t.done == [586, 587]
        assert sender.stats()["roller_weight_versions"] == {"fast": 587, "slow": 587}
    finally:
        sender.close()


def test_roller_that_never_answers_fails_the_trainer_within_the_timeout():
    sender = WeightSender(_cfg(timeout_s=1.0), ["r0", "ghost"])
    r0 = RollerThread(dataclasses.replace(sender.handle, timeout_s=10.0), "r0", [1])
    try:
        r0.start()
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeout, match="weight_version 1: rollers \\['ghost'\\] did not want"):
            sender.send(NAMED, 1)
        assert time.monotonic() - start < 3
        r0.join(timeout=10)
        assert isinstance(r0.error, WeightSyncAborted), r0.error  # r0 was told, not left waiting
    finally:
        sender.close()


def test_malformed_control_messages_are_dropped_and_the_update_goes_on(caplog):
    sender = WeightSender(_cfg(), ["r0"])
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.IDENTITY, b"r0-rogue")
    rogue.connect(sender.handle.control_address)
    versions = [1, 2, 3, 4, 5]
    r0 = RollerThread(sender.handle, "r0", versions)

    def num_bad() -> int:
        return sum("bad message from r0-rogue" in r.getMessage() for r in caplog.records)

    try:
        for junk in ([b"\xc1"], [b"\x81\xa4type\xa3Zap"], [b"x", b"y"]):
            rogue.send_multipart(junk)
        r0.start()
        # The sender reads its socket only during an update, fair-queued between peers: one update may end
        # before all three junk messages were read, so five updates run (each reads several messages).
        for v in versions:
            assert sender.send(NAMED, v).acked == ["r0"]
        r0.join(timeout=10)
        assert r0.error is None and r0.done == versions
        assert num_bad() == 3
    finally:
        rogue.close(0)
        ctx.term()
        sender.close()


def test_receiver_times_out_naming_version_when_sender_is_silent():
    sender = WeightSender(_cfg(timeout_s=0.5), ["r0"])
    receiver = WeightReceiver(sender.handle, "r0")
    try:
        with pytest.raises(WeightSyncTimeout, match="r0.*no begin of weight_version 3"):
            list(receiver.receive(3))
        assert receiver.weight_version == 0
    finally:
        receiver.close()
        sender.close()


def test_a_cancelled_receiver_stops_waiting_for_a_silent_sender_at_once():
    """A trainer restart: the roller's update waits for a sender that is gone; ``cancel`` (from another thread)
    ends it with WeightSyncAborted long before ``timeout_s``."""
    sender = WeightSender(_cfg(), ["r0"])
    waiting = RollerThread(dataclasses.replace(sender.handle, timeout_s=60.0), "r0", [1])
    try:
        waiting.start()
        time.sleep(0.3)  # inside receive, polling for Begin
        start = time.monotonic()
        waiting.receiver.cancel()
        waiting.join(timeout=10)
        assert not waiting.is_alive() and time.monotonic() - start < 5
        assert isinstance(waiting.error, WeightSyncAborted) and "cancelled" in str(waiting.error)
        assert waiting.done == []
    finally:
        sender.close()


def test_version_mismatches_fail_fast_with_names():
    sender = WeightSender(_cfg(timeout_s=5.0), ["ahead", "late"])
    ahead = RollerThread(sender.handle, "ahead", [9, 10])
    try:
        ahead.start()
        time.sleep(0.3)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="ahead.*wants weight_version 9 but the sender is sending"):
            sender.send(NAMED, 8, targets=["ahead"])
        assert time.monotonic() - start < 2
        sender.send(NAMED, 9, targets=["ahead"])
        with pytest.raises(ValueError, match="below the last"):
            sender.send(NAMED, 7)
        with pytest.raises(ValueError, match="already has weight_version 9"):
            sender.send(NAMED, 9, targets=["ahead"])
        with pytest.raises(ValueError, match="not served"):
            sender.send(NAMED, 10, targets=["nobody"])
        # A roller asking for a version the sender is already past is aborted, not left waiting.
        late = RollerThread(sender.handle, "late", [5])
        late.start()
        time.sleep(0.3)
        sender.send(NAMED, 10, targets=["ahead"])
        late.join(timeout=10)
        assert isinstance(late.error, WeightSyncAborted) and "at weight_version 9" in str(late.error)
        ahead.join(timeout=10)
        assert ahead.error is None and ahead.done == [9, 10]
        with pytest.raises(ValueError, match="does not exceed"):
            list(WeightReceiver(sender.handle, "late", initial_weight_version=3).receive(2))
    finally:
        sender.close()


def test_new_roller_joining_mid_run_gets_the_current_version_first():
    sender = WeightSender(_cfg(), ["r0"])
    r0 = RollerThread(sender.handle, "r0", [1, 2])
    try:
        r0.start()
        sender.send(NAMED, 1)
        sender.add_roller("r1")
        r1 = RollerThread(sender.handle, "r1", [1, 2])
        r1.start()
        assert sender.send(NAMED, 1, targets=["r1"]).acked == ["r1"]  # the current version, r1 only
        assert sender.stats()["roller_weight_versions"] == {"r0": 1, "r1": 1}
        assert sorted(sender.send(NAMED, 2).acked) == ["r0", "r1"]
        for t in (r0, r1):
            t.join(timeout=10)
            assert t.error is None and t.done[-1] == 2
        assert r1.done == [1, 2]
    finally:
        sender.close()



def test_a_retried_update_ignores_the_abort_of_the_attempt_it_replaces():
    """The controller's retry of one weight_version after an attempt failed (``RollerPool.push_weights``): the
    roller gave up on the first attempt before the sender's Abort reached it, so that Abort waits in its
    socket when it asks again. The retry takes only what answers its own Want, and succeeds."""
    sender = WeightSender(_cfg(timeout_s=1.0), ["r1", "ghost"])
    receiver = WeightReceiver(dataclasses.replace(sender.handle, timeout_s=0.3), "r1")
    outcomes: list = []

    def attempt():
        try:
            got = dict(receiver.receive(1))
            receiver.ack(1)
            outcomes.append(torch.equal(got["model.w"], NAMED[0][1]))
        except Exception as exc:
            outcomes.append(exc)

    try:
        first = threading.Thread(target=attempt, daemon=True)
        first.start()
        with pytest.raises(WeightSyncTimeout, match="rollers \\['ghost'\\] did not want"):
            sender.send(NAMED, 1)  # r1 gave up after 0.3 s; this Abort, at 1 s, stays queued for it
        first.join(timeout=10)
        assert isinstance(outcomes[0], WeightSyncTimeout) and "no begin" in str(outcomes[0]), outcomes
        receiver.handle = dataclasses.replace(receiver.handle, timeout_s=10.0)
        second = threading.Thread(target=attempt, daemon=True)
        second.start()
        assert sender.send(NAMED, 1, targets=["r1"]).acked == ["r1"]
        second.join(timeout=10)
        assert outcomes[1:] == [True] and receiver.weight_version == 1
    finally:
        receiver.close()
        sender.close()


def test_a_receiver_takes_only_the_begin_and_abort_of_its_own_want():
    """Against a raw ROUTER: a Begin and Aborts naming another request (an earlier attempt's) or none are passed
    over; the Abort naming the receiver's own Want ends its receive."""
    from checkpointengine.protocol import NO_REQUEST, Abort, Begin, Hello, Want, decode, encode

    sender = WeightSender(_cfg(), ["r0"])
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    receiver = WeightReceiver(dataclasses.replace(sender.handle, control_address=f"tcp://127.0.0.1:{port}"), "r0")
    outcome: list = []
    waiting = threading.Thread(target=lambda: outcome.append(pytest.raises(WeightSyncAborted, list,
                                                                           receiver.receive(1))), daemon=True)
    try:
        waiting.start()
        got = []
        while len(got) < 2 and router.poll(5000):
            identity, header = router.recv_multipart()
            got.append(decode(header))
        assert isinstance(got[0], Hello), got  # on connecting
        want = got[1]
        assert isinstance(want, Want) and (want.weight_version, want.have) == (1, 0)
        other = want.request + 1
        for msg in (Begin(1, other), Abort(1, "an earlier attempt", other), Abort(1, "no want seen", NO_REQUEST),
                    Abort(1, "yours", want.request)):
            router.send_multipart([identity, encode(msg)])
        waiting.join(timeout=10)
        assert not waiting.is_alive() and "aborted by the sender: yours" in str(outcome[0].value)
        assert receiver.weight_version == 0
    finally:
        receiver.close()
        router.close(0)
        ctx.term()
        sender.close()
