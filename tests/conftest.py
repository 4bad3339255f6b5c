"""Shared test set-up: loopback/offline environment, the gpu marker, one Ray cluster per session."""

from __future__ import annotations

import os

import pytest

from common.env import setup_process_env

# Torch threads of the test process: 2 by default; HFLOW_TEST_THREADS=1 runs the suite with another float
# summation order (results must not depend on it).
setup_process_env(num_threads=int(os.environ.get("HFLOW_TEST_THREADS", "2")))


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

    from common.env import init_ray, ray_session_dir, remove_ray_session_dir

    init_ray(num_cpus=64, object_store_bytes=512 * 1024**2)
    session_dir = ray_session_dir()
    yield ray
    ray.shutdown()
    if session_dir is not None:  # the cluster this session started: its directory goes with it
        remove_ray_session_dir(session_dir)


@pytest.fixture(scope="session")
def tiny_model_config():
    from common.models import ModelConfig

    return ModelConfig(path="tiny")
