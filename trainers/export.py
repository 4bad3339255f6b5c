"""The trained policy as a Hugging Face model directory: what ``model.path``, ``transformers``
(``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``) and an SGLang server load as they are.

One directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (the policy's
parameters in ``model.dtype``) and the tokenizer's files with its chat template, all written by
transformers' ``save_pretrained`` (model and tokenizer). Two sources, one writer (:func:`save_hf_model`):

* a live trainer, at the end of a run (``TrainerWorker.export_model``): the FSDP2 full parameters gathered
  on rank 0 (``fsdp.named_full_tensors``, tied weights once), loaded into an unsharded model on rank 0;
* a trainer checkpoint (``hflow-async export RUN_DIR --step N``): the policy part of a DCP checkpoint
  (``checkpoint.load_policy_weights``) read into an unsharded model in one process, no process group.

The directory is written under a temporary name next to ``path`` and renamed into place, so a reader
never sees half of one.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from common import models

logger = logging.getLogger(__name__)


def policy_skeleton(model_cfg: models.ModelConfig) -> torch.nn.Module:
    """An unsharded causal LM of ``model_cfg``'s architecture in ``model.dtype`` on the CPU, parameters
    allocated but uninitialised (load weights next)."""
    return models.materialize(models.build_on_meta(models.load_hf_config(model_cfg), model_cfg.torch_dtype))


def load_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Copy ``state`` (HF names, tied weights once, as ``fsdp.named_full_tensors`` yields them) into
    ``model``. Raises ValueError naming the parameters that are missing (other than a tied alias of a
    loaded one) or that ``model`` does not have."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[name].data_ptr() for name in state if name in params}
    untied = [name for name in missing if name not in params or params[name].data_ptr() not in loaded]
    if untied or unexpected:
        raise ValueError(f"policy weights do not match the model: missing {untied}, unexpected {unexpected}")
    return model


def save_hf_model(model: torch.nn.Module, model_cfg: models.ModelConfig, path: str | Path) -> Path:
    """Write ``model`` (an unsharded causal LM) and ``model_cfg``'s tokenizer as a Hugging Face model
    directory at ``path``; returns it. The source model's ``generation_config.json`` is carried over when
    it has one. Raises FileExistsError when ``path`` exists (nothing is overwritten)."""
    from transformers import GenerationConfig

    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; export into a new directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    source_dir = models.resolve_model_dir(model_cfg)
    if source_dir is not None and (source_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source_dir)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.partial-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        models.load_tokenizer(model_cfg).save_pretrained(tmp)
        _readable(tmp)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("policy written as a Hugging Face model directory: %s", path)
    return path


def _readable(directory: Path) -> None:
    """World-readable modes (``mkdtemp`` and some writers use 0700/0600), so that a server running as
    another user can read the model."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def export_state(state: dict[str, torch.Tensor], model_cfg: models.ModelConfig, path: str | Path) -> Path:
    """:func:`save_hf_model` of the full policy weights ``state`` (see :func:`load_full_state`)."""
    return save_hf_model(load_full_state(policy_skeleton(model_cfg), state), model_cfg, path)


def export_checkpoint(checkpoint_dir: str | Path, model_cfg: models.ModelConfig, path: str | Path) -> Path:
    """:func:`save_hf_model` of the policy in trainer checkpoint ``checkpoint_dir`` (written by
    ``trainers.checkpoint.save`` with any number of ranks). Raises FileNotFoundError without one."""
    from trainers import checkpoint

    model = policy_skeleton(model_cfg)
    checkpoint.load_policy_weights(checkpoint_dir, model)
    return save_hf_model(model, model_cfg, path)
