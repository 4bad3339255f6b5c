"""Trainer checkpoints with ``torch.distributed.checkpoint`` (DCP): sharded, resumable, reshardable.

One checkpoint directory holds, written by all ranks together (``dcp.save``)::

    actor            policy parameters + AdamW state  (sharded: each rank writes its Shard(0) rows)
    actor_scheduler  LambdaLR state
    critic, critic_scheduler                          (when the worker has a critic)
    trainer          weight_version, world size, the KL-in-reward coefficient
    rng.rank{r}      each rank's torch (and CUDA) RNG state

``load_policy_weights`` reads only the policy's parameters into an unsharded model in one process (no
process group): what ``hflow-async export RUN_DIR --step N`` turns into a Hugging Face model directory
(``trainers/export.py``).

The reference model is not saved: it is the frozen initial policy and is rebuilt from ``model.path``.
Model and optimizer state go through ``get_state_dict``/``set_state_dict`` (FSDP2-aware, full parameter
names), so a checkpoint saved with M ranks loads with any number of ranks; the per-rank RNG states are
restored only when the number of ranks is unchanged (else a warning; they only matter for dropout-free
models' sampling-free training in the first place).

FSDP2 on CPU: a forward under ``no_grad`` leaves the root's parameters unsharded; we ``reshard()`` every
model before reading its state, otherwise the optimizer state does not line up with the parameters.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from trainers import fsdp

if TYPE_CHECKING:
    from trainers.worker import TrainerWorker

logger = logging.getLogger(__name__)


class ModelOptimizerState(Stateful):
    """A model and its optimizer as one DCP ``Stateful`` (torchtitan's pattern)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        fsdp.reshard(self.model)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class RNGState(Stateful):
    """This rank's torch CPU (and current CUDA device) RNG state."""

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        torch.set_rng_state(state_dict["cpu"])
        if "cuda" in state_dict:
            torch.cuda.set_rng_state(state_dict["cuda"])


def _trainer_state(worker: TrainerWorker) -> dict:
    return {
        "weight_version": torch.tensor(worker.weight_version, dtype=torch.long),
        "world_size": torch.tensor(worker.world_size, dtype=torch.long),
        "kl_coef": torch.tensor(worker.kl_controller.value, dtype=torch.float64),
    }


def _app_state(worker: TrainerWorker, include_rng: bool) -> dict:
    state: dict = {
        "actor": ModelOptimizerState(worker.policy, worker.actor_optimizer),
        "actor_scheduler": worker.actor_scheduler,
        "trainer": _trainer_state(worker),
    }
    if worker.critic is not None:
        state["critic"] = ModelOptimizerState(worker.critic, worker.critic_optimizer)
        state["critic_scheduler"] = worker.critic_scheduler
    if include_rng:
        state[f"rng.rank{worker.rank}"] = RNGState()
    return state


def save(path: str | Path, worker: TrainerWorker) -> None:
    """Write ``worker``'s resumable state to directory ``path`` (created). Collective: every rank calls it."""
    path = Path(path)
    if worker.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(_app_state(worker, include_rng=True), checkpoint_id=str(path))
    dist.barrier()


def load(path: str | Path, worker: TrainerWorker) -> None:
    """Restore ``worker`` from a checkpoint directory written by :func:`save` (any number of ranks).

    Raises FileNotFoundError when ``path`` holds no checkpoint, ValueError when the checkpoint lacks a
    part this worker has (e.g. a critic). Collective: every rank calls it.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no trainer checkpoint at {path} (missing {path / '.metadata'})")
    saved_keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved_parts = {key.split(".")[0] for key in saved_keys}
    if worker.critic is not None and "critic" not in saved_parts:
        raise ValueError(f"checkpoint {path} has no critic, but algorithm.adv_estimator="
                         f"{worker.algorithm.adv_estimator!r} needs one")
    has_rng = any(key.startswith(f"rng.rank{worker.rank}.") for key in saved_keys)
    state = _app_state(worker, include_rng=has_rng)
    dcp.load(state, checkpoint_id=str(path))
    trainer = state["trainer"]
    if not has_rng or int(trainer["world_size"]) != worker.world_size:
        logger.warning("checkpoint %s was saved with %d ranks, loading with %d: RNG states not restored",
                       path, int(trainer["world_size"]), worker.world_size)
    worker.weight_version = int(trainer["weight_version"])
    worker.kl_controller.value = float(trainer["kl_coef"])


def load_policy_weights(path: str | Path, model: torch.nn.Module) -> int:
    """Read only the policy parameters of checkpoint ``path`` (written by :func:`save`, any number of
    ranks) into ``model``, an unsharded model of the same architecture and dtype, in this process alone
    (no process group, no optimizer state). Returns the checkpoint's ``weight_version``.

    Raises FileNotFoundError when ``path`` holds no checkpoint; DCP raises when a parameter is missing.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no trainer checkpoint at {path} (missing {path / '.metadata'})")
    # The same keys ModelOptimizerState and _trainer_state write ("actor.model.<name>", "trainer.*");
    # DCP reads just these into the tensors of model.state_dict(), in place.
    state = {"actor": {"model": model.state_dict()}, "trainer": {"weight_version": torch.tensor(0)}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*load in a single process", category=UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return int(state["trainer"]["weight_version"])
