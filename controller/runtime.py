"""The pools of a job, started and stopped as one: the TransferQueue servers, the prompt feeder, the
roller pool, the trainer group, and the weight-sync wiring between trainers and rollers.

::

    controller ── TQClient (metadata only: get_meta / status / clear) ──┐
        │                                                              │
        ├── PromptFeeder (Ray actor) ──put prompt groups──> TransferQueue servers (index + storage units)
        ├── RollerPool: N RollerActors (placement group) ──take group / put responses──┘   ▲
        ├── TrainerGroup: M FSDP2 ranks (placement group) ──get_data(meta slice)──────────┘
        └── weight sync: trainer rank(s) ──checkpoint engine (versioned buckets)──> every roller

Every handle that crosses a process boundary is a small dict (addresses, keys); no tensor passes
through the controller.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from controller.config import HFlowConfig

logger = logging.getLogger(__name__)

# The TransferQueue partition holding a run's samples. Not "train": that is the trainer's consumer task
# (``controller.schedules.TRAIN_TASK``; the rollers' is "rollout"), the label of hflow_queue_depth{task}.
PARTITION = "samples"


class Runtime:
    """Starts every pool of ``cfg`` (Ray must be initialised); ``close()`` stops them all, idempotently.

    ``num_batches``: prompt batches the run will consume (the feeder never produces beyond them).
    ``on_stage``: called with a short line (``"starting 2 rollers (torch engine)"``) as each pool starts.
    """

    def __init__(self, cfg: HFlowConfig, num_batches: int, on_stage: Callable[[str], None] = lambda what: None):
        import ray

        from common.schema import REMAX_BASELINE
        from controller.feeder import PromptFeeder
        from controller.tasks import resolve_reward
        from controller.validation import VAL_PARTITION
        from rollers.actor import remote_roller
        from rollers.tq_channel import GroupSource, TQGroupChannel
        from trainers.advantages import ADV_ESTIMATORS
        from trainers.group import TrainerGroup
        from trainers.weight_sync import attach_sender
        from transferqueue.client import TQClient
        from transferqueue.launch import start_transferqueue

        self.cfg = cfg
        self.tq_servers = None
        self.feeder = None
        self.rollers: list = []
        self.roller_names: list[str] = []
        self.trainer = None
        self.tq = None
        n_units, n_ranks, n_rollers = (cfg.transferqueue.num_storage_units, cfg.trainer.num_ranks,
                                       cfg.rollers.num_replicas)
        try:
            on_stage(f"starting the TransferQueue (index + {n_units} storage unit{'s' * (n_units > 1)})")
            self.tq_servers = start_transferqueue(cfg.transferqueue)
            handle = self.tq_servers.handle.to_dict()
            self.tq = TQClient(self.tq_servers.handle)
            on_stage(f"starting the prompt feeder (task {cfg.data.task})")
            self.feeder = ray.remote(num_cpus=0.1)(PromptFeeder).remote(cfg, handle, PARTITION, num_batches,
                                                                        VAL_PARTITION)
            ray.get(self.feeder.dataset_size.remote())  # surfaces data errors (too few steps, long prompts)
            on_stage(f"starting {n_ranks} trainer rank{'s' * (n_ranks > 1)} (model {cfg.model.path})")
            self.trainer = TrainerGroup(cfg.trainer, cfg.algorithm, cfg.model, temperature=cfg.rollout.temperature,
                                        max_response_length=cfg.rollout.max_response_length, tq_handle=handle)
            on_stage(f"starting {n_rollers} roller{'s' * (n_rollers > 1)} ({cfg.rollers.engine} engine)")
            roller_cls = remote_roller(num_cpus=0.5)
            roller_extras = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator).roller_extras  # e.g. ReMax's baseline
            validation = (GroupSource(VAL_PARTITION, cfg.val.n + int(cfg.val.greedy), int(cfg.val.greedy))
                          if cfg.data.val_size else None)
            channel = functools.partial(TQGroupChannel.from_handle, handle, PARTITION, cfg.rollout.n,
                                        validation=validation, put_text=cfg.metrics.dump_every > 0)
            reward = resolve_reward(cfg.rollout.reward, cfg.data.task)
            self.roller_names = [f"roller{i}" for i in range(cfg.rollers.num_replicas)]
            self.rollers = [
                roller_cls.remote(cfg.model, cfg.rollout, cfg.rollers, reward, channel,
                                  remax_baseline=REMAX_BASELINE in roller_extras, roller_id=name)
                for name in self.roller_names
            ]
            on_stage(f"connecting weight sync ({cfg.checkpointengine.backend}) and starting the rollers' loops")
            sync_handle = self.trainer.execute(attach_sender, cfg.checkpointengine,
                                               self.roller_names)[0]
            ray.get([r.attach_receiver.remote(sync_handle, name)
                     for r, name in zip(self.rollers, self.roller_names, strict=True)])
            ray.get([r.start.remote() for r in self.rollers])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop rollers, trainers, feeder and the TransferQueue servers (each at most once)."""
        import ray

        rollers, self.rollers = self.rollers, []
        if rollers:
            refs = [r.shutdown.remote(timeout_s=5.0) for r in rollers]
            ray.wait(refs, num_returns=len(refs), timeout=30)
            for r in rollers:
                ray.kill(r, no_restart=True)
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None
        if self.feeder is not None:
            ray.kill(self.feeder, no_restart=True)
            self.feeder = None
        if self.tq is not None:
            self.tq.close()
            self.tq = None
        if self.tq_servers is not None:
            self.tq_servers.shutdown()
            self.tq_servers = None
