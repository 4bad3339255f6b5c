"""One line per config key: what ``hflow-async show-config --describe`` prints beside each key.

``KEY_DOCS`` maps every dotted key of the config tree (``controller.config.HFlowConfig``) to a one-line
description; the dataclass docstrings of each section (``rollers/config.py``, ``trainers/config.py``, ...)
hold the longer story. A test checks that every key has a line and every line a key, so a new key
without a description fails the suite. Units are in the key name or the line: lengths in tokens, times
in seconds, sizes in bytes.

Two settings need more than a line:

* ``old_log_probs`` (``algorithm.bypass_mode``, ``trainers/rollout_corr.py``). ``null`` (the default):
  ``true`` where trained samples can come from older weights (``one-step-off``; ``fully-async`` with
  ``max_staleness >= 1``) and ``stale_correction`` is ``none``, else ``false``; ``show-config`` prints the
  choice. ``false``: the trainer's own log-probs before the update, recomputed with one extra forward, except when that
  forward provably gives the first training forward's numbers: every sample's ``min_weight_version`` and
  ``max_weight_version`` equal the trainer's ``weight_version`` (``sync``; ``fully-async`` at staleness 0;
  the first step of ``one-step-off``), ``trainer.ppo_epochs`` is 1 with one mini-batch
  (``trainer.ppo_mini_batch_size`` = the step's prompts), and no ``algorithm.use_kl_in_reward``. Then the
  loss takes the training forward's log-probs, detached, and the step reports
  ``actor/old_log_prob_recomputed`` 0. ``true`` (verl's bypass mode): the rollers' ``rollout_log_probs``
  are ``old_log_probs`` in every mode, no extra forward; refused with a ``stale_correction``. Each step
  reports ``rollout_corr/kl``, ``rollout_corr/k3_kl`` and ``rollout_corr/max_abs_diff`` (rollout vs
  trainer log-probs on response tokens) whenever both exist.
* ``rollers.num_threads`` / ``trainer.num_threads`` (``controller/resources.py``): ``auto`` (the
  default) or an integer; see ``plan_threads``.
"""

from __future__ import annotations

import dataclasses
import re

from controller.config import HFlowConfig, to_yaml

