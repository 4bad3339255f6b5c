"""bench/trainer_bench.py runs end to end (its own process: it joins a process group) on the tiny preset, and
its shared-prompt forwards see fewer tokens than one row per sample."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_bench_smoke():
    out = subprocess.run([sys.executable, "bench/trainer_bench.py", "--preset", "tiny", "--reps", "1",
                          "--threads", "1", "--response-len", "6"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = dict(item.split("=") for item in out.stdout.strip().splitlines()[-1].removeprefix("RESULT ").split())
    assert set(result) == {"logp_s_off", "logp_s_on", "speedup_logp", "update_s_off", "update_s_on",
                           "speedup_update", "forward_tokens_off", "forward_tokens_on"}
    assert 0 < int(result["forward_tokens_on"]) < int(result["forward_tokens_off"])
