"""The TransferQueue started as Ray actors; a Ray worker builds its client from the handle."""

from __future__ import annotations

import torch

from tests.transferqueue.ray_servers import start_transferqueue_ray
from transferqueue import TQClient
from transferqueue.config import TransferQueueConfig


def _roller_step(handle_dict: dict) -> list[int]:
    """What a roller does: take a whole group, put responses into the same samples."""
    from common.env import set_torch_threads
    from transferqueue.records import TQHandle

    set_torch_threads(1)
    with TQClient(TQHandle.from_dict(handle_dict)) as client:
        meta = client.get_meta(["input_ids"], 2, "rollout", "step-0", sampler="group_complete", timeout_s=10)
        prompts = client.get_data(meta)["input_ids"]
        client.put({"responses": prompts * 10}, partition="step-0", sample_ids=meta.sample_ids,
                   tags=[{"min_weight_version": 0, "max_weight_version": 0}] * 2)
        return meta.sample_ids


def test_ray_actors_serve_a_roller_round_trip(ray_cluster):
    ray = ray_cluster
    servers = start_transferqueue_ray(TransferQueueConfig(num_storage_units=2, capacity_bytes=64 * 1024**2))
    try:
        with TQClient(servers.handle) as feeder:
            feeder.put({"input_ids": torch.tensor([[1, 2], [1, 2]])}, partition="step-0", tags=[{"uid": "g"}] * 2)
            task = ray.remote(num_cpus=0.1)(_roller_step)
            ids = ray.get(task.remote(servers.handle.to_dict()), timeout=60)
            batch = feeder.get(["input_ids", "responses"], 2, "train", "step-0", sampler="group_complete")
            assert batch.meta.sample_ids == ids
            assert torch.equal(batch["responses"], torch.tensor([[10, 20], [10, 20]]))
            assert batch.meta.tags[0]["max_weight_version"] == 0
    finally:
        servers.shutdown()
