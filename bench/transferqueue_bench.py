"""Data-plane benchmark: our TransferQueue vs upstream ``transferqueue`` 0.1.11, Ray's object store, raw
pyzmq and memcpy, in one run on the same payloads.

Payload L: 8 int64 fields of (1024, 1024) = 64 MiB; payload S: 8 fields of (128, 128) = 1 MiB.
* put ends when the data is stored and readable; get ends when the caller holds writable tensors of its
  own (Ray's read-only results are copied for a like-for-like figure; upstream's get is timed as returned);
* memcpy: ``np.copyto`` of 64 MiB into a pre-faulted buffer, best of 5;
* every other figure is the median of ``--reps`` repetitions after one warm-up (payload S: ``10 * reps``,
  as a 1 MiB put takes about a millisecond and a median of five is at the mercy of one scheduler hiccup);
* metadata: ``get_meta`` at batch 1024 with ``group_complete`` and at batch 1 with ``sequential``, with
  ``--meta-samples`` (1M) samples indexed.

Upstream is installed by this script into ``bench/.envs/upstream-tq`` (never into the project venv) and
run there as a subprocess (``--upstream-worker``); if that fails its fields are ``nan`` with a message.
GB/s are 1e9 bytes per second. Usage: ``python bench/transferqueue_bench.py [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transferqueue.config import TransferQueueConfig

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_ENV = ROOT / "bench" / ".envs" / "upstream-tq"
UPSTREAM_PKGS = ["torch==2.13.0", "transferqueue==0.1.11"]
NUM_FIELDS = 8
SHAPES = {"L": (1024, 1024), "S": (128, 128)}
S_REPS = 10  # payload S is timed over this many times --reps
RAY_ENV = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DEDUP_LOGS": "0"}


def log(msg: str) -> None:
    print(f"[tq-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def payload(size: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"field_{i}": torch.randint(0, 1 << 40, SHAPES[size], dtype=torch.int64, generator=g)
            for i in range(NUM_FIELDS)}


def nbytes(data: dict) -> int:
    return sum(t.nbytes for t in data.values())


def timed(fn, reps: int, setup=None) -> list[float]:
    """Seconds per call of ``fn()`` for one warm-up plus ``reps`` runs (``setup()`` untimed before each)."""
    out = []
    for _ in range(reps + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out[1:]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------------------------- baselines


def bench_memcpy() -> float:
    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, 64 * 1024**2, dtype=np.uint8)
    dst = np.ones_like(src)  # pre-faulted
    best = min(timed(lambda: np.copyto(dst, src), 5))
    return src.nbytes / best / 1e9


def _zmq_sink(address_file: str) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    Path(address_file).write_text(f"tcp://127.0.0.1:{port}")
    while True:
        msg = sock.recv_multipart(copy=False)
        if len(msg) == 2 and msg[1].bytes == b"stop":
            break
        sock.send_multipart([msg[0], b"ok"])
    ctx.destroy(linger=0)


def bench_zmq(data: dict, reps: int) -> float:
    """One-way bandwidth of raw pyzmq over loopback TCP: 8 frames (zero-copy send) to another process,
    timed until its acknowledgement."""
    import tempfile

    import zmq

    addr_file = tempfile.mktemp(prefix="tq-bench-zmq-")
    sink = subprocess.Popen([sys.executable, __file__, "--zmq-sink", addr_file])
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(addr_file) or not Path(addr_file).read_text():
            if time.monotonic() > deadline or sink.poll() is not None:
                raise RuntimeError("zmq sink did not start")
            time.sleep(0.05)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(Path(addr_file).read_text())
        frames = [t.numpy() for t in data.values()]

        def once():
            sock.send_multipart(frames, copy=False)
            if not sock.poll(60_000):
                raise RuntimeError("zmq sink did not answer")
            sock.recv()

        secs = median(timed(once, reps))
        sock.send(b"stop")
        ctx.destroy(linger=0)
        return nbytes(data) / secs / 1e9
    finally:
        sink.wait(timeout=30) if sink.poll() is None else None
        if sink.poll() is None:
            sink.kill()
        Path(addr_file).unlink(missing_ok=True)


def bench_ray(data: dict, reps: int) -> tuple[float, float]:
    """Ray object store: ``ray.put`` of the dict; ``ray.get`` plus a clone of every tensor (Ray's
    zero-copy results are read-only views of the store)."""
    import ray

    from common.env import init_ray

    init_ray(num_cpus=4, object_store_bytes=1024**3)
    try:
        refs = []
        put_s = median(timed(lambda: refs.append(ray.put(data)), reps))
        ref = refs[-1]
        del refs[:-1]
        get_s = median(timed(lambda: {k: v.clone() for k, v in ray.get(ref).items()}, reps))
        return nbytes(data) / put_s / 1e9, nbytes(data) / get_s / 1e9
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------------- ours


def bench_ours(payloads: dict, reps: int) -> dict:
    from transferqueue import TQClient, start_transferqueue
    from transferqueue.config import TransferQueueConfig

    cfg = TransferQueueConfig(num_storage_units=1, capacity_bytes=2 * 1024**3)
    with start_transferqueue(cfg) as servers, TQClient(servers.handle) as client:
        return {size: _ours_one(client, size, data, reps * S_REPS if size == "S" else reps)
                for size, data in payloads.items()}


def _ours_one(client, size: str, data: dict, reps: int) -> tuple[float, float, int]:
    """(put s, get s, bytes): each put into a fresh partition (the previous one cleared, untimed)."""
    fields, count = list(data), [0]

    def put():
        client.put(data, partition=f"{size}-{count[0]}")

    def clear():
        client.clear(f"{size}-{count[0]}")
        count[0] += 1

    put_s = median(timed(put, reps, setup=clear))
    client.clear(f"{size}-{count[0]}")
    meta = client.put(data, partition=f"{size}-get")

    def get():
        batch = client.get_data(meta, fields)
        assert batch[fields[0]].shape == data[fields[0]].shape

    get_s = median(timed(get, reps))
    client.clear(f"{size}-get")
    return put_s, get_s, nbytes(data)


def meta_config(num_samples: int) -> TransferQueueConfig:
    """The TransferQueue of ``bench_meta``: one unit, an index that holds ``num_samples`` samples (at least
    ``max_request_ids``, the smallest explicit ``max_samples``; the standalone default of 2^20 would refuse
    a larger ``--meta-samples`` mid-bench)."""
    from transferqueue.config import TransferQueueConfig

    cfg = TransferQueueConfig(num_storage_units=1, capacity_bytes=2 * 1024**3, request_timeout_s=300)
    return dataclasses.replace(cfg, max_samples=max(num_samples, cfg.max_request_ids))


def bench_meta(num_samples: int, reps: int) -> tuple[float, float]:
    """``get_meta`` throughput at batch 1024 (group_complete, groups of 4) and latency at batch 1
    (sequential), with ``num_samples`` samples indexed (one tiny field each, uid tags)."""
    import torch

    from transferqueue import TQClient, start_transferqueue

    with start_transferqueue(meta_config(num_samples)) as servers, TQClient(servers.handle) as client:
        chunk = 65536
        t0 = time.perf_counter()
        for start in range(0, num_samples, chunk):
            n = min(chunk, num_samples - start)
            client.put({"x": torch.zeros(n, 1, dtype=torch.int8)}, partition="meta",
                       tags=[{"uid": (start + i) // 4} for i in range(n)])
        log(f"indexed {num_samples} samples in {time.perf_counter() - t0:.1f} s")
        b1024 = timed(lambda: client.get_meta(["x"], 1024, "train", "meta", sampler="group_complete"), reps * 4)
        b1 = timed(lambda: client.get_meta(["x"], 1, "rollout", "meta"), reps * 40)
        assert client.status().num_samples == num_samples
    return 1024 / median(b1024), median(b1) * 1e3


# ------------------------------------------------------------------------------------------ upstream


def ensure_upstream() -> tuple[Path | None, str]:
    """The upstream venv's python (created and filled on first use), or None and why."""
    py = UPSTREAM_ENV / "bin" / "python"
    stamp = UPSTREAM_ENV / ".installed"
    if stamp.exists() and py.exists():
        return py, ""
    log(f"installing {' '.join(UPSTREAM_PKGS)} into {UPSTREAM_ENV} (once)")
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(UPSTREAM_ENV)], check=True, timeout=300)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *UPSTREAM_PKGS], check=True, timeout=1200)
        stamp.touch()
        return py, ""
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"could not install upstream transferqueue 0.1.11: {exc}"


