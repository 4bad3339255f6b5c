"""TrainerGroup: ``trainer.num_ranks`` Ray actors forming one FSDP2 process group, driven as one trainer.

::

    driver (controller)                          placement group: num_ranks bundles {CPU: c[, GPU: 1]}
      TrainerGroup.train_step(meta) ──shard ids by uid──> rank 0: TrainerActor(TrainerWorker) ─┐ gloo/nccl
                                     (whole groups)      rank 1: TrainerActor(TrainerWorker) ─┤ collectives
                                     <──metrics───────    ...                                 ─┘
      each rank fetches its own samples from the TransferQueue (no tensor passes through the driver);
      metrics from rank 0 (every rank computes the same global metrics)

Rendezvous (``rendezvous_host``): when every rank is on one Ray node, rank 0's actor picks a free port on
its node's loopback and the ranks meet at ``127.0.0.1:port``; when the placement group spreads them over
several Ray nodes (``PACK`` fills one node first), rank 0 binds ``trainer.host`` (``node``: its own Ray
node address, resolved in rank 0's process) and the ranks meet at the address rank 0 reports. The store
listens on that one address only (``common.net.tcp_store``); gloo/NCCL then connect rank to rank: gloo on
the interface each rank finds on the rendezvous address's network (loopback: ``lo``; a rank on another
network: its Ray node address's interface), unless ``GLOO_SOCKET_IFNAME`` is set (``common.net.
gloo_interface``); NCCL on the interface its own ``NCCL_SOCKET_IFNAME`` picks.

Errors: an exception raised inside any rank reaches the caller as the original exception (same type and
message) with a note naming the rank and method. A rank whose process dies fails the call at once with
``TrainerRankLost`` naming the rank, the method and the cause (the other ranks may be blocked in a collective:
the caller does not wait for them; ``shutdown()`` the group). Every wait is bounded by ``trainer.timeout_s``
(TimeoutError). Validation errors are raised by every rank before any collective, so the group stays
usable; an exception in the middle of a collective leaves the group unusable — ``shutdown()`` it.
"""

from __future__ import annotations

import ipaddress
import time

from common import schema
from common.env import LOOPBACK
from common.models import ModelConfig
from common.net import NODE_HOST
from trainers.batching import shard_for_ranks
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.worker import TrainerActor


class TrainerRankLost(RuntimeError):
    """A trainer rank's process died (``rank``, the ``method`` it was running); the cause is chained."""

    def __init__(self, rank: int, method: str, cause: BaseException):
        self.rank, self.method = rank, method
        super().__init__(f"trainer rank {rank} was lost in {method}: {type(cause).__name__}: "
                         f"{str(cause).strip().splitlines()[0] if str(cause).strip() else 'no detail'}")


def rendezvous_host(host: str, rank_nodes: list[str]) -> str:
    """The address trainer rank 0 binds for the ranks' rendezvous (``node`` is resolved by rank 0 itself,
    ``TrainerActor.rendezvous_address``): loopback when every rank is on one Ray node (``rank_nodes``: each
    rank's Ray node id), else ``host`` (``trainer.host``: ``node`` or an IPv4 address of rank 0's node).
    Raises ValueError naming ``trainer.host`` when the ranks span nodes and ``host`` is a loopback address,
    which the other nodes cannot reach."""
    if len(set(rank_nodes)) <= 1:
        return LOOPBACK
    if host != NODE_HOST and ipaddress.IPv4Address(host).is_loopback:
        raise ValueError(f"the {len(rank_nodes)} trainer ranks were placed on {len(set(rank_nodes))} Ray nodes, but "
                         f"trainer.host={host!r} is a loopback address the other nodes cannot reach: set "
                         f"trainer.host={NODE_HOST} (rank 0's Ray node address) or an address of rank 0's node, or "
                         "give trainer.resources that one node holds for every rank")
    return host