KEY_DOCS: dict[str, str] = {
    # root
    "mode": "the schedule: sync | one-step-off | fully-async (README, 'Choosing a mode')",
    "run_dir": "where the run writes its outputs; empty = runs/<timestamp>; must be new or empty",
    # model
    "model.path": "tiny | smollm2-135m-instruct | a local Hugging Face model directory",
    "model.dtype": "parameter dtype of trainers and rollers: float32 | bfloat16 | float16",
    "model.compute_dtype": "dtype forwards compute in, rollers hold; auto: bfloat16 where native, else model.dtype",
    "model.tiny.hidden_size": "tiny model: hidden size",
    "model.tiny.intermediate_size": "tiny model: MLP intermediate size",
    "model.tiny.num_hidden_layers": "tiny model: number of decoder layers",
    "model.tiny.num_attention_heads": "tiny model: attention heads (must divide hidden_size)",
    "model.tiny.num_key_value_heads": "tiny model: key/value heads (grouped-query attention)",
    "model.tiny.max_position_embeddings": "tiny model: context length in tokens",
    "model.tiny.vocab_size": "tiny model: vocabulary size; 0 = the tiny tokenizer's size",
    "model.tiny.tie_word_embeddings": "tiny model: share input and output embeddings",
    "model.tiny.seed": "tiny model: seed of its random initial weights (every process builds the same model)",
    # data
    "data.task": "a registered task (tiny_repeat), a task plug-in module:name, a reasoning-gym task, or a "
                 ".jsonl / .parquet file",
    "data.task_kwargs": "options of the task: a reasoning-gym task's (e.g. min_terms), tiny_repeat's "
                        "num_symbols",
    "data.size": "examples generated for a procedural task (a file uses all its rows)",
    "data.seed": "seed of a procedural task's examples and of the per-epoch shuffle",
    "data.prompt_key": "a data file's column holding the prompt",
    "data.answer_key": "a data file's column holding the answer (the reward's ground truth)",
    "data.system_prompt": "a system turn put before every prompt by the chat template; empty = none",
    "data.train_batch_size": "prompts per trainer step (each sampled rollout.n times)",
    "data.max_prompt_length": "longest prompt in tokens after the chat template; longer ones are an error",
    "data.skip_long_prompts": "skip (and count) prompts over data.max_prompt_length instead of failing",
    "data.epochs": "passes over the data available to the run (trainer.total_steps must fit in them)",
    "data.drop_last": "drop an epoch's final partial batch instead of training it as a shorter step",
    "data.shuffle": "reshuffle the prompts each epoch (with data.seed + epoch)",
    "data.val_size": "held-out prompts for validation, drawn after the training rows (or from data.val_file); "
                     "0 = none",
    "data.val_file": "a .jsonl / .parquet file of validation prompts (its first data.val_size rows); empty:"
                     " rows of data.task",
    "data.val_disjoint": "held-out prompts never repeat a training prompt's text (rows that do are passed "
                         "over); false: any rows",
    # rollout
    "rollout.n": "samples generated per prompt (the GRPO group size)",
    "rollout.temperature": "sampling temperature (> 0)",
    "rollout.top_p": "nucleus sampling threshold in (0, 1]; 1 = off",
    "rollout.top_k": "sample among the k most likely tokens; -1 = off",
    "rollout.max_response_length": "longest response in tokens; a longer one is cut (finish_reason=length)",
    "rollout.seed": "base of the per-sample seeds (responses do not depend on batching or schedule)",
    "rollout.reward": "auto (data.task's reward) | reasoning_gym | tiny_repeat | math_verify | "
                      "module:function",
    "rollout.reward_timeout_s": "seconds one reward call may take before its group is marked failed",
    "rollout.reward_max_concurrency": "reward calls one roller runs at once",
    "rollout.max_resubmits": "times one sample may be paused (abort mode) and resumed before it fails",
    "rollout.forced_response_lengths": "benchmarks: [[weight, min, max], ...] forced lengths, EOS ignored; [] = off",
    "rollout.environment": "multi-turn: a registered environment (calculator | module:name); empty = single-turn",
    "rollout.max_turns": "multi-turn: most model turns in one trajectory",
    "rollout.env_timeout_s": "multi-turn: limit of one environment or tool call (seconds)",
    "rollout.env_kwargs": "multi-turn: options of the environment (the keys it declares, e.g. gem's env_id)",
    # rollers
    "rollers.num_replicas": "roller processes generating in parallel",
    "rollers.engine": "torch (in-process engine) | sglang (client of an SGLang server)",
    "rollers.num_threads": "torch threads per roller process",
    "rollers.max_batch_slots": "sequences decoded at once by the torch engine (continuous batching)",
    "rollers.sglang_url": "an SGLang server to use instead of launching one (sglang engine only)",
    "rollers.sglang_launch": "what a launched server runs: sglang (needs a GPU) | torch (our engine, SGLang's API)",
    "rollers.sglang_mem_fraction": "SGLang's --mem-fraction-static for a launched server",
    "rollers.sglang_colocated": "the trainer shares the launched server's GPU (adds --enable-memory-saver)",
    "rollers.sglang_startup_timeout_s": "seconds to wait for a launched server's /health",
    "rollers.sglang_request_timeout_s": "seconds one /generate request may take",
    "rollers.sglang_max_retries": "/flush_cache retries (exponential backoff) during a weight update",
    "rollers.resources": "Ray custom resources each roller asks for, e.g. {hflow_roller: 1}: places the pool",
    "rollers.on_failed_group": "a failed group: fail (stop the run) | skip (train on; fully-async admits a fresh "
                               "prompt instead)",
    "rollers.health_timeout_s": "seconds a roller may leave a health check or weight update unanswered; "
                                "then it is replaced",
    "rollers.max_replicas": "the most rollers a scale request (hflow-async scale) may ask for",
    "rollers.min_replicas": "the fewest rollers the autoscaler keeps",
    "rollers.autoscale": "resize the pool on RL signals (trainer starved: add; staleness cap: remove)",
    "rollers.autoscale_wait_share": "autoscale: share of time the trainer waits for data that adds a roller",
    "rollers.autoscale_period_s": "autoscale: seconds between decisions (the window its signals average)",
    "rollers.max_restarts": "replacements of lost rollers over the run; past it the pool shrinks",
    "rollers.fault_injection": "tests: ROLLER:FAULT:TRIGGER=N[:SECONDS] (kill|hang|slow, group|weight_sync); "
                               "[] = off",
    # trainer
    "trainer.num_ranks": "FSDP2 trainer processes (data parallel)",
    "trainer.total_steps": "trainer steps (updates) the run makes, then it stops",
    "trainer.ppo_mini_batch_size": "prompts per optimizer step (x rollout.n samples); <= data.train_batch_size",
    "trainer.ppo_micro_batch_size": "samples per forward/backward pass (gradient accumulation inside a mini-batch)",
    "trainer.ppo_max_token_len_per_gpu": "tokens per pass per rank (samples x longest), 0 = off: verl's dynamic batch size",
    "trainer.prefix_grouper": "forward each prompt once for all its samples (shared-prefix mask, same results)",
    "trainer.ppo_epochs": "passes over each step's batch",
    "trainer.lr": "policy learning rate (AdamW)",
    "trainer.weight_decay": "AdamW weight decay",
    "trainer.betas": "AdamW betas",
    "trainer.lr_schedule": "constant | cosine (after trainer.warmup_steps)",
    "trainer.warmup_steps": "linear learning-rate warm-up, in trainer steps",
    "trainer.max_grad_norm": "gradient clipping by global norm",
    "trainer.save_every": "job checkpoint (for --resume RUN_DIR) every N steps, at a stop and at the end; 0 = never",
    "trainer.keep_checkpoints": "job checkpoints kept (the latest); 0 = all",
    "trainer.max_restarts": "restarts of the trainer group alone from the latest job checkpoint; 0 = fail",
    "trainer.val_every": "validate every N trainer steps (also before the first and after the last); 0 = only "
                         "those two",
    "trainer.num_threads": "torch threads per trainer rank (the most: fully-async core lending yields decoding rollers' cores)",
    "trainer.use_reference": "keep a frozen reference policy (needed by KL loss or KL in reward)",
    "trainer.critic_lr": "the critic's learning rate (adv_estimator=gae only)",
    "trainer.device": "auto (cuda when each rank has a GPU) | cpu | cuda",
    "trainer.num_cpus_per_rank": "Ray logical CPUs reserved per trainer rank",
    "trainer.resources": "Ray custom resources each trainer rank asks for, e.g. {hflow_trainer: 1}",
    "trainer.timeout_s": "bound in seconds on every collective and every call the controller waits for",
    "trainer.host": "rendezvous address when ranks span Ray nodes: IPv4 of rank 0's node | node (its Ray address)",
    # algorithm
    "algorithm.adv_estimator": "advantage estimator: grpo | rloo | gae | ... (README, Algorithms) | module:name",
    "algorithm.norm_adv_by_std": "GRPO: divide advantages by the group's reward std",
    "algorithm.gamma": "discount factor (GAE, REINFORCE++)",
    "algorithm.lam": "GAE lambda",
    "algorithm.clip_ratio_low": "PPO clip: ratio lower bound is 1 - clip_ratio_low",
    "algorithm.clip_ratio_high": "PPO clip: ratio upper bound is 1 + clip_ratio_high (DAPO clip-higher)",
    "algorithm.dual_clip_c": "dual-clip PPO constant for negative advantages; 0 = off, else > 1",
    "algorithm.loss_agg_mode": "how token losses average: token-mean | seq-mean-token-mean | ... or module:name",
    "algorithm.policy_loss": "policy loss: vanilla (PPO) | gspo | ... (README, Algorithms) | module:name",
    "algorithm.sapo_tau_pos": "sapo: gate temperature for positive advantages",
    "algorithm.sapo_tau_neg": "sapo: gate temperature for negative advantages",
    "algorithm.clip_cov_ratio": "clip_cov: fraction of tokens whose gradient is detached",
    "algorithm.clip_cov_lb": "clip_cov: lower bound of the covariance window",
    "algorithm.clip_cov_ub": "clip_cov: upper bound of the covariance window",
    "algorithm.kl_cov_ratio": "kl_cov: fraction of tokens penalised",
    "algorithm.kl_cov_coef": "kl_cov: coefficient of the penalty",
    "algorithm.dppo_ratio_cap": "dppo_tv / dppo_kl: truncation of the importance ratio",
    "algorithm.entropy_coeff": "weight of the entropy bonus; 0 = off",
    "algorithm.use_kl_loss": "add a KL(policy || reference) term to the loss (needs trainer.use_reference)",
    "algorithm.kl_loss_coef": "weight of the KL loss",
    "algorithm.kl_estimator": "KL estimator of the KL loss: k1 | k2 | k3 | low_var_kl | mse | ... or module:name",
    "algorithm.use_kl_in_reward": "subtract a KL penalty from the reward (needs trainer.use_reference)",
    "algorithm.kl_in_reward_coef": "starting coefficient of the KL-in-reward penalty",
    "algorithm.kl_in_reward_estimator": "KL estimator of the KL-in-reward penalty",
    "algorithm.kl_ctrl_type": "KL-in-reward coefficient: fixed | adaptive (towards kl_target)",
    "algorithm.kl_target": "adaptive KL target, nats per token",
    "algorithm.kl_horizon": "adaptive KL horizon, in samples",
    "algorithm.cliprange_value": "critic value clipping (GAE only)",
    "algorithm.dynamic_sampling": "DAPO: replace each group whose rewards all agree by a fresh prompt",
    "algorithm.max_refill_rounds": "DAPO: replacements per batch slot before a zero-variance group is trained as is",
    "algorithm.overlong_buffer_len": "DAPO soft overlong penalty over the last N tokens before the limit; 0 = off",
    "algorithm.overlong_penalty_factor": "DAPO: the overlong penalty at the length limit",
    "algorithm.stale_correction": "off-policy correction of stale samples: none | decoupled | tis",
    "algorithm.tis_cap": "tis: cap of the truncated importance weight",
    "algorithm.bypass_mode": "old_log_probs: true rollers', false trainer's; null (default) true if samples can be stale, no correction",
    "algorithm.max_staleness": "fully-async: most versions a trained sample may lag the trainer (admission bound)",
    "algorithm.stale_policy": "fully-async: a group staler than max_staleness: drop (re-issue its prompt) | keep",
    "algorithm.require_batches": "fully-async: train batches (of data.train_batch_size prompts) per update",
    "algorithm.trigger_sync_steps": "fully-async: push weights every N updates (needs max_staleness >= N - 1)",
    # transferqueue
    "transferqueue.num_storage_units": "storage server processes holding sample tensors",
    "transferqueue.capacity_bytes": "memory each storage unit may hold, bytes",
    "transferqueue.shared_memory": "same-node clients move tensors through shared memory, not sockets",
    "transferqueue.curve": "ZMQ CURVE authentication and encryption (for sockets that leave the node)",
    "transferqueue.host": "bind address of the servers: IPv4 (loopback default) | node (the driver's Ray node address)",
    "transferqueue.request_timeout_s": "seconds one client request may wait for its reply",
    "transferqueue.route_block": "samples [k*B, (k+1)*B) live on storage unit k mod num_storage_units",
    "transferqueue.shm_min_bytes": "puts smaller than this go over ZMQ even on one node",
    "transferqueue.sampler_modules": "modules the index imports at start to register custom samplers",
    "transferqueue.start_timeout_s": "seconds to wait for the servers to start",
    "transferqueue.p2p_backend": "device path between units and clients: '' (off) | gloo | nccl",
    "transferqueue.p2p_device": "device of the p2p path's tensors: cpu | cuda (nccl needs cuda)",
    "transferqueue.max_request_ids": "most sample ids one request may name or allocate (at least 4096)",
    "transferqueue.max_client_reserved_ids": "most ids one client connection may hold reserved, not yet put",
    "transferqueue.max_reserved_ids": "most ids reserved over all clients",
    "transferqueue.reservation_lease_s": "seconds until an unused id reservation lapses (clients that went away)",
    "transferqueue.max_fields": "most fields per partition",
    "transferqueue.max_tasks": "most consumer tasks over all partitions",
    "transferqueue.max_samples": ("most samples the index holds; 0 = 4x what the job's admission holds, 2^20 "
                                   "standalone, both >= max_request_ids"),
    "transferqueue.max_partitions": "most partitions the index holds at once",
    "transferqueue.max_client_partitions": "most uncleared partitions one client connection may have created",
    "transferqueue.max_name_chars": "longest partition, field or task name, in characters",
    "transferqueue.max_subscriptions": "cached (task, field set) views per partition (LRU)",
    "transferqueue.max_parked": "most long-poll get_meta requests waiting at the index",
    "transferqueue.max_parked_bytes": "most header bytes of the waiting long-poll requests",
    "transferqueue.max_p2p_links": "most device-path links one storage unit holds",
    # checkpointengine
    "checkpointengine.backend": "how weights reach rollers: shm | zmq | broadcast (SGLang protocol) | disk",
    "checkpointengine.bucket_bytes": "size of one weight bucket, bytes",
    "checkpointengine.dtype": "dtype weights are sent in: float32 | bfloat16 | float16",
    "checkpointengine.pause_mode": "in-flight requests during an update: retract | in_place | abort",
    "checkpointengine.timeout_s": "bound in seconds on every wait of a weight update",
    "checkpointengine.num_slots": "bucket buffers the sender cycles through (2 = double buffering)",
    "checkpointengine.disk_dir": "root of the disk backend's directories, one per weight_version; empty = a temp dir",
    "checkpointengine.group_backend": "torch.distributed backend of the broadcast group: auto | gloo | nccl",
    "checkpointengine.reuse_receive_buffers": "rollers copy buckets into their previous update's tensors",
    "checkpointengine.host": "bind address of the weight plane's cross-node sockets: IPv4 (loopback) | node (rank 0's)",
    "checkpointengine.curve": "ZMQ CURVE on the weight plane's control socket (keys handed out through Ray)",
    # val
    "val.n": "validation samples per prompt at rollout.temperature (pass@1, pass@k)",
    "val.greedy": "also one greedy (temperature 0) validation response per prompt",
    "val.before_train": "validate the initial weights (weight_version 0) before the first step",
    # metrics
    "metrics.enabled": "serve the Prometheus endpoint",
    "metrics.host": "address of the Prometheus endpoint (loopback by default)",
    "metrics.port": "port of the Prometheus endpoint; 0 = a free one each run (fix it for a scrape target)",
    "metrics.progress": "print one progress line per trainer step",
    "metrics.sd_dir": "also put the job's Prometheus file_sd targets in this directory; empty = only in the run dir",
    "metrics.tensorboard": "write the metrics.jsonl scalars as TensorBoard events in RUN_DIR/tensorboard "
                           "(pip install tensorboard)",
    "metrics.wandb": "log the metrics.jsonl scalars to Weights & Biases (pip install wandb)",
    "metrics.wandb_project": "the W&B project of the run",
    "metrics.wandb_mode": "offline (files in RUN_DIR/wandb, wandb sync uploads them) | online",
    "metrics.dump_every": "every N trainer steps, decoded prompts, responses and rewards to "
                          "RUN_DIR/generations.jsonl; 0 = never",
    # ray
    "ray.address": "join a Ray cluster at HOST:PORT or auto; empty = start a local one on loopback",
    "ray.connect_timeout_s": "seconds joining ray.address waits for it to answer",
    "ray.num_cpus": "logical CPUs of a local cluster; 0 = a default for small machines",
    "ray.object_store_bytes": "object store size of a local cluster, bytes",
}


def config_keys(cls: type = HFlowConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the config tree in declaration order, dotted (``algorithm.max_staleness``); a
    dict-valued key (``data.task_kwargs``) is a leaf."""
    keys = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            keys += config_keys(sub, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<quote>'?)(?P<key>\w+)(?P=quote):(?P<rest>.*)$")


def to_described_yaml(cfg: HFlowConfig) -> str:
    """``to_yaml(cfg)`` with each key's ``KEY_DOCS`` line as a YAML comment after it (still valid YAML:
    the output can be saved and passed back with ``--config``)."""
    out, path = [], []
    for line in to_yaml(cfg).splitlines():
        m = _KEY_LINE.match(line)
        if m is None:  # a list item or a line inside a dict value
            out.append(line)
            continue
        depth = len(m["indent"]) // 2
        path = path[:depth] + [m["key"]]
        doc = KEY_DOCS.get(".".join(path))
        out.append(f"{line}  # {doc}" if doc else line)
    return "\n".join(out) + "\n"
