"""Two Ray nodes on this machine, rollers on one and the trainer on the other, a short job per mode.

Run by tests/deploy/test_two_nodes.py in a process of its own (a test session has one Ray cluster; this
needs its own), or by hand: ``PYTHONPATH=. python tests/deploy/two_nodes.py OUT_DIR [MODE ...]``. It starts
the cluster with Ray's ``ray.cluster_utils.Cluster`` (two raylets on 127.0.0.1, token auth on, as
``common.env`` sets up): the head node has the Ray resource ``hflow_trainer``, the second ``hflow_roller``;
each job joins it (``ray.address``) and places its pools with ``trainer.resources`` /
``rollers.resources``, binding its cross-node sockets as on KubeRay (``transferqueue.host=node``,
``checkpointengine.host=node``). In ``SPAN_MODE`` the trainer has two ranks, one per node (both nodes
have one ``hflow_span``; ``trainer.host=node``). Before each job's pools stop it records, from inside the
actors, where they ran and which data-plane paths they took; ``OUT_DIR/two_nodes.json`` holds
``{mode: {"exit_code", "driver_node", "node_addresses", "unit_nodes", "rendezvous", "rollers": [...],
"trainer": [...]}}``, where each roller / trainer rank gives its Ray ``node``, ``local`` (per storage unit:
reached through shared memory), ``addresses`` (the sockets it uses) and ``num_shm_blocks`` (shared-memory
blocks its client mapped); a roller also its ``weight_address`` (the weight plane's control socket);
``node_addresses`` is each Ray node's address, ``rendezvous`` the trainer ranks' (address, port).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

SPAN_MODE = "sync"  # the mode whose two trainer ranks are on different Ray nodes


def _client_view(client) -> dict:
    import ray

    from transferqueue.transport import server_addresses

    return {"node": f"ray:{ray.get_runtime_context().get_node_id()}", "local": list(client.local),
            "addresses": sorted(server_addresses(client.handle).values()), "num_shm_blocks": len(client.shm.maps)}


def _roller_view(actor) -> dict:
    return {**_client_view(actor.roller.channel.client), "weight_backend": actor.receiver.handle.backend,
            "weight_address": actor.receiver.handle.control_address}


def _trainer_view(worker) -> dict:
    return _client_view(worker._tq_client)


def _record_before_close(evidence: dict, mode: str) -> None:
    """Wrap ``Runtime.close`` so that, before the pools stop, the actors' views are recorded."""
    import ray

    from controller.runtime import Runtime

    close = Runtime.close

    def recording_close(rt) -> None:
        members = rt.pool.live() if rt.pool is not None else []
        if members and rt.trainer is not None and mode not in evidence:
            evidence[mode] = {
                "driver_node": f"ray:{ray.get_runtime_context().get_node_id()}",
                "node_addresses": sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}),
                "unit_nodes": list(rt.tq_servers.handle.unit_nodes),
                "rendezvous": list(rt.trainer.rendezvous),
                "rollers": ray.get([m.actor.__ray_call__.remote(_roller_view) for m in members]),
                "trainer": rt.trainer.execute(_trainer_view),
            }
        close(rt)

    Runtime.close = recording_close


def main(out_dir: str, modes: list[str]) -> int:
    from common.env import ray_temp_dir, setup_process_env

    setup_process_env(num_threads=1)  # loopback, token auth: before Ray is imported
    # Cluster notes its address in RAY_TMPDIR/ray (default /tmp/ray): a private directory, removed at the end
    notes = Path(tempfile.mkdtemp(prefix="hflow-two-nodes-"))
    (notes / "ray").mkdir()
    os.environ["RAY_TMPDIR"] = str(notes)
    # a busy machine: give each raylet's agents more than Ray's default 30 s to come up
    os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "180")
    from ray.cluster_utils import Cluster

    from controller.config import load_config
    from controller.job import run_job

    out = Path(out_dir)
    small = {"num_cpus": 3, "object_store_memory": 128 * 1024**2, "include_dashboard": False,
             "node_ip_address": "127.0.0.1", "temp_dir": str(ray_temp_dir())}
    cluster = Cluster(initialize_head=True,
                      head_node_args={**small, "resources": {"hflow_trainer": 1, "hflow_span": 1}})
    evidence: dict = {}
    try:
        cluster.add_node(**small, resources={"hflow_roller": 1, "hflow_span": 1})
        cluster.wait_for_nodes()
        for mode in modes:
            _record_before_close(evidence, mode)
            trainer = (["trainer.num_ranks=2", "trainer.resources={hflow_span: 1}", "trainer.host=node"]
                       if mode == SPAN_MODE else ["trainer.resources={hflow_trainer: 1}"])
            cfg = load_config(mode=mode, preset="tiny", overrides=[
                f"ray.address={cluster.address}", "rollers.resources={hflow_roller: 1}", *trainer,
                "checkpointengine.backend=zmq", "transferqueue.host=node", "checkpointengine.host=node",
                "data.train_batch_size=2", "trainer.ppo_mini_batch_size=2", "rollout.n=2",
                "trainer.total_steps=2", f"run_dir={out / mode}", "metrics.progress=false"])
            code = run_job(cfg)
            evidence.setdefault(mode, {})["exit_code"] = code
    finally:
        cluster.shutdown()
        shutil.rmtree(notes, ignore_errors=True)
        (out / "two_nodes.json").write_text(json.dumps(evidence, indent=1))
    return 0 if all(e["exit_code"] == 0 for e in evidence.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:] or ["sync", "one-step-off", "fully-async"]))
