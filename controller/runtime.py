"""The pools of a job, started and stopped as one: the TransferQueue servers, the prompt feeder, the
roller pool, the trainer group, and the weight-sync wiring between trainers and rollers.

::

    controller ── TQClient (metadata only: get_meta / status / clear) ──┐
        │                                                              │
        ├── PromptFeeder (Ray actor) ──put prompt groups──> TransferQueue servers (index + storage units)
        ├── RollerPool (controller.pool): N RollerActors, elastic ──take group / put responses──┘   ▲
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
        from controller.pool import RollerPool
        from controller.tasks import resolve_reward
        from rollers.actor import remote_roller
        from rollers.roller import TQGroupChannel
        from trainers.advantages import ADV_ESTIMATORS
        from trainers.group import TrainerGroup
        from transferqueue.client import TQClient
        from transferqueue.launch import start_transferqueue

        self.cfg = cfg
        self.tq_servers = None
        self.feeder = None
        self.pool: RollerPool | None = None
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
            self.feeder = ray.remote(num_cpus=0.1)(PromptFeeder).remote(cfg, handle, PARTITION, num_batches)
            ray.get(self.feeder.dataset_size.remote())  # surfaces data errors (too few steps, long prompts)
            on_stage(f"starting {n_ranks} trainer rank{'s' * (n_ranks > 1)} (model {cfg.model.path})")
            self.trainer = TrainerGroup(cfg.trainer, cfg.algorithm, cfg.model, temperature=cfg.rollout.temperature,
                                        max_response_length=cfg.rollout.max_response_length, tq_handle=handle)
            on_stage(f"starting {n_rollers} roller{'s' * (n_rollers > 1)} ({cfg.rollers.engine} engine)")
            roller_cls = remote_roller(num_cpus=0.5)
            roller_extras = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator).roller_extras  # e.g. ReMax's baseline
            channel = functools.partial(TQGroupChannel.from_handle, handle, PARTITION, cfg.rollout.n)
            reward = resolve_reward(cfg.rollout.reward, cfg.data.task)
            remax = REMAX_BASELINE in roller_extras

            def make_roller(name: str):
                return roller_cls.remote(cfg.model, cfg.rollout, cfg.rollers, reward, channel, remax_baseline=remax,
                                         roller_id=name)

            self.pool = RollerPool(cfg, make_roller, self.trainer)
            on_stage(f"connecting weight sync ({cfg.checkpointengine.backend}) and starting the rollers' loops")
            self.pool.start(n_rollers)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop rollers, trainers, feeder and the TransferQueue servers (each at most once)."""
        import ray

        if self.pool is not None:
            self.pool.close()
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
