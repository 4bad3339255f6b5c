"""A consumer that dies while its ``get_meta`` long-poll is parked at the index takes no sample with it: the
reply that would have handed it the next sample cannot be delivered (ROUTER_MANDATORY), so the index gives
the sample back and the next consumer gets it. Real processes: the index, a storage unit, and a consumer
killed with SIGKILL mid long-poll (as a roller is when the pool retires it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from tests.controller._cli_job import REPO
from transferqueue import TQClient
from transferqueue.config import TransferQueueConfig
from transferqueue.launch import start_transferqueue

CONSUMER = """
import json, sys
from transferqueue import TQClient
from transferqueue.records import TQHandle
client = TQClient(TQHandle.from_dict(json.loads(sys.argv[1])))
print("polling", flush=True)
client.get_meta(["x"], 1, "rollout", "prompts", timeout_s=60.0)
print("got one", flush=True)
"""


def _wait(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def test_a_sample_handed_to_a_consumer_that_died_mid_long_poll_goes_to_the_next():
    servers = start_transferqueue(TransferQueueConfig(num_storage_units=1))
    client = TQClient(servers.handle)
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, json.dumps(servers.handle.to_dict())],
                                cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        client.put({"x": torch.zeros(1, 4)}, partition="prompts")  # the partition exists; row 0 taken below
        assert len(client.get_meta(["x"], 1, "rollout", "prompts")) == 1
        assert consumer.stdout.readline() == "polling\n"
        _wait(lambda: client.status().waiting == 1)  # its request is parked at the index
        consumer.kill()
        consumer.wait(timeout=10)
        time.sleep(0.5)  # the index's socket sees the connection close
        client.put({"x": torch.ones(1, 4)}, partition="prompts")  # fills the dead consumer's parked request
        meta = client.get_meta(["x"], 1, "rollout", "prompts", timeout_s=10.0)
        assert len(meta) == 1, f"the sample went with the dead consumer: {meta.reason}"
        assert torch.equal(client.get_data(meta)["x"], torch.ones(1, 4))
    finally:
        consumer.kill()
        client.close()
        servers.shutdown()

