"""Weight-sync benchmark: SmolLM2-135M (fp32, ~0.54 GB) from a 2-rank FSDP2 trainer to 1 and 2 rollers.

Every process is real: two trainer ranks (gloo, FSDP2 ``fully_shard`` per decoder layer) and one torch
engine per roller. Per backend it times full updates (``trainers.weight_sync.send_weights`` on both ranks,
``apply_update`` = pause → receive and load → commit → flush → resume on every roller) with idle
rollers and with rollers busy decoding 8 requests, against a raw memcpy of the same bytes.
``sync_s`` is the slowest of: the leader's update (first Want → last Ack) and each roller's
pause → resumed. Medians over the timed repetitions.

    python bench/weight_sync_bench.py --quick      # < 5 min: 1 and 2 rollers, every backend, busy shm
    python bench/weight_sync_bench.py --reps 5 --busy-all

Final line: ``RESULT sync_s_shm=… sync_s_shm_busy=… sync_s_zmq=… sync_s_broadcast=… memcpy_s=… bytes=…``
(plus ``_2r`` keys for two rollers and ``sync_s_disk``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import time
from types import SimpleNamespace

MODEL = "smollm2-135m-instruct"
CTX = mp.get_context("spawn")


def _trainer_rank(rank: int, world: int, port: int, conn) -> None:
    from common.env import setup_process_env

    setup_process_env(num_threads=1)
    import torch

    from checkpointengine.config import CheckpointEngineConfig
    from common.models import ModelConfig
    from trainers import fsdp
    from trainers import weight_sync as trainer_hooks

    fsdp.init_distributed(rank, world, "127.0.0.1", port, "gloo", 600.0)
    policy = fsdp.build_fsdp_model(ModelConfig(path=MODEL), fsdp.POLICY, torch.device("cpu"))
    worker = SimpleNamespace(policy=policy, named_local_shards=lambda: fsdp.named_local_shards(policy),
                             named_full_tensors=lambda: fsdp.named_full_tensors(policy), weight_sender=None)
    conn.send(("ready", rank))
    while True:
        cmd, *args = conn.recv()
        if cmd == "attach":
            conn.send(trainer_hooks.attach_sender(worker, CheckpointEngineConfig(**args[0]), args[1]))
        elif cmd == "send":
            conn.send(trainer_hooks.send_weights(worker, *args))
        elif cmd == "close":
            trainer_hooks.close_sender(worker)
            conn.send(None)
        else:
            break


def _roller(name: str, conn) -> None:
    from common.env import setup_process_env

    setup_process_env(num_threads=1)
    asyncio.run(_roller_loop(name, conn))


async def _roller_loop(name: str, conn) -> None:
    from checkpointengine import WeightReceiver, WeightSyncHandle
    from common.models import ModelConfig, load_model, load_tokenizer
    from rollers.engine import GenerationRequest, SamplingParams
    from rollers.torch_engine import TorchEngine
    from rollers.weight_update import apply_update

    cfg = ModelConfig(path=MODEL)
    engine = TorchEngine(load_model(cfg), load_tokenizer(cfg), max_batch_slots=8)
    loop = asyncio.get_running_loop()
    receiver, busy = None, []

    async def decode_forever(i: int) -> None:
        n = 0
        while True:
            n += 1
            req = GenerationRequest(f"{name}-{i}-{n}", (1, 2, 3, 4 + i),
                                    SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True))
            await engine.generate(req)

    conn.send(("ready", name))
    while True:
        cmd, *args = await loop.run_in_executor(None, conn.recv)
        if cmd == "attach":
            handle = WeightSyncHandle.from_dict(args[0])
            receiver = WeightReceiver(handle, name, initial_weight_version=engine.weight_version)
            conn.send(None)
        elif cmd == "update":
            result = await apply_update(engine, receiver, args[0], "retract")
            conn.send(result.duration_s)
        elif cmd == "busy":
            busy = [asyncio.create_task(decode_forever(i)) for i in range(8)]
            while engine.stats()["num_running"] < 8:
                await asyncio.sleep(0.05)
            conn.send(None)
        elif cmd == "idle":
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            busy = []
            conn.send(None)
        elif cmd == "detach":
            receiver.close()
            conn.send(None)
        else:
            await engine.shutdown()
            break


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, num_rollers: int):
        port = _free_port()
        self.trainers, self.rollers, self.procs = [], [], []
        for rank in range(2):
            parent, child = CTX.Pipe()
            self.procs.append(CTX.Process(target=_trainer_rank, args=(rank, 2, port, child), daemon=True))
            self.trainers.append(parent)
        for i in range(num_rollers):
            parent, child = CTX.Pipe()
            self.procs.append(CTX.Process(target=_roller, args=(f"r{i}", child), daemon=True))
            self.rollers.append(parent)
        for p in self.procs:
            p.start()
        for c in self.trainers + self.rollers:
            c.recv()
        self.version = 0
        self.verbose = False

    @staticmethod
    def _all(conns, msg, timeout_s: float = 600.0):
        for c in conns:
            c.send(msg)
        out = []
        for c in conns:
            if not c.poll(timeout_s):
                raise TimeoutError(f"no answer to {msg[0]} within {timeout_s} s")
            out.append(c.recv())
        return out

    def attach(self, backend: str) -> None:
        cfg = {"backend": backend, "dtype": "float32", "timeout_s": 300.0, "group_backend": "gloo"}
        names = [f"r{i}" for i in range(len(self.rollers))]
        handle = self._all(self.trainers, ("attach", cfg, names))[0]
        self._all(self.rollers, ("attach", handle))

    def sync(self, num_rollers: int) -> tuple[float, int]:
        self.version += 1
        targets = [f"r{i}" for i in range(num_rollers)]
        rollers = self.rollers[:num_rollers]
        for c in rollers:
            c.send(("update", self.version))
        reports = self._all(self.trainers, ("send", self.version, targets))
        roller_s = [c.recv() for c in rollers]
        if self.verbose:
            print(f"  v{self.version}: leader {reports[0]['duration_s']:.3f} s, rollers "
                  + " ".join(f"{t:.3f}" for t in roller_s), flush=True)
        return max([reports[0]["duration_s"], *roller_s]), reports[0]["num_bytes"]

    def detach(self) -> None:
        self._all(self.rollers, ("detach",))
        self._all(self.trainers, ("close",))

    def close(self) -> None:
        for c in self.trainers + self.rollers:
            c.send(("exit",))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _memcpy_s(num_bytes: int, reps: int) -> float:
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 timed reps, busy case for shm only")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--busy-all", action="store_true",
                        help="busy rollers for every backend, not only shm")
    parser.add_argument("--backends", default="shm,zmq,broadcast,disk")
    parser.add_argument("--verbose", action="store_true", help="per-update leader and roller times")
    args = parser.parse_args()
    reps = 2 if args.quick else args.reps
    from common.env import setup_process_env

    setup_process_env(num_threads=1)
    started = time.perf_counter()
    cluster = Cluster(num_rollers=2)
    cluster.verbose = args.verbose
    print(f"cluster up in {time.perf_counter() - started:.1f} s", flush=True)
    results: dict[str, float] = {}
    num_bytes = 0
    try:
        for backend in args.backends.split(","):
            cluster.attach(backend)
            cluster.sync(2)  # warm-up of every roller (groups, shm pages, first-touch allocations)
            for num_rollers in (1, 2):
                times = []
                for _ in range(reps):
                    t, num_bytes = cluster.sync(num_rollers)
                    times.append(t)
                key = f"sync_s_{backend}" + ("" if num_rollers == 1 else "_2r")
                results[key] = statistics.median(times)
                shown = " ".join(f"{t:.3f}" for t in times)
                print(f"{backend:9s} rollers={num_rollers} idle: {shown}", flush=True)
            if backend == "shm" or args.busy_all:
                cluster._all(cluster.rollers, ("busy",))
                times = [cluster.sync(1)[0] for _ in range(reps)]
                cluster._all(cluster.rollers, ("idle",))
                results[f"sync_s_{backend}_busy"] = statistics.median(times)
                print(f"{backend:9s} rollers=1 busy: " + " ".join(f"{t:.3f}" for t in times), flush=True)
            cluster.detach()
    finally:
        cluster.close()
    results["memcpy_s"] = _memcpy_s(num_bytes, 3)
    order = ["sync_s_shm", "sync_s_shm_busy", "sync_s_zmq", "sync_s_broadcast", "memcpy_s"]
    keys = [k for k in order if k in results] + sorted(k for k in results if k not in order)
    print("RESULT " + " ".join(f"{k}={results[k]:.3f}" for k in keys) + f" bytes={num_bytes}", flush=True)


if __name__ == "__main__":
    main()