class TrainerGroup:
    """``trainer.num_ranks`` trainer ranks as Ray actors in one placement group (see the module docstring).

    ``temperature`` and ``max_response_length`` come from the ``rollout`` section. Needs Ray initialised.
    Raises ValueError for ``device=cuda`` without enough GPUs in the cluster.
    """

    def __init__(self, trainer: TrainerConfig, algorithm: AlgorithmConfig, model: ModelConfig, *,
                 temperature: float = 1.0, max_response_length: int | None = None, tq_handle: dict | None = None,
                 core_lending_dir: str | None = None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.trainer = trainer
        self.num_ranks = trainer.num_ranks
        gpus = ray.cluster_resources().get("GPU", 0)
        device = trainer.device if trainer.device != "auto" else ("cuda" if gpus >= self.num_ranks else "cpu")
        if device == "cuda" and gpus < self.num_ranks:
            raise ValueError(f"trainer.device=cuda needs {self.num_ranks} GPUs, the Ray cluster has {gpus}")
        bundle = {"CPU": trainer.num_cpus_per_rank, **({"GPU": 1} if device == "cuda" else {}), **trainer.resources}
        self._pg = placement_group([dict(bundle) for _ in range(self.num_ranks)], strategy="PACK")
        self._actors: list = []
        try:
            ray.get(self._pg.ready(), timeout=trainer.timeout_s)
            actor_cls = ray.remote(TrainerActor)
            for rank in range(self.num_ranks):
                strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
                self._actors.append(actor_cls.options(
                    num_cpus=trainer.num_cpus_per_rank, num_gpus=1 if device == "cuda" else 0,
                    resources=dict(trainer.resources),
                    scheduling_strategy=strategy,
                ).remote(trainer.num_threads))
            self.rank_nodes = self._rank_nodes()
            host = rendezvous_host(trainer.host, self.rank_nodes)
            self.rendezvous: tuple[str, int] = tuple(
                self._wait([self._actors[0].rendezvous_address.remote(host)], "rendezvous_address")[0])
            kwargs = {"trainer": trainer, "algorithm": algorithm, "model": model, "temperature": temperature,
                      "max_response_length": max_response_length, "tq_handle": tq_handle,
                      "core_lending_dir": core_lending_dir}
            backend = "nccl" if device == "cuda" else "gloo"
            self._wait([actor.setup.remote(
                rank, self.num_ranks, *self.rendezvous, backend, trainer.timeout_s, kwargs)
                for rank, actor in enumerate(self._actors)], "setup")
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------------------ plumbing

    def _rank_nodes(self) -> list[str]:
        """Each rank's Ray node id (rank r runs in bundle r of the ready placement group)."""
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(self._pg)["bundles_to_node_id"]
        rank_nodes = [nodes.get(rank, "") for rank in range(self.num_ranks)]
        assert all(rank_nodes), f"a ready placement group has a bundle without a node: {nodes}"
        return rank_nodes

    def _wait(self, refs: list, method: str) -> list:
        """``ray.get`` every ref within ``trainer.timeout_s``; re-raise a rank's exception as itself."""
        import ray

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        deadline = time.monotonic() + self.trainer.timeout_s
        while pending:  # one at a time: a dead rank fails the call now, not after the others' collective timeout
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"trainer {method}: {len(pending)} of {len(refs)} ranks did not answer within "
                                   f"trainer.timeout_s={self.trainer.timeout_s}")
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as err:
                raise TrainerRankLost(rank_of[ready[0]], method, err) from err
            except ray.exceptions.RayTaskError:
                pass  # re-raised below, in rank order
        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if isinstance(err.cause, BaseException) else err
                cause.add_note(f"(raised on trainer rank {rank} in {method})")
                raise cause from None
        return results

    def call(self, method: str, *args, **kwargs) -> list:
        """Run ``TrainerWorker.method(*args, **kwargs)`` on every rank (same arguments); per-rank results."""
        return self._wait([a.call.remote(method, *args, **kwargs) for a in self._actors], method)

    def execute(self, fn, *args, **kwargs) -> list:
        """Run ``fn(worker, *args, **kwargs)`` on every rank; per-rank results. ``fn`` must be collective-safe
        (every rank does the same collectives)."""
        return self._wait([a.execute.remote(fn, *args, **kwargs) for a in self._actors], getattr(fn, "__name__", "fn"))

    # ------------------------------------------------------------------------------------------- stages

    def train_step(self, meta) -> dict[str, float]:
        """One trainer step on the samples of ``meta`` (a ``transferqueue.records.BatchMeta``): every rank
        fetches its own whole ``uid`` groups from the TransferQueue — no tensor passes through the caller —
        and runs ``TrainerWorker.train_step``. Returns the step's metrics. Needs ``tq_handle``."""
        uid = [tag.get(schema.UID) for tag in meta.tags]
        shards = shard_for_ranks(uid, self.num_ranks, self.trainer.ppo_mini_batch_size)
        refs = []
        for actor, shard in zip(self._actors, shards, strict=True):
            part = type(meta)(meta.partition, [meta.sample_ids[i] for i in shard.indices], list(meta.fields),
                              [meta.tags[i] for i in shard.indices], dict(meta.schemas), meta.task)
            refs.append(actor.call.remote("train_step", part.to_wire(), shard.mini_batch_sizes))
        return self._wait(refs, "train_step")[0]

    def get_weight_version(self) -> int:
        """The trainer's ``weight_version`` (completed actor updates; the same on every rank)."""
        return self.call("get_weight_version")[0]

    def save_checkpoint(self, path: str) -> None:
        """Every rank writes its shards of one DCP checkpoint directory (``trainers/checkpoint.py``)."""
        self.call("save_checkpoint", str(path))

    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint (saved with any number of ranks). Raises FileNotFoundError without one."""
        self.call("load_checkpoint", str(path))

    def export_model(self, path: str) -> None:
        """Write the policy as a Hugging Face model directory (safetensors, config, tokenizer, chat template)
        at ``path``, on rank 0's node (``trainers/export.py``). Raises FileExistsError if ``path`` exists."""
        self.call("export_model", str(path))

    def shutdown(self) -> None:
        """Kill the rank actors and remove the placement group. Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

