"""Prometheus file-based service discovery: the job's scrape targets as a ``file_sd_configs`` JSON file.

A running job writes ``RUN_DIR/prometheus_targets.json`` (and, with ``metrics.sd_dir`` set, the same
content as ``SD_DIR/hflow-<run name>-<8 hex>.json``, so one Prometheus watching ``SD_DIR/*.json`` finds
every job without editing its config: ``deploy/prometheus/prometheus.yml``). The file is a list of target
groups (Prometheus' file_sd format, https://prometheus.io/docs/prometheus/latest/configuration/configuration/#file_sd_config)::

    [{"targets": ["127.0.0.1:9400"], "labels": {"component": "controller", "run": "NAME", "mode": "sync"}},
     {"targets": ["127.0.0.1:30001"], "labels": {"component": "sglang", "roller": "roller0", ...}}]

``component=controller`` is the job's own endpoint (the ``hflow_*`` series); ``component=sglang`` is an
SGLang server's ``/metrics`` (one group per roller, with ``rollers.engine=sglang``). Files are replaced
atomically (Prometheus may read them at any moment). When the job ends its run-directory file is emptied
(``[]``: nothing left to scrape) and its ``SD_DIR`` copy removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

TARGETS_FILE = "prometheus_targets.json"
CONTROLLER, SGLANG = "controller", "sglang"
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def scrape_address(host: str, port: int) -> str:
    """``host:port`` a Prometheus reaches an endpoint bound to ``host`` at: this machine's hostname for a
    wildcard bind (``0.0.0.0``, ``::``), brackets around an IPv6 literal."""
    if host in _WILDCARD_HOSTS:
        host = socket.gethostname()
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def url_address(url: str) -> str:
    """``host:port`` of an ``http(s)://`` URL (port 80/443 when it names none); ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://HOST[:PORT] URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return scrape_address(parts.hostname, port)


def target_groups(labels: dict[str, str], controller: str | None, sglang: dict[str, str]) -> list[dict]:
    """The file_sd target groups: the controller's ``host:port`` (None: metrics off) and ``sglang``, roller
    name -> its SGLang server's URL. ``labels`` go on every group (e.g. ``run``, ``mode``)."""
    groups = []
    if controller is not None:
        groups.append({"targets": [controller], "labels": {**labels, "component": CONTROLLER}})
    for roller, url in sorted(sglang.items()):
        groups.append({"targets": [url_address(url)], "labels": {**labels, "component": SGLANG, "roller": roller}})
    return groups


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename (a reader sees the old file or the new, never half)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class TargetsFile:
    """The targets of one job: ``run_dir/prometheus_targets.json`` and its ``sd_dir`` copy (``sd_dir``
    empty: none). ``labels``: put on every target group. ``update`` rewrites both; ``close`` empties the
    run-directory file and removes the copy (idempotent). Raises OSError when a file cannot be written."""

    def __init__(self, run_dir: str | Path, sd_dir: str | Path | None, labels: dict[str, str]):
        self.path = Path(run_dir) / TARGETS_FILE
        self.labels = dict(labels)
        self.copy: Path | None = None
        if sd_dir:
            name = Path(run_dir).resolve()
            digest = hashlib.blake2b(str(name).encode(), digest_size=4).hexdigest()
            self.copy = Path(sd_dir) / f"hflow-{name.name}-{digest}.json"
            self.copy.parent.mkdir(parents=True, exist_ok=True)
        self.controller: str | None = None
        self.sglang: dict[str, str] = {}

    def update(self, controller: str | None = None, sglang: dict[str, str] | None = None) -> None:
        """Set the controller's address and/or the SGLang servers' URLs (None: unchanged) and rewrite."""
        if controller is not None:
            self.controller = controller
        if sglang is not None:
            self.sglang = dict(sglang)
        text = json.dumps(target_groups(self.labels, self.controller, self.sglang), indent=1) + "\n"
        write_atomically(self.path, text)
        if self.copy is not None:
            write_atomically(self.copy, text)

    def close(self) -> None:
        if self.path.parent.is_dir():
            write_atomically(self.path, "[]\n")
        if self.copy is not None:
            self.copy.unlink(missing_ok=True)
