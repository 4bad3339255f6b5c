"""Where bucket payloads live outside a socket: shared-memory slots (``shm``) and safetensors files
(``disk``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpointengine.bucket import TensorEntry

SHM_ROOT = Path("/dev/shm")


PROC_FD = Path("/proc/self/fd")


def _release(paths: list[str], fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


class ShmSlots:
    """``num_slots`` shared-memory buffers of ``bucket_bytes`` each: files on /dev/shm.

    On Linux the creator unlinks each file as soon as it is made and hands out
    ``/proc/<pid>/fd/<fd>`` paths, so the memory goes back to the system when the last process that
    mapped it exits, even if the sender is killed (a SIGKILLed Ray actor runs no finalizer). Elsewhere the
    named files are unlinked by ``close`` or a finalizer. Other processes of the node ``attach`` by path;
    ``buffer(slot)`` is a ``uint8`` tensor mapped on the file (writes are visible to every process that
    mapped it). Raises FileNotFoundError when attaching to a slot whose sender is gone.
    """

    def __init__(self, paths: list[str], bucket_bytes: int, owned_paths: list[str] | None = None,
                 owned_fds: list[int] | None = None):
        self.paths = list(paths)
        self.bucket_bytes = bucket_bytes
        self._buffers = [torch.from_file(p, shared=True, size=bucket_bytes, dtype=torch.uint8) for p in paths]
        self._finalizer = None
        if owned_paths is not None or owned_fds is not None:
            # The owner releases its files even if close() is never called (an exception, exit).
            self._finalizer = weakref.finalize(self, _release, owned_paths or [], owned_fds or [])

    @classmethod
    def create(cls, num_slots: int, bucket_bytes: int) -> ShmSlots:
        root = SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir())
        tag = f"hflow-ce-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        anonymous = PROC_FD.is_dir()
        paths, fds = [], []
        try:
            for slot in range(num_slots):
                path = str(root / f"{tag}-{slot}")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                fds.append(fd)
                os.ftruncate(fd, bucket_bytes)
                if anonymous:
                    os.unlink(path)
                    path = f"/proc/{os.getpid()}/fd/{fd}"
                paths.append(path)
        except BaseException:
            _release([] if anonymous else paths, fds)
            raise
        return cls(paths, bucket_bytes, owned_paths=[] if anonymous else paths, owned_fds=fds)

    @classmethod
    def attach(cls, paths: list[str], bucket_bytes: int) -> ShmSlots:
        for p in paths:
            if not os.path.exists(p):
                raise FileNotFoundError(f"shared-memory slot {p} does not exist (sender closed or gone?)")
        return cls(paths, bucket_bytes)

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def close(self) -> None:
        """Unmap; the creator also closes (and, without /proc, unlinks) its files. Idempotent."""
        self._buffers = []
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None


class DiskVersions:
    """Version directories of safetensors files, ``root/v{weight_version:08d}/bucket-{k:05d}.safetensors``,
    plus a Hugging Face ``model.safetensors.index.json`` once a weight_version is complete, so SGLang's
    ``/update_weights_from_disk`` can load the directory. Keeps the newest ``keep`` versions."""

    def __init__(self, root: str | Path, keep: int = 2):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._weight_map: dict[str, str] = {}

    def weight_version_dir(self, weight_version: int) -> Path:
        return self.root / f"v{weight_version:08d}"

    def begin(self, weight_version: int) -> Path:
        path = self.weight_version_dir(weight_version)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        self._weight_map = {}
        return path

    def write_bucket(self, weight_version: int, index: int, named: list[tuple[str, torch.Tensor]]) -> str:
        """Write one bucket's tensors (already in the engine dtype, contiguous); returns the file path."""
        path = self.weight_version_dir(weight_version) / f"bucket-{index:05d}.safetensors"
        save_file(dict(named), str(path), metadata={"weight_version": str(weight_version)})
        for name, _ in named:
            self._weight_map[name] = path.name
        return str(path)

    def finish(self, weight_version: int, total_bytes: int) -> None:
        index = {"metadata": {"total_size": total_bytes, "weight_version": weight_version},
                 "weight_map": self._weight_map}
        index_path = self.weight_version_dir(weight_version) / "model.safetensors.index.json"
        index_path.write_text(json.dumps(index, indent=1))
        versions = sorted(p for p in self.root.glob("v*") if p.is_dir())
        for old in versions[: max(0, len(versions) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)


def read_bucket_file(path: str, entries: list[TensorEntry], device: str | torch.device = "cpu"
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``entries``' tensors from a bucket file; raises ValueError when one is missing or differs
    from its declared dtype/shape."""
    tensors = load_file(path, device=str(device))
    for entry in entries:
        tensor = tensors.get(entry.name)
        if tensor is None:
            raise ValueError(f"{path} lacks tensor {entry.name!r}")
        if tensor.dtype != entry.torch_dtype or tuple(tensor.shape) != entry.shape:
            raise ValueError(f"{path}: {entry.name!r} is {tensor.dtype}{tuple(tensor.shape)}, declared "
                             f"{entry.dtype}{entry.shape}")
        yield entry.name, tensor
