"""Runtime environment set-up shared by the CLI, tests, benchmarks and every Ray worker.

Everything here keeps a job on this machine's loopback and inside directories the project controls:
Ray binds 127.0.0.1 only, Hugging Face never reaches a hub, caches and Ray's temp dir live under
``cache_dir()``, and each process uses a fixed number of torch threads so pools sharing a few cores
do not oversubscribe them.
"""

from __future__ import annotations

import os
from pathlib import Path

LOOPBACK = "127.0.0.1"

# Environment every process of a job starts with (Ray workers inherit it from the driver).
_PROCESS_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}


def cache_dir() -> Path:
    """Root of every cache the project writes (model conversions, HF cache, Ray temp files).

    ``$HFLOW_CACHE_DIR`` when set, else ``~/.cache/hflow-async``. Created on first use.
    """
    root = Path(os.environ.get("HFLOW_CACHE_DIR") or Path.home() / ".cache" / "hflow-async")
    root.mkdir(parents=True, exist_ok=True)
    return root


def setup_process_env(num_threads: int | None = None) -> None:
    """Set the loopback/offline environment for this process and its children; idempotent.

    ``num_threads``: torch intra-op threads for this process (``None`` leaves torch's default).
    Must run before Ray is imported by anything that starts a cluster.
    """
    for key, value in _PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("HF_HOME", str(cache_dir() / "huggingface"))
    if num_threads is not None:
        set_torch_threads(num_threads)


def set_torch_threads(num_threads: int) -> None:
    """Pin torch (and OpenMP/MKL children) to ``num_threads`` intra-op threads; raises ValueError if < 1."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[key] = str(num_threads)
    import torch

    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first inter-op parallel work; harmless after
        pass


def ray_temp_dir() -> Path:
    """Ray's session directory root. Kept short: Ray's unix socket paths must fit in 107 bytes."""
    path = cache_dir() / "ray"
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_logical_cpus() -> int:
    """Logical CPUs to advertise to a local Ray cluster.

    Ray's CPU accounting is logical; on a 2-core machine a pool of rollers, a trainer group and the
    feeder would otherwise wait forever for placement. Real CPU use is bounded by torch thread counts.
    """
    return max(32, 4 * (os.cpu_count() or 1))


def init_ray(address: str | None = None, num_cpus: int | None = None, object_store_bytes: int | None = None):
    """Start (or join, with ``address``) a Ray cluster bound to loopback; returns ``ray.init``'s context.

    A local cluster gets ``num_cpus`` logical CPUs (default ``default_logical_cpus()``), no dashboard,
    and its temp dir under ``ray_temp_dir()``. Idempotent within a process.
    """
    setup_process_env()
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context()
    kwargs: dict = {"ignore_reinit_error": True, "log_to_driver": True}
    if address:
        return ray.init(address=address, **kwargs)
    return ray.init(
        num_cpus=num_cpus or default_logical_cpus(),
        object_store_memory=object_store_bytes,
        include_dashboard=False,
        _node_ip_address=LOOPBACK,
        _temp_dir=str(ray_temp_dir()),
        **kwargs,
    )
