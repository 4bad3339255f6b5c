"""Samples generated but not yet trained, written into a job checkpoint and put back on resume.

A job checkpoint (``controller/job_checkpoint.py``) keeps the whole ``uid`` groups the rollers finished and
the trainer has not trained yet, with their tensors and tags (weight versions included), so a resumed run
trains them as they are instead of generating them again. The tensors go from the TransferQueue's storage
units to the checkpoint directory through trainer rank 0's own TransferQueue client, and back the same way:
the controller names the samples (metadata only) and never holds a tensor.

Run on every rank with ``TrainerGroup.execute`` (rank 0 does the work, the others return at once)::

    save_samples(worker, meta_wire, fields, directory) -> num_bytes   samples.safetensors + samples.json
    restore_samples(worker, directory, partition, fields) -> [uid]     put back as new samples

``samples.safetensors`` holds sample ``i``'s tensor field ``name`` under ``"{i}/{name}"`` (each sample its
own unpadded row, so groups put with different paddings keep theirs); ``samples.json`` holds the tags (one
dict per sample, as the TransferQueue index has them) and the non-tensor fields (e.g. ``ground_truth``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

TENSORS_FILE = "samples.safetensors"
INDEX_FILE = "samples.json"


def _client(worker):
    from transferqueue.client import TQClient
    from transferqueue.records import TQHandle

    if worker.tq_handle is None:
        raise RuntimeError("moving samples needs the trainer built with a TransferQueue handle (tq_handle)")
    if worker._tq_client is None:
        worker._tq_client = TQClient(TQHandle.from_dict(worker.tq_handle))
    return worker._tq_client


def save_samples(worker, meta: dict, fields: list[str], directory: str) -> int:
    """Fetch ``fields`` of the samples of ``meta`` (a ``BatchMeta`` in wire form; its tags are saved as they
    are) from the TransferQueue and write them under ``directory``; returns the bytes of tensors written
    (0 on ranks other than 0, and for an empty ``meta``). Raises the client's errors (Timeout, RemoteError
    for a cleared sample)."""
    from transferqueue.records import BatchMeta

    if worker.rank != 0:
        return 0
    batch_meta = BatchMeta.from_wire(meta)
    directory_path = Path(directory)
    directory_path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, list[Any]] = {}
    if batch_meta.sample_ids:
        data = _client(worker).get_data(batch_meta, fields)
        for name in fields:
            value = data[name]
            for i in range(len(batch_meta.sample_ids)):
                item = value[i]
                if isinstance(item, torch.Tensor):
                    tensors[f"{i}/{name}"] = item.detach().cpu().contiguous().clone()
                else:
                    objects.setdefault(name, []).append(item)
    save_file(tensors, str(directory_path / TENSORS_FILE))
    index = {"num_samples": len(batch_meta.sample_ids), "fields": list(fields), "tags": batch_meta.tags,
             "objects": objects}
    (directory_path / INDEX_FILE).write_text(json.dumps(index))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_samples(directory: str | Path) -> tuple[list[dict], dict[str, list[Any]]]:
    """The tags (one dict per sample) and fields (name -> one value per sample) :func:`save_samples` wrote.
    Raises FileNotFoundError when ``directory`` lacks them, ValueError when they disagree."""
    directory = Path(directory)
    index = json.loads((directory / INDEX_FILE).read_text())
    tensors = load_file(str(directory / TENSORS_FILE))
    count = int(index["num_samples"])
    fields: dict[str, list[Any]] = {}
    for name in index["fields"]:
        if name in index["objects"]:
            fields[name] = list(index["objects"][name])
        else:
            fields[name] = [tensors[f"{i}/{name}"] for i in range(count)]
        if len(fields[name]) != count:
            raise ValueError(f"{directory}: field {name!r} has {len(fields[name])} of {count} samples")
    if len(index["tags"]) != count:
        raise ValueError(f"{directory}: {len(index['tags'])} tags for {count} samples")
    return index["tags"], fields


def restore_samples(worker, directory: str, partition: str, fields: list[str]) -> list[str]:
    """Put the samples :func:`save_samples` wrote under ``directory`` back into ``partition`` as new samples
    with their saved tags (weight versions unchanged), only their fields among ``fields``; returns their
    ``uid`` tags in order (``[]`` on ranks other than 0). Leaving out a field the rollers take prompts by
    (``ground_truth``) keeps the rollers from generating them again. Raises ValueError naming a field of
    ``fields`` the checkpoint lacks."""
    if worker.rank != 0:
        return []
    tags, saved = read_samples(directory)
    if not tags:
        return []
    missing = [name for name in fields if name not in saved]
    if missing:
        raise ValueError(f"the checkpoint's samples in {directory} lack fields {missing} (they have {sorted(saved)})")
    _client(worker).put({name: saved[name] for name in fields}, partition, tags=tags)
    return [str(t.get("uid")) for t in tags]
