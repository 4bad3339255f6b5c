"""``disk``: each bucket is a safetensors file in the directory of its ``weight_version``
(``checkpointengine.disk_dir``, or a temp dir the leader removes on close) that rollers read;
``BucketReady.path`` names the file."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass

from checkpointengine.backend import WeightSyncBackend, register_backend
from checkpointengine.backend_sides import BackendReceiver, BackendSender
from checkpointengine.backends._whole import whole_buckets, whole_entries
from checkpointengine.protocol import BucketReady
from checkpointengine.storage import DiskVersions, read_bucket_file


@dataclass(frozen=True)
class DiskFields:
    """``disk_dir``: where the directories (one per ``weight_version``) are written."""

    disk_dir: str = ""


class DiskSender(BackendSender):
    def __init__(self, cfg, fields: DiskFields, disk: DiskVersions | None = None, own_dir: str = ""):
        super().__init__(cfg, fields)
        self.disk = disk  # the leader's directories, one per weight_version (other ranks write nothing)
        self.own_dir = own_dir  # a temp dir this sender made (removed by close)

    @classmethod
    def create(cls, cfg) -> DiskSender:
        own = "" if cfg.disk_dir else tempfile.mkdtemp(prefix="hflow-ce-disk-")
        fields = DiskFields(cfg.disk_dir or own)
        return cls(cfg, fields, DiskVersions(fields.disk_dir), own)

    def full_body(self, sender, stream):
        def run(rnd) -> tuple[int, int]:
            self.disk.begin(rnd.weight_version)
            index = total = 0
            for bucket in whole_buckets(sender, stream):
                path = self.disk.write_bucket(rnd.weight_version, index, bucket)
                entries = whole_entries(bucket)
                used = sum(e.nbytes for e in entries)
                sender.control.broadcast(rnd, BucketReady(rnd.weight_version, index, entries, used, path=path))
                index += 1
                total += used
            self.disk.finish(rnd.weight_version, total)
            return index, total

        return run

    def close(self) -> None:
        if self.own_dir:
            shutil.rmtree(self.own_dir, ignore_errors=True)
            self.own_dir = ""


class DiskReceiver(BackendReceiver):
    def bucket_tensors(self, msg, frames, unpacker, copy, consumed):
        out = list(read_bucket_file(msg.path, msg.entries, self.device))
        consumed()
        yield from out


DISK = register_backend("disk", WeightSyncBackend(DiskSender, DiskReceiver, DiskFields))
