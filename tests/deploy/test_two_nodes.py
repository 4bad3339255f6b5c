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

REPO = Path(__file__).resolve().parents[2]
MODES = ["sync", "one-step-off", "fully-async"]


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
        [roller], [trainer] = run["rollers"], run["trainer"]
        # placed by rollers.resources / trainer.resources: two Ray nodes; the TransferQueue servers are on
        # the driver's node (they adopt its Ray node id), which is the head, the trainer's node
        assert roller["node"] != trainer["node"], mode
        assert set(run["unit_nodes"]) == {run["driver_node"]} == {trainer["node"]}, mode
        # the roller, on the other node: TCP sockets and frames only, no shared-memory block mapped
        assert roller["local"] == [False] * len(run["unit_nodes"]), mode
        assert all(a.startswith("tcp://127.0.0.1:") for a in roller["addresses"]), (mode, roller["addresses"])
        assert roller["num_shm_blocks"] == 0, mode
        assert roller["weight_backend"] == "zmq", mode
        # the trainer shares the servers' Ray node: the same-node paths stay on there (ipc sockets, shared
        # memory for puts and gets of at least transferqueue.shm_min_bytes)
        assert all(trainer["local"]) and all(a.startswith("ipc://") for a in trainer["addresses"]), (mode, trainer)
