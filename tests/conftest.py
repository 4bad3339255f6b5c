"""Shared test set-up: loopback/offline environment, the gpu marker, one Ray cluster per session."""

from __future__ import annotations

import pytest

from common.env import setup_process_env

setup_process_env(num_threads=2)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """The one local Ray cluster of this test session (loopback, logical CPUs for small machines)."""
    import ray

    from common.env import init_ray

    init_ray(num_cpus=64, object_store_bytes=512 * 1024**2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_config():
    from common.models import ModelConfig

    return ModelConfig(path="tiny")
