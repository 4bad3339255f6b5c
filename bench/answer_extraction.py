"""How SmolLM2-135M-Instruct answers reasoning-gym prompts, and how well ``extract_answer`` reads it.

For each setting (task kwargs, system prompt, prompt suffix) this loads SmolLM2, generates with HF
``generate`` — greedy, and ``--n`` samples at T=1.0 — with at most ``--max-new-tokens`` new tokens,
prints raw outputs with what ``rollers.rewards.extract_answer`` picked and the reward, and reports:

* ``acc_greedy``: mean reward of the greedy answers;
* ``acc_sampled``: mean reward of the T=1.0 samples;
* ``frac_var``: fraction of prompt groups (``--n`` samples) whose rewards are not all equal — what
  GRPO needs (a group with zero variance has zero advantage);
* ``unparsed``: fraction of samples where no answer could be extracted.

The final ``RESULT`` line reports the setting with the highest ``frac_var``.

    .venv/bin/python bench/answer_extraction.py            # 30 prompts, all settings
    .venv/bin/python bench/answer_extraction.py --quick    # 10 prompts, one setting
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from common.env import setup_process_env
from common.models import ModelConfig, apply_chat_template, load_model, load_tokenizer
from controller.tasks import reasoning_gym_records
from rollers.rewards import extract_answer, reasoning_gym_reward


@dataclass
class Setting:
    name: str
    task: str = "chain_sum"
    task_kwargs: dict = field(default_factory=lambda: dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1))
    system_prompt: str = ""
    suffix: str = ""


SETTINGS = [
    Setting("plain"),
    Setting("system-just-number", system_prompt="Answer with just the number."),
    Setting("suffix-just-number", suffix=" Answer with just the number."),
    Setting("3-terms-suffix", task_kwargs=dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1),
            suffix=" Answer with just the number."),
]


def generate(model, tokenizer, prompts: list[list[int]], n: int, temperature: float, max_new_tokens: int):
    """Decoded responses, ``n`` per prompt, in prompt order (left-padded batch through HF ``generate``)."""
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt", padding_side="left")
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, num_return_sequences=n)
    kwargs.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else \
        kwargs.update(do_sample=False)
    with torch.no_grad():
        out = model.generate(**batch, **kwargs)
    completions = out[:, batch["input_ids"].shape[1]:]
    return tokenizer.batch_decode(completions, skip_special_tokens=True)


def run_setting(model, tokenizer, setting: Setting, num_prompts: int, n: int, max_new_tokens: int,
                seed: int, verbose: bool) -> dict:
    records = reasoning_gym_records(setting.task, num_prompts, seed, setting.task_kwargs)
    prompts = [apply_chat_template(tokenizer, r.prompt + setting.suffix, setting.system_prompt or None)
               for r in records]
    torch.manual_seed(seed)
    greedy = generate(model, tokenizer, prompts, 1, 0.0, max_new_tokens)
    sampled = generate(model, tokenizer, prompts, n, 1.0, max_new_tokens)
    greedy_rewards, sampled_rewards, num_var, unparsed = [], [], 0, 0
    print(f"\n===== setting {setting.name}: {setting}")
    for i, record in enumerate(records):
        gt = record.ground_truth
        greedy_rewards.append(reasoning_gym_reward(greedy[i], gt))
        group = sampled[i * n:(i + 1) * n]
        rewards = [reasoning_gym_reward(text, gt) for text in group]
        unparsed += sum(extract_answer(text) is None for text in group)
        sampled_rewards.extend(rewards)
        num_var += len(set(rewards)) > 1
        if verbose:
            print(f"--- [{i}] {record.prompt!r} answer={gt['answer']!r}")
            print(f"  greedy  r={greedy_rewards[-1]:.2f} x={extract_answer(greedy[i])!r:8} {greedy[i]!r}")
            for text, r in zip(group, rewards, strict=True):
                print(f"  sample  r={r:.2f} x={extract_answer(text)!r:8} {text!r}")
    stats = dict(
        acc_greedy=statistics.mean(greedy_rewards),
        acc_sampled=statistics.mean(sampled_rewards),
        frac_var=num_var / len(records),
        unparsed=unparsed / len(sampled_rewards),
    )
    print(f"setting {setting.name}: " + " ".join(f"{k}={v:.3f}" for k, v in stats.items()))
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10 prompts, the first setting only")
    parser.add_argument("--num-prompts", type=int, default=30)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt at T=1.0")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", default="", help="comma-separated setting names (default: all)")
    parser.add_argument("--quiet", action="store_true", help="do not print raw outputs")
    args = parser.parse_args()
    setup_process_env(num_threads=args.threads)
    settings = SETTINGS
    if args.settings:
        wanted = args.settings.split(",")
        settings = [s for s in SETTINGS if s.name in wanted]
    num_prompts = args.num_prompts
    if args.quick:
        settings, num_prompts = settings[:1], 10
    cfg = ModelConfig(path="smollm2-135m-instruct")
    model, tokenizer = load_model(cfg), load_tokenizer(cfg)
    results = {}
    for setting in settings:
        start = time.perf_counter()
        results[setting.name] = run_setting(model, tokenizer, setting, num_prompts, args.n,
                                            args.max_new_tokens, args.seed, not args.quiet)
        print(f"setting {setting.name}: {time.perf_counter() - start:.1f} s")
    best = max(results, key=lambda name: results[name]["frac_var"])
    stats = results[best]
    print(f"RESULT setting={best} prompts={num_prompts} n={args.n} max_new_tokens={args.max_new_tokens} "
          + " ".join(f"{k}={v:.3f}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
