"""The sample schema: field names shared by the feeder, rollers, trainers and the TransferQueue.

All tensors are batch-first. Prompts are left-padded, responses right-padded.

=====================  ==========================  ===========================================
field                  shape / type                meaning
=====================  ==========================  ===========================================
input_ids              (batch, prompt_len) int64   left-padded prompt tokens
attention_mask         (batch, prompt_len) int64   1 on real prompt tokens
responses              (batch, response_len) int64 right-padded response tokens
response_mask          (batch, response_len) int64 1 through the first stop token inclusive
rollout_log_probs      (batch, response_len) fp32  log p of sampled tokens at temperature T
token_level_scores     (batch, response_len) fp32  reward on the last valid response token
old_log_probs          (batch, response_len) fp32  trainer log-probs before the update
ref_log_prob           (batch, response_len) fp32  reference-model log-probs
values                 (batch, response_len) fp32  critic values
advantages, returns    (batch, response_len) fp32
=====================  ==========================  ===========================================

Per-sample tags (small, also visible to the TransferQueue index and the controller): ``uid`` (prompt
group), ``min_weight_version`` / ``max_weight_version`` (versions of the first and last response
token), ``finish_reason`` (``stop`` | ``length`` | ``abort``), ``response_length`` (tokens).
"""

from __future__ import annotations

# Tensor fields.
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
RESPONSES = "responses"
RESPONSE_MASK = "response_mask"
ROLLOUT_LOG_PROBS = "rollout_log_probs"
TOKEN_LEVEL_SCORES = "token_level_scores"
TOKEN_LEVEL_REWARDS = "token_level_rewards"
OLD_LOG_PROBS = "old_log_probs"
REF_LOG_PROB = "ref_log_prob"
VALUES = "values"
ADVANTAGES = "advantages"
RETURNS = "returns"

# Per-sample tags.
UID = "uid"
MIN_WEIGHT_VERSION = "min_weight_version"
MAX_WEIGHT_VERSION = "max_weight_version"
FINISH_REASON = "finish_reason"
RESPONSE_LENGTH = "response_length"
GROUND_TRUTH = "ground_truth"
REWARD = "reward"  # per-sample tag: the sequence reward (sum of token_level_scores), for the controller's stats
RESPONSE_DIGEST = "response_digest"  # per-sample tag: hex digest of the response token ids (parity checks)
SEED_KEY = "seed_key"  # per-sample tag (validation): what sampling seeds derive from instead of the uid
GREEDY = "greedy"  # per-sample tag: 1 for a greedy (temperature 0) response, 0 for a sampled one
PROMPT_TEXT = "prompt_text"  # batch of str: the user message before the chat template (generation dumps)
RESPONSE_TEXT = "response_text"  # batch of str: the decoded response, as the reward saw it (generation dumps)
REMAX_BASELINE = "remax_baseline"  # (batch,) fp32: reward of the prompt's greedy response (ReMax)

PROMPT_FIELDS = (INPUT_IDS, ATTENTION_MASK)
RESPONSE_FIELDS = (
    RESPONSES,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TOKEN_LEVEL_SCORES,
    MIN_WEIGHT_VERSION,
    MAX_WEIGHT_VERSION,
    RESPONSE_LENGTH,
)
FINISH_REASONS = ("stop", "length", "abort")