def bench_upstream(reps: int) -> tuple[dict, str]:
    py, why = ensure_upstream()
    if py is None:
        return {}, why
    env = dict(os.environ, **RAY_ENV, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run([str(py), __file__, "--upstream-worker", "--reps", str(reps)], env=env,
                              capture_output=True, text=True, timeout=900, cwd="/tmp")
    except subprocess.TimeoutExpired:
        return {}, "upstream worker timed out"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("UPSTREAM ")]
    if proc.returncode != 0 or not lines:
        return {}, f"upstream worker failed (rc={proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(lines[-1][len("UPSTREAM "):]), ""


def upstream_worker(reps: int) -> None:
    """Runs inside the upstream venv: one storage unit, sync client, same payloads."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=1024**3, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    client = tq.get_client()
    out = {size: _upstream_one(client, size, reps * S_REPS if size == "S" else reps) for size in ("L", "S")}
    print("UPSTREAM " + json.dumps(out), flush=True)
    tq.close()
    ray.shutdown()


def _upstream_one(client, size: str, reps: int) -> list:
    from tensordict import TensorDict

    data = payload(size)
    td = TensorDict(data, batch_size=[SHAPES[size][0]])
    fields, count = list(data), [0]

    def put():
        client.put(td, partition_id=f"{size}-{count[0]}")

    def clear():
        client.clear_partition(f"{size}-{count[0]}")
        count[0] += 1

    put_s = median(timed(put, reps, setup=clear))
    client.put(td, partition_id=f"{size}-get")
    meta = client.get_meta(data_fields=fields, batch_size=SHAPES[size][0], partition_id=f"{size}-get",
                           task_name="bench")
    get_s = median(timed(lambda: client.get_data(meta), reps))
    return [put_s, get_s, nbytes(data)]


# ------------------------------------------------------------------------------------------------ main


def fmt(x: float) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 repetitions (the minimum the definition allows)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--meta-samples", type=int, default=1_000_000)
    ap.add_argument("--skip-upstream", action="store_true")
    ap.add_argument("--upstream-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--zmq-sink", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 20)
    if reps < 5:
        raise SystemExit("--reps must be >= 5 (medians of at least 5 repetitions)")
    if args.zmq_sink:
        return _zmq_sink(args.zmq_sink)
    if args.upstream_worker:
        return upstream_worker(reps)

    sys.path.insert(0, str(ROOT))
    from common.env import setup_process_env

    setup_process_env(num_threads=1)
    payloads = {"L": payload("L"), "S": payload("S")}
    r: dict[str, float] = {}
    r["memcpy_gbps"] = bench_memcpy()
    log(f"memcpy {r['memcpy_gbps']:.2f} GB/s")
    r["zmq_gbps_L"] = bench_zmq(payloads["L"], reps)
    log(f"raw zmq {r['zmq_gbps_L']:.2f} GB/s")
    ours = bench_ours(payloads, reps)
    r["tq_put_gbps_L"] = ours["L"][2] / ours["L"][0] / 1e9
    r["tq_get_gbps_L"] = ours["L"][2] / ours["L"][1] / 1e9
    r["tq_put_ms_S"], r["tq_get_ms_S"] = ours["S"][0] * 1e3, ours["S"][1] * 1e3
    log(f"ours: {ours}")
    r["meta_samples_per_s_b1024"], r["meta_ms_b1"] = bench_meta(args.meta_samples, reps)
    log(f"meta: {r['meta_samples_per_s_b1024']:.0f} samples/s at b1024, {r['meta_ms_b1']:.3f} ms at b1")
    r["ray_put_gbps_L"], r["ray_get_gbps_L"] = bench_ray(payloads["L"], reps)
    log(f"ray: put {r['ray_put_gbps_L']:.2f} get {r['ray_get_gbps_L']:.2f} GB/s")
    up, why = ({}, "skipped (--skip-upstream)") if args.skip_upstream else bench_upstream(reps)
    if why:
        log(f"upstream: {why}")
    nan = float("nan")
    r["upstream_put_gbps_L"] = up["L"][2] / up["L"][0] / 1e9 if up else nan
    r["upstream_get_gbps_L"] = up["L"][2] / up["L"][1] / 1e9 if up else nan
    r["upstream_put_ms_S"] = up["S"][0] * 1e3 if up else nan
    r["upstream_get_ms_S"] = up["S"][1] * 1e3 if up else nan
    keys = ["tq_put_gbps_L", "tq_get_gbps_L", "upstream_put_gbps_L", "upstream_get_gbps_L", "ray_put_gbps_L",
            "ray_get_gbps_L", "zmq_gbps_L", "memcpy_gbps", "tq_put_ms_S", "tq_get_ms_S", "upstream_put_ms_S",
            "upstream_get_ms_S", "meta_samples_per_s_b1024", "meta_ms_b1"]
    print("RESULT " + " ".join(f"{k}={fmt(r[k])}" for k in keys), flush=True)


if __name__ == "__main__":
    main()
