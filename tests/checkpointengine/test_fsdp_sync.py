"""End to end: a 2-rank FSDP2 TrainerGroup (Ray actors) → torch-engine roller, each rank writing its
own Shard(0) rows into the shm slots (no gather); the roller's greedy decode then equals the trainer's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from checkpointengine import WeightReceiver, WeightSyncHandle
from checkpointengine.config import CheckpointEngineConfig
from common.models import load_model
from rollers.engine import GenerationRequest, SamplingParams
from rollers.torch_engine import TorchEngine
from rollers.weight_update import apply_update
from tests.checkpointengine.ce_procs import greedy_ids
from trainers import weight_sync as trainer_hooks
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.group import TrainerGroup


def _perturb_shards(worker, seed: int) -> None:
    """Add the same seeded noise to every parameter, each rank touching only its own rows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for shard in worker.named_local_shards():
            noise = torch.randn(shard.full_shape, generator=g) * 0.3
            rows = shard.tensor.shape[0]
            shard.tensor.add_(noise[shard.row_offset: shard.row_offset + rows].to(shard.tensor))


@pytest.mark.slow
def test_fsdp2_two_ranks_to_torch_engine(ray_cluster, tiny_model_config):
    trainer_cfg = TrainerConfig(num_ranks=2, num_cpus_per_rank=0.25, timeout_s=90.0)
    group = TrainerGroup(trainer_cfg, AlgorithmConfig(), tiny_model_config)
    receiver = engine = None
    try:
        group.execute(_perturb_shards, 7)
        cfg = CheckpointEngineConfig(backend="shm", bucket_bytes=32 * 1024, timeout_s=60.0)
        handle = group.execute(trainer_hooks.attach_sender, cfg, ["r0"])
        assert handle[0] == handle[1]
        receiver = WeightReceiver(WeightSyncHandle.from_dict(handle[0]), "r0")
        engine = TorchEngine(load_model(tiny_model_config), 2)

        async def sync():
            loop = asyncio.get_running_loop()
            send = loop.run_in_executor(None, group.execute, trainer_hooks.send_weights, 1)
            update = await apply_update(engine, receiver, 1)
            return update, await send

        update, reports = asyncio.run(sync())
        assert reports[0]["acked"] == ["r0"] and reports[1] is None and update.weight_version == 1
        trainer_model = load_model(tiny_model_config)
        missing, unexpected = trainer_model.load_state_dict(group.call("full_state_dict")[0], strict=False)
        assert missing == ["lm_head.weight"] and not unexpected  # tied: named_parameters lists it once
        prompts = [(1, 16, 20, 30), (1, 12, 40, 41, 42)]

        async def decode():
            sampling = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
            reqs = [GenerationRequest(f"q{i}", p, sampling) for i, p in enumerate(prompts)]
            outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
            await engine.shutdown()
            return outs

        outs = asyncio.run(decode())
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.output_ids == greedy_ids(trainer_model, prompt, 10)
            assert set(out.weight_versions) == {1}
        stats = group.execute(trainer_hooks.sender_stats)[0]
        assert stats["roller_weight_versions"] == {"r0": 1} and stats["last_bytes"] > 0
    finally:
        if receiver is not None:
            receiver.close()
        try:
            group.execute(trainer_hooks.close_sender)
        finally:
            group.shutdown()
