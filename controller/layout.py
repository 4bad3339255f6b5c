"""The data-plane layout of a run: its TransferQueue partitions and consumer tasks, the fields every sample
carries, and how many samples its index must hold. Below the config (which checks these at load time) and
everything that starts or saves a run; ``cfg`` is the run's ``controller.config.HFlowConfig``.
"""

from __future__ import annotations

from common import schema
from controller.ledger import max_live_groups
from trainers.advantages import ADV_ESTIMATORS

# The TransferQueue partition holding a run's samples. Not "train": that is the trainer's consumer task
# (``TRAIN_TASK``; the rollers' is "rollout"), the label of hflow_queue_depth{task}.
PARTITION = "samples"
TRAIN_TASK = "train"  # the trainer's consumer task in the TransferQueue (the rollers' is "rollout")
PROMPT_PARTITION = "prompts"  # the feeder's prompt rows (one per group), taken by the rollers' "rollout" task


def sample_fields(cfg) -> tuple[str, ...]:
    """The stored fields every training sample of this run carries: what its rollers put, i.e.
    ``common.schema.ROLLER``'s puts and the optional puts the settings turn on (``optional_sample_fields``).
    The one list: the rollers are configured from it (``roller_channel``, ``Runtime``), and a job checkpoint
    saves and puts back exactly these for each buffered sample. Raises ValueError when the estimator asks
    for a roller extra the rollers cannot put."""
    optional = optional_sample_fields(cfg.algorithm.adv_estimator, cfg.metrics.dump_every)
    return (*schema.ROLLER.put_fields(), *optional)


def optional_sample_fields(adv_estimator: str, dump_every: int) -> dict[str, str]:
    """The optional roller puts (``common.schema.ROLLER.optional_puts``, in their order) that the settings
    ``algorithm.adv_estimator`` and ``metrics.dump_every`` turn on, each with the key that turns it on: the
    estimator's roller extras (ReMax: ``remax_baseline``) and, with ``dump_every`` > 0, ``response_text``
    (read by the generation dump). Raises ValueError naming ``algorithm.adv_estimator`` when the estimator
    asks for a roller extra the rollers cannot put."""
    extras = ADV_ESTIMATORS.get(adv_estimator).roller_extras
    unknown = [name for name in extras if name not in schema.ROLLER.optional_puts]
    if unknown:
        raise ValueError(f"algorithm.adv_estimator={adv_estimator!r} asks the rollers for {unknown}; they can "
                         f"put only {list(schema.ROLLER.optional_puts)} besides their own fields")
    on = dict.fromkeys(extras, "algorithm.adv_estimator")
    if dump_every > 0:
        on[schema.RESPONSE_TEXT] = "metrics.dump_every"
    return {name: on[name] for name in schema.ROLLER.optional_puts if name in on}


def index_samples(cfg) -> int:
    """The most samples this run's TransferQueue index can hold at once (``transferqueue.max_samples`` is
    sized from it): a prompt row and ``rollout.n`` samples per group admission lets live, and one
    validation round (a prompt row, ``val.n`` samples and the greedy one per held-out prompt)."""
    groups = max_live_groups(cfg.data.train_batch_size, cfg.algorithm.max_staleness)
    return groups * (cfg.rollout.n + 1) + cfg.data.val_size * (cfg.val.n + int(cfg.val.greedy) + 1)
