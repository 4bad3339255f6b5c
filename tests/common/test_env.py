import os

import pytest

from common import env


def test_process_env_is_offline_and_loopback():
    env.setup_process_env()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert os.environ["HF_HOME"].startswith(str(env.cache_dir()))


def test_thread_count_validation():
    with pytest.raises(ValueError, match="num_threads"):
        env.set_torch_threads(0)


def test_logical_cpus_exceed_physical():
    assert env.default_logical_cpus() >= 4 * (os.cpu_count() or 1)


def test_ray_cluster_on_loopback(ray_cluster):
    ray = ray_cluster
    nodes = ray.nodes()
    assert nodes and all(n["NodeManagerAddress"] == env.LOOPBACK for n in nodes)
    assert ray.cluster_resources()["CPU"] >= 32

    @ray.remote(num_cpus=1)
    def remote_env():
        return os.environ.get("HF_HUB_OFFLINE"), os.environ.get("RAY_AUTH_MODE")

    assert ray.get(remote_env.remote()) == ("1", "disabled")
