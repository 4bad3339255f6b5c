"""The A/B behind bench/README.md's prepacked-linear record: in one process, alternating, the torch engine
with prepacked linears, the same engine without them (``pack_linears`` replaced by a no-op), and HF
``generate``; each on its own copy of SmolLM2-135M-Instruct, uniform batches of 8 and 32 × 32 new tokens,
5 repetitions. Run from the repository root: ``.venv/bin/python bench/recorded/engine_packed/ab_packed.py``."""

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common.env import set_torch_threads, setup_process_env  # noqa: E402

setup_process_env(num_threads=2)
set_torch_threads(2)

import engine_bench as eb  # noqa: E402

import rollers.torch_engine as te  # noqa: E402
from common.models import ModelConfig, load_model, load_tokenizer  # noqa: E402

REAL_PACK = te.pack_linears
cfg = ModelConfig(path="smollm2-135m-instruct")
tok = load_tokenizer(cfg)
packed_model, plain_model, hf_model = (load_model(cfg, device="cpu") for _ in range(3))


def engine(model, packed: bool, requests, slots: int) -> float:
    te.pack_linears = REAL_PACK if packed else (lambda model: 0)
    return eb.run_engine(model, tok, requests, slots)


for batch in (8, 32):
    requests = eb.make_requests(tok, [32] * batch)
    engine(packed_model, True, requests[:2], 2)
    engine(plain_model, False, requests[:2], 2)
    eb.run_hf(hf_model, tok, requests[:2], 2)
    res = {"packed": [], "plain": [], "hf": []}
    for rep in range(5):
        order = [("packed", engine, (packed_model, True, requests, batch)),
                 ("plain", engine, (plain_model, False, requests, batch)),
                 ("hf", eb.run_hf, (hf_model, tok, requests, batch))]
        for key, fn, args in order if rep % 2 == 0 else order[::-1]:
            res[key].append(batch * 32 / fn(*args))
        print(batch, rep, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
    for key, values in res.items():
        print(batch, key, f"median {statistics.median(values):.1f} min {min(values):.1f} max {max(values):.1f}")
    print(batch, "packed/plain", [round(a / b, 3) for a, b in zip(res["packed"], res["plain"], strict=True)],
          "packed/hf", [round(a / b, 3) for a, b in zip(res["packed"], res["hf"], strict=True)], flush=True)
