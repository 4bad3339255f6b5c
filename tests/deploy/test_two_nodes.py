"""Two Ray nodes on this machine, rollers on one and the trainer on the other: a short job in each mode takes
the cross-node paths (tests/deploy/two_nodes.py runs them in a process of its own: a test session has one
Ray cluster, this needs its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.two_nodes import SPAN_MODE

REPO = Path(__file__).resolve().parents[2]
MODES = ["sync", "one-step-off", "fully-async"]


def _check_same_node_paths(view: dict, mode: str) -> None:
    """A client on the servers' Ray node: ipc sockets, shared memory for puts and gets of at least
    transferqueue.shm_min_bytes."""
    assert all(view["local"]) and all(a.startswith("ipc://") for a in view["addresses"]), (mode, view)


def _check_cross_node_paths(view: dict, num_units: int, mode: str) -> None:
    """A client on the other Ray node: TCP sockets and frames only, no shared-memory block mapped."""
    assert view["local"] == [False] * num_units, (mode, view)
    assert all(a.startswith("tcp://") for a in view["addresses"]), (mode, view["addresses"])
    assert view["num_shm_blocks"] == 0, mode


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_rollers_and_trainer_on_two_ray_nodes_take_the_cross_node_paths(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "deploy" / "two_nodes.py"), str(tmp_path), *MODES],
                          capture_output=True, text=True, timeout=840, env=env, cwd=REPO)
    evidence = json.loads((tmp_path / "two_nodes.json").read_text()) if (tmp_path / "two_nodes.json").exists() else {}
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert sorted(evidence) == sorted(MODES)
    for mode, run in evidence.items():
        assert run["exit_code"] == 0, mode
        [roller], ranks = run["rollers"], run["trainer"]
        num_units = len(run["unit_nodes"])
        # placed by rollers.resources / trainer.resources: two Ray nodes; the TransferQueue servers are on
        # the driver's node (they adopt its Ray node id), which is the head
        assert roller["node"] != run["driver_node"], mode
        assert set(run["unit_nodes"]) == {run["driver_node"]}, mode
        # transferqueue.host=node / checkpointengine.host=node: the servers and trainer rank 0 bound their
        # Ray node's address (both nodes' is 127.0.0.1 here), and the roller connects to what they reported
        [address] = run["node_addresses"]
        assert all(a.startswith(f"tcp://{address}:") for a in roller["addresses"]), (mode, roller["addresses"])
        assert roller["weight_address"].startswith(f"tcp://{address}:"), mode
        assert roller["weight_backend"] == "zmq", mode
        _check_cross_node_paths(roller, num_units, mode)
        if mode != SPAN_MODE:  # one trainer rank, on the head: its rendezvous stays on loopback
            [trainer] = ranks
            assert trainer["node"] == run["driver_node"] and run["rendezvous"][0] == "127.0.0.1", mode
            _check_same_node_paths(trainer, mode)
            continue
        # two trainer ranks, one per node (trainer.host=node): they met at rank 0's Ray node address and
        # trained together; the rank on the roller node reaches the data plane across nodes like the roller
        assert sorted(r["node"] for r in ranks) == sorted([run["driver_node"], roller["node"]]), mode
        assert run["rendezvous"][0] == address and run["rendezvous"][1] > 0, mode
        for rank in ranks:
            if rank["node"] == run["driver_node"]:
                _check_same_node_paths(rank, mode)
            else:
                _check_cross_node_paths(rank, num_units, mode)
