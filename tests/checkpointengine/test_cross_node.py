"""The weight plane's sockets that may leave the node: bound to ``checkpointengine.host``, CURVE-keyed with
``checkpointengine.curve`` (a peer without the job's keys is refused).

127.0.0.2 stands in for a configured address: a different address than the default, still loopback.
Rollers run in threads (the socket path is the one across processes), except the broadcast group's,
which needs a process of its own.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import re
import sys
import threading

import pytest
import torch

from checkpointengine import WeightReceiver, WeightSender, WeightSyncHandle, WeightSyncTimeout
from checkpointengine.config import CheckpointEngineConfig
from common.curve import make_job_keys
from tests.listening import listening_on

sys.path.insert(0, os.path.dirname(__file__))
import ce_procs  # noqa: E402

HOST = "127.0.0.2"
NAMED = [("model.w", torch.arange(12.0).view(3, 4)), ("model.b", torch.ones(4))]


def _cfg(**kw) -> CheckpointEngineConfig:
    return CheckpointEngineConfig(**{"backend": "zmq", "bucket_bytes": 1024, "timeout_s": 10.0, "host": HOST, **kw})


def _listens_on(port: int) -> list[str]:
    return listening_on(port)


def _receive_in_thread(handle: WeightSyncHandle, name: str, version: int) -> tuple[threading.Thread, dict]:
    """A roller thread that receives ``version`` and acks it; ``result`` gets its tensors or its error."""
    result: dict = {}

    def run():
        receiver = WeightReceiver(handle, name)
        try:
            result["tensors"] = dict(receiver.receive(version))
            receiver.ack(version)
        except BaseException as exc:
            result["error"] = exc
        finally:
            receiver.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _send_one(sender: WeightSender, handle: WeightSyncHandle, name: str, version: int) -> None:
    thread, result = _receive_in_thread(handle, name, version)
    assert sender.send(NAMED, version).acked == [name]
    thread.join(timeout=10)
    assert "error" not in result, result.get("error")
    assert torch.equal(result["tensors"]["model.w"], NAMED[0][1])


def test_control_socket_binds_the_configured_host_and_carries_zmq_buckets():
    sender = WeightSender(_cfg(), ["r0"])
    try:
        assert sender.handle.control_address.startswith(f"tcp://{HOST}:")
        assert sender.handle.curve is None
        port = int(sender.handle.control_address.rsplit(":", 1)[1])
        assert _listens_on(port) == [f"{HOST}:{port}"]
        _send_one(sender, sender.handle, "r0", 1)
    finally:
        sender.close()


def test_curve_serves_a_keyed_roller_and_refuses_the_others():
    sender = WeightSender(_cfg(curve=True), ["r0"])
    try:
        keys = sender.handle.curve
        assert keys is not None and keys.server_public and keys.client_secret
        assert keys.server_secret == ""  # the rollers' handle never carries the server's secret
        assert sender.handle_for_ranks().curve is None  # other trainer ranks get no keys at all
        wire = sender.handle.to_dict()
        assert WeightSyncHandle.from_dict(wire) == sender.handle  # the form that travels through Ray

        other = make_job_keys()
        intruders = {"no-keys": None,
                     "wrong-client-key": dataclasses.replace(keys, client_public=other.client_public,
                                                             client_secret=other.client_secret)}
        for name, curve in intruders.items():
            receiver = WeightReceiver(dataclasses.replace(sender.handle, curve=curve, timeout_s=0.5), name)
            try:
                with pytest.raises(WeightSyncTimeout, match=f"roller '{name}': no begin"):
                    next(receiver.receive(1))  # its Want never reaches the sender, so no answer comes
            finally:
                receiver.close()
        _send_one(sender, sender.handle, "r0", 1)
        # The sender handled every message that reached it while sending: none came from an intruder.
        assert sender.roller_weight_versions == {"r0": 1}
    finally:
        sender.close()


def test_broadcast_group_meets_on_the_configured_host():
    cfg = _cfg(backend="broadcast", group_backend="gloo", timeout_s=60.0)
    sender = WeightSender(cfg, ["r0"])
    out = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=ce_procs.roller_main,
                                           args=(sender.handle.to_dict(), "r0", [(1, "ack")], out), daemon=True)
    proc.start()
    try:
        assert sender.send(NAMED, 1).acked == ["r0"]
        roller, version, outcome, got = out.get(timeout=60)
        assert (roller, version, outcome) == ("r0", 1, "ack")
        assert got["model.w"] == ce_procs.digest(NAMED[0][1])
        store_port = sender._side.group.master_port
        assert _listens_on(store_port) == [f"{HOST}:{store_port}"]
    finally:
        sender.close()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("host", ["", "tcp://10.0.0.5", "10.0.0.5:5555", "a b", "10.0.0.5/24"])
@pytest.mark.parametrize("section", ["checkpointengine", "transferqueue"])
def test_a_bad_bind_host_names_its_key(section, host):
    from transferqueue.config import TransferQueueConfig

    make = {"checkpointengine": CheckpointEngineConfig, "transferqueue": TransferQueueConfig}[section]
    with pytest.raises(ValueError, match=f"{section}.host must be one IPv4 address.*{re.escape(repr(host))}"):
        make(host=host)


def test_curve_must_be_a_bool():
    with pytest.raises(ValueError, match="checkpointengine.curve must be true or false"):
        CheckpointEngineConfig(curve="yes")


def test_malformed_curve_keys_in_a_handle_are_a_value_error():
    wire = WeightSender(_cfg(curve=True), ["r0"])
    try:
        body = wire.handle.to_dict()
    finally:
        wire.close()
    with pytest.raises(ValueError, match="handle curve keys"):
        WeightSyncHandle.from_dict({**body, "curve": {"server_public": "x"}})


def test_a_control_server_needs_the_server_secret():
    from checkpointengine.control import ControlServer

    with pytest.raises(ValueError, match="server secret"):
        ControlServer(_cfg(curve=True), make_job_keys().for_clients())
