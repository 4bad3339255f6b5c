"""Weight sync into the torch engine: tied embeddings, greedy parity, in-flight requests, failures.

The sender runs in a worker thread of the test process and the engine on its event loop; the
transport between them is the real shm/zmq path (process boundaries are covered by test_backends).
"""

from __future__ import annotations

import asyncio
import logging
import warnings

import pytest
import torch

from checkpointengine import (
    MissingWeightsError,
    WeightNameMapper,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
)
from checkpointengine.config import CheckpointEngineConfig
from common.models import ModelConfig, TinyModelConfig, load_model
from rollers.engine import GenerationRequest, SamplingParams
from rollers.torch_engine import TorchEngine
from rollers.weight_update import WeightUpdateError, apply_update
from tests.checkpointengine.ce_procs import greedy_ids

EOS = 2


def _model(tied=True, seed=0):
    return load_model(ModelConfig(path="tiny", tiny=TinyModelConfig(vocab_size=32, tie_word_embeddings=tied,
                                                                    seed=seed)))


def _perturb(model, seed=1, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


class Rig:
    """One trainer model + sender and one TorchEngine roller + receiver, wired together."""

    def __init__(self, backend="shm", tied=True, mapper=None, slots=4):
        self.cfg = CheckpointEngineConfig(backend=backend, bucket_bytes=16 * 1024, timeout_s=20.0)
        self.trainer = _model(tied)
        self.sender = WeightSender(self.cfg, ["r0"], mapper=mapper)
        self.engine = TorchEngine(_model(tied), EOS, max_batch_slots=slots)
        self.receiver = WeightReceiver(self.sender.handle, "r0")

    async def sync(self, named, version, pause_mode="retract"):
        send = asyncio.get_running_loop().run_in_executor(None, self.sender.send, named, version)
        results = await asyncio.gather(apply_update(self.engine, self.receiver, version, pause_mode), send,
                                       return_exceptions=True)
        return results

    async def close(self):
        await self.engine.shutdown()
        self.receiver.close()
        self.sender.close()


def _request(i, prompt, n=12, temperature=0.0):
    return GenerationRequest(f"q{i}", tuple(prompt), SamplingParams(max_new_tokens=n, temperature=temperature,
                                                                    ignore_eos=True))


PROMPTS = [(1, 5, 9, 13), (1, 7, 7), (1, 20, 3, 11, 30), (1, 4)]


@pytest.mark.parametrize("backend", ["shm", "zmq"])
def test_greedy_generation_after_sync_equals_trainer_greedy(backend):
    async def main():
        rig = Rig(backend)
        try:
            _perturb(rig.trainer)
            before = await rig.engine.generate(_request(0, PROMPTS[0]))
            assert before.output_ids != greedy_ids(rig.trainer, PROMPTS[0], 12), "perturbation changed nothing"
            update, report = await rig.sync(list(rig.trainer.state_dict().items()), 1)
            assert report.acked == ["r0"] and update.weight_version == 1
            outs = await asyncio.gather(*(rig.engine.generate(_request(i, p)) for i, p in enumerate(PROMPTS)))
            for prompt, out in zip(PROMPTS, outs, strict=True):
                assert out.output_ids == greedy_ids(rig.trainer, prompt, 12)
                assert set(out.weight_versions) == {1}
            assert rig.sender.stats()["roller_weight_versions"] == {"r0": 1}
            assert rig.receiver.stats()["weight_version"] == 1 and rig.receiver.stats()["last_bytes"] > 0
        finally:
            await rig.close()

    asyncio.run(main())


def test_tied_embedding_sync_only_embed_tokens_and_both_names(caplog):
    async def main():
        rig = Rig(tied=True, mapper=WeightNameMapper(tie_word_embeddings=True))
        try:
            with torch.no_grad():
                rig.trainer.model.embed_tokens.weight.add_(torch.randn(32, 64, generator=torch.Generator()
                                                                       .manual_seed(2)))
            x = torch.tensor([[1, 5, 9, 13, 17]])
            embed = rig.trainer.model.embed_tokens.weight.detach()
            await rig.sync([("model.embed_tokens.weight", embed)], 1)
            engine_model = rig.engine._model
            torch.testing.assert_close(engine_model(x).logits, rig.trainer(x).logits, rtol=0, atol=0)
            assert engine_model.lm_head.weight.data_ptr() == engine_model.model.embed_tokens.weight.data_ptr()
            one_tensor_bytes = rig.sender.stats()["last_bytes"]

            with torch.no_grad():
                rig.trainer.model.embed_tokens.weight.mul_(0.5)
            caplog.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with caplog.at_level(logging.WARNING):
                    _, report = await rig.sync([("lm_head.weight", rig.trainer.lm_head.weight.detach()),
                                                ("model.embed_tokens.weight", embed)], 2)
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
            assert report.num_bytes == one_tensor_bytes, "the tied head travels once"
            torch.testing.assert_close(engine_model(x).logits, rig.trainer(x).logits, rtol=0, atol=0)
        finally:
            await rig.close()

    asyncio.run(main())


def test_untied_model_without_lm_head_is_flagged_and_keeps_its_version():
    async def main():
        trainer = _model(tied=False)
        rig = Rig(tied=False, mapper=WeightNameMapper.for_model(trainer))
        try:
            named = [(n, t) for n, t in trainer.state_dict().items() if n != "lm_head.weight"]
            update, send = await rig.sync(named, 1)
            assert isinstance(send, MissingWeightsError) and "lm_head.weight" in str(send)
            assert isinstance(update, WeightUpdateError) and update.kept_weight_version == 0
            assert rig.engine.weight_version == 0
            update, report = await rig.sync(list(trainer.state_dict().items()), 1)
            assert report.acked == ["r0"] and rig.engine.weight_version == 1
        finally:
            await rig.close()

    asyncio.run(main())


def test_update_with_8_long_requests_in_flight():
    """Retract pause: nothing lost, every token after resume carries v1 and is what v1 weights decode."""
    async def main():
        rig = Rig(slots=8)
        try:
            _perturb(rig.trainer, seed=3)
            prompts = [(1, 3 + i, 9, 2 + 2 * i) for i in range(8)]
            tasks = [asyncio.create_task(rig.engine.generate(_request(i, p, n=40)))
                     for i, p in enumerate(prompts)]
            for _ in range(400):
                await asyncio.sleep(0.01)
                if rig.engine.stats()["num_tokens_generated"] >= 24:
                    break
            assert rig.engine.stats()["num_requests_in_flight"] == 8
            update, report = await rig.sync(list(rig.trainer.state_dict().items()), 1)
            assert report.acked == ["r0"], update
            outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
            for prompt, out in zip(prompts, outs, strict=True):
                assert out.finish_reason == "length" and len(out.output_ids) == 40
                versions = out.weight_versions
                k = versions.index(1)
                assert 0 < k and versions == [0] * k + [1] * (40 - k), versions
                # The v1 tokens continue prompt + v0 tokens exactly as the trainer's weights decode it.
                assert out.output_ids[k:] == greedy_ids(rig.trainer, list(prompt) + out.output_ids[:k], 40 - k)
        finally:
            await rig.close()

    asyncio.run(main())


def test_failed_update_keeps_old_version_reports_error_and_engine_serves_on():
    async def main():
        rig = Rig()
        try:
            bad = [("model.norm.weight", torch.ones(7))]  # wrong shape: the engine refuses it
            update, send = await rig.sync(bad, 1)
            assert isinstance(update, WeightUpdateError) and "shape" in str(update)
            assert isinstance(send, WeightSyncError) and send.failures.keys() == {"r0"} and send.weight_version == 1
            assert rig.engine.weight_version == 0 and rig.receiver.weight_version == 0
            stats = rig.sender.stats()
            assert stats["roller_weight_versions"] == {"r0": 0} and stats["num_roller_failures"] == 1
            out = await rig.engine.generate(_request(0, PROMPTS[0]))
            assert set(out.weight_versions) == {0}  # resumed, still on its old version
        finally:
            await rig.close()

    asyncio.run(main())
