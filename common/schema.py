"""The sample contract: every field the feeder, rollers, trainers and controller put and read, declared once.

A *field* is a tensor (or a list of str, one per row) stored in the TransferQueue, batch first; a *tag* is
a small per-sample value the TransferQueue index keeps beside it (the controller reads tags, never
tensors). ``FIELDS`` declares each by name with its dtype and shape; the ``Stage`` records say which
stage puts and reads which, in pipeline order (``STAGES``)::

    feeder      puts one prompt row per group       input_ids attention_mask ground_truth | uid (seed_key)
    roller      reads that row, puts rollout.n      input_ids attention_mask responses response_mask
                sample rows per group               rollout_log_probs token_level_scores (remax_baseline,
                                                    response_text) | uid min/max_weight_version
                                                    finish_reason response_length reward response_digest greedy
    trainer     reads the sample rows; its stages   old_log_probs ref_log_prob values token_level_rewards
                compute the rest in memory          advantages returns (never put on the wire)
    controller  reads the tags of trained groups (step record, staleness, DAPO), validation rounds and
                generation dumps (prompt text and ground truth from the feeder's own prompts, by uid)

Shapes name their dims: ``batch``, ``prompt_len`` (left-padded: ``pad_side`` "left") and
``response_len`` (right-padded); the pad value is 0. Prompts are stored once per group (the prompt row);
the roller writes the prompt beside each of its samples, since the trainer reads it per sample.
``check_batch(stage, data, tags)`` checks a put against its stage (the feeder and the rollers' channel
call it): no undeclared field, every required one, dtypes and consistent dims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Field:
    """One field or tag of the contract. ``dtype``: a torch dtype name (``int64``, ``float32``) for a
    tensor; ``str`` for a list of str (one per row) or a str tag; ``int``/``float`` for a numeric tag.
    ``shape``: the named dims of a field, batch first; ``()`` for a tag. ``tag``: a per-sample tag of the
    TransferQueue index, not a stored field."""

    name: str
    dtype: str
    shape: tuple[str, ...]
    doc: str
    tag: bool = False

    @property
    def pad_side(self) -> str:
        """Where variable-length rows are padded: ``left`` for prompts, ``right`` otherwise."""
        return "left" if "prompt_len" in self.shape else "right"


FIELDS: dict[str, Field] = {}


def _declare(name: str, dtype: str, shape: tuple[str, ...], doc: str, tag: bool = False) -> str:
    FIELDS[name] = Field(name, dtype, shape, doc, tag)
    return name


_PROMPT, _RESPONSE, _ROWS = ("batch", "prompt_len"), ("batch", "response_len"), ("batch",)

# Fields stored in the TransferQueue.
INPUT_IDS = _declare("input_ids", "int64", _PROMPT, "left-padded prompt tokens")
ATTENTION_MASK = _declare("attention_mask", "int64", _PROMPT, "1 on real prompt tokens")
GROUND_TRUTH = _declare("ground_truth", "str", _ROWS, "the task's answer, JSON (common.ground_truth)")
RESPONSES = _declare("responses", "int64", _RESPONSE, "right-padded response tokens")
RESPONSE_MASK = _declare("response_mask", "int64", _RESPONSE, "1 on the model's tokens through the first stop token")
ROLLOUT_LOG_PROBS = _declare("rollout_log_probs", "float32", _RESPONSE,
                             "natural-log p of the sampled tokens at temperature T, 0 on padding")
TOKEN_LEVEL_SCORES = _declare("token_level_scores", "float32", _RESPONSE, "the reward on the last valid token")
REMAX_BASELINE = _declare("remax_baseline", "float32", _ROWS, "reward of the prompt's greedy response (ReMax)")
RESPONSE_TEXT = _declare("response_text", "str", _ROWS, "the decoded response, as the reward saw it (dumps)")
# Computed by the trainer in memory (never put on the wire).
OLD_LOG_PROBS = _declare("old_log_probs", "float32", _RESPONSE, "trainer log-probs before the update")
REF_LOG_PROB = _declare("ref_log_prob", "float32", _RESPONSE, "reference-model log-probs")
VALUES = _declare("values", "float32", _RESPONSE, "critic values")
TOKEN_LEVEL_REWARDS = _declare("token_level_rewards", "float32", _RESPONSE, "scores minus the in-reward KL penalty")
ADVANTAGES = _declare("advantages", "float32", _RESPONSE, "the estimator's advantages")
RETURNS = _declare("returns", "float32", _RESPONSE, "the estimator's returns")

# Per-sample tags.
UID = _declare("uid", "str", (), "the prompt group", tag=True)
SEED_KEY = _declare("seed_key", "str", (), "validation: what sampling seeds derive from instead of the uid", tag=True)
MIN_WEIGHT_VERSION = _declare("min_weight_version", "int", (), "weight version of the first response token", tag=True)
MAX_WEIGHT_VERSION = _declare("max_weight_version", "int", (), "weight version of the last response token", tag=True)
FINISH_REASON = _declare("finish_reason", "str", (), "stop | length | abort", tag=True)
RESPONSE_LENGTH = _declare("response_length", "int", (), "response tokens", tag=True)
REWARD = _declare("reward", "float", (), "the sequence reward (sum of token_level_scores)", tag=True)
RESPONSE_DIGEST = _declare("response_digest", "str", (), "hex digest of the response tokens (parity checks)", tag=True)
GREEDY = _declare("greedy", "int", (), "1 for a greedy (temperature 0) response, 0 for a sampled one", tag=True)

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class Stage:
    """What one stage reads and puts. ``puts``: always put; ``optional_puts``: put only when configured
    (the estimator's roller extras, dump text, a validation seed key); ``optional_reads``: read only when
    configured or present. ``wire``: its puts go to the TransferQueue (else they stay in a trainer's
    memory)."""

    name: str
    reads: tuple[str, ...] = ()
    puts: tuple[str, ...] = ()
    optional_reads: tuple[str, ...] = ()
    optional_puts: tuple[str, ...] = ()
    wire: bool = True

    def read_fields(self) -> tuple[str, ...]:
        """The stored fields (not tags) it always reads, in order."""
        return tuple(n for n in self.reads if not FIELDS[n].tag)

    def read_tags(self) -> tuple[str, ...]:
        """The tags it always reads, in order."""
        return tuple(n for n in self.reads if FIELDS[n].tag)

    def put_fields(self) -> tuple[str, ...]:
        """The stored fields (not tags) it always puts, in order."""
        return tuple(n for n in self.puts if not FIELDS[n].tag)

    def put_tags(self) -> tuple[str, ...]:
        """The tags it always puts, in order."""
        return tuple(n for n in self.puts if FIELDS[n].tag)


_RESPONSE_FIELDS = (RESPONSES, RESPONSE_MASK, ROLLOUT_LOG_PROBS, TOKEN_LEVEL_SCORES)
_RESPONSE_TAGS = (MIN_WEIGHT_VERSION, MAX_WEIGHT_VERSION, FINISH_REASON, RESPONSE_LENGTH, REWARD,
                  RESPONSE_DIGEST, GREEDY)

FEEDER = Stage("feeder", puts=(INPUT_IDS, ATTENTION_MASK, GROUND_TRUTH, UID), optional_puts=(SEED_KEY,))
ROLLER = Stage("roller", reads=(INPUT_IDS, ATTENTION_MASK, GROUND_TRUTH, UID), optional_reads=(SEED_KEY,),
               puts=(INPUT_IDS, ATTENTION_MASK, *_RESPONSE_FIELDS, UID, *_RESPONSE_TAGS),
               optional_puts=(REMAX_BASELINE, RESPONSE_TEXT))
TRAINER = Stage("trainer", reads=(INPUT_IDS, ATTENTION_MASK, *_RESPONSE_FIELDS, UID), optional_reads=(REMAX_BASELINE,))
# The trainer's own stages, on the batch it fetched (trainers/worker.py, trainers/update.py).
FORWARD = Stage("trainer.forward", reads=(INPUT_IDS, ATTENTION_MASK, RESPONSES),
                puts=(OLD_LOG_PROBS, REF_LOG_PROB, VALUES), wire=False)
COMPUTE_ADVANTAGES = Stage("trainer.compute_advantages", reads=(TOKEN_LEVEL_SCORES, RESPONSE_MASK, UID),
                           optional_reads=(VALUES, REMAX_BASELINE, OLD_LOG_PROBS, REF_LOG_PROB),
                           puts=(TOKEN_LEVEL_REWARDS, ADVANTAGES, RETURNS), wire=False)
UPDATE_ACTOR = Stage("trainer.update_actor", reads=(INPUT_IDS, ATTENTION_MASK, RESPONSES, RESPONSE_MASK,
                                                    OLD_LOG_PROBS, ADVANTAGES),
                     optional_reads=(REF_LOG_PROB, ROLLOUT_LOG_PROBS, UID), wire=False)
UPDATE_CRITIC = Stage("trainer.update_critic", reads=(INPUT_IDS, ATTENTION_MASK, RESPONSES, RESPONSE_MASK, VALUES,
                                                      RETURNS), optional_reads=(UID,), wire=False)
# The controller: whole groups ready for training (the trainer's fields), their tags for the step record.
CONTROLLER = Stage("controller", reads=(*TRAINER.read_fields(), UID, MIN_WEIGHT_VERSION, MAX_WEIGHT_VERSION, REWARD,
                                        RESPONSE_LENGTH, FINISH_REASON, RESPONSE_DIGEST))
VALIDATION = Stage("validation", reads=(RESPONSES, TOKEN_LEVEL_SCORES, UID, GREEDY, REWARD, RESPONSE_LENGTH,
                                        FINISH_REASON, MIN_WEIGHT_VERSION, MAX_WEIGHT_VERSION))
GENERATION_DUMP = Stage("generation_dump", reads=(RESPONSE_TEXT, UID, REWARD, GREEDY, MIN_WEIGHT_VERSION,
                                                  MAX_WEIGHT_VERSION, FINISH_REASON, RESPONSE_LENGTH))
# A job checkpoint saves buffered groups as the rollers put them (every stored field, the optional ones the
# run's settings turn on: ``controller.runtime.sample_fields``) with their tags, and puts them back: whatever
# reads a sample after a resume (the trainer, the generation dump) finds what it would have found before.
CHECKPOINT = Stage("checkpoint", reads=ROLLER.put_fields(), optional_reads=ROLLER.optional_puts,
                   puts=ROLLER.put_fields(), optional_puts=ROLLER.optional_puts)

STAGES = (FEEDER, ROLLER, TRAINER, FORWARD, COMPUTE_ADVANTAGES, UPDATE_ACTOR, UPDATE_CRITIC, CONTROLLER,
          VALIDATION, GENERATION_DUMP, CHECKPOINT)
DUMP_TAGS = GENERATION_DUMP.read_tags()


def check_batch(stage: Stage, data: Mapping[str, Any], tags: Sequence[Mapping[str, Any]] | None = None) -> None:
    """Check a put of ``stage``: ``data`` (field -> tensor, or list of str) holds every field of
    ``stage.puts``, none outside ``puts``/``optional_puts``, each with its declared dtype and number of
    dims, the dims of one name equal across fields (``batch`` everywhere); each tag dict of ``tags`` holds
    only the stage's tags, with their types. Raises ValueError naming the stage, the field and what was
    expected."""
    allowed = set(stage.puts) | set(stage.optional_puts)
    missing = [n for n in stage.put_fields() if n not in data]
    extra = sorted(n for n in data if n not in allowed or FIELDS[n].tag)
    if missing or extra:
        raise ValueError(f"{stage.name} puts fields {sorted(data)}: missing {missing}, undeclared {extra} "
                         f"(common.schema.{stage.name.upper()})")
    dims: dict[str, int] = {}
    for name, value in data.items():
        spec = FIELDS[name]
        if spec.dtype == "str":
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{stage.name}: field {name!r} must be a list of str, got {type(value).__name__}")
            sizes = (len(value),)
        else:
            got = str(getattr(value, "dtype", type(value).__name__)).removeprefix("torch.")
            if got != spec.dtype or value.dim() != len(spec.shape):
                raise ValueError(f"{stage.name}: field {name!r} must be {spec.dtype} {spec.shape}, got {got} "
                                 f"with {getattr(value, 'ndim', '?')} dims")
            sizes = tuple(value.shape)
        for dim, size in zip(spec.shape, sizes, strict=False):
            if dims.setdefault(dim, size) != size:
                raise ValueError(f"{stage.name}: field {name!r} has {dim}={size}, another field {dims[dim]}")
    types = {"str": str, "int": int, "float": float}
    for tag in tags or ():
        for key, value in tag.items():
            spec = FIELDS.get(key)
            if key not in allowed or spec is None or not spec.tag:
                raise ValueError(f"{stage.name} puts undeclared tag {key!r} (common.schema.{stage.name.upper()})")
            if not isinstance(value, types[spec.dtype]) or isinstance(value, bool):
                raise ValueError(f"{stage.name}: tag {key!r} must be {spec.dtype}, got {type(value).__name__}")


def train_uid(step: int, position: int) -> str:
    """The uid the feeder issues to training prompt ``position`` of step ``step``'s batch (both 0-based);
    a re-issue appends ``.r<k>``."""
    return f"s{step}.p{position}"
