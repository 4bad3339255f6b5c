"""Core lending: on one node, the trainer of an overlapping mode takes the cores its rollers leave idle.

``fully-async``'s ``auto`` split (``controller.resources``) gives the trainer every core and the rollers half
of them on top, because training scales with cores and is the bottleneck. While a roller decodes, the
trainer's intra-op threads and the roller's then share cores, and OpenMP threads of two processes on a shared
core wait on each other: on 2 cores a SmolLM2-sized forward/backward loop ran at 0.22 iterations/s with 2
threads beside a 1-thread decoder (which ran 0.32 generate calls/s), at 0.35 with 1 thread (the decoder
0.45); alone with 2 threads at 0.53-0.62. So neither fixed split is right: the trainer wants every core
while the rollers idle (more than half the time in ``fully-async`` here) and only its own while they decode.

With core lending each roller's torch engine marks in its own small file of a per-job directory whether it
is decoding (its threads and pid, or 0), and the trainer, before each decoder layer's forward and backward
(``CoreLender.attach``), runs with its planned threads minus those of the rollers decoding now, at least one.
Per layer, not per forward: a roller turns busy and idle many times during one micro-batch's seconds of
forward and backward (decode steps of ~0.1 s, tool waits of ~0.2 s), which one decision per micro-batch
missed. A file whose pid is gone counts as idle (a killed roller cannot hold cores).
Files, not sockets: the processes share one node's file system, and a write per busy/idle change is cheap.

Measured (``bench/README.md``, main workload, 2 cores, ``fully-async`` ``r1x1-t2``, one sitting, with
``algorithm.bypass_mode=true``): 1.05 samples/s without (two runs), 1.12-1.18 with (three); with the
default ``bypass_mode=false`` no measurable change (0.79 with, 0.75-0.90 without). Per layer against per
forward, on the agentic benchmark's multi-turn work (``fully-async`` r1x1-t2, three runs each, alternating):
0.408 (0.365-0.412) against 0.366 (0.334-0.394) samples/s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class BusyFlag:
    """A roller's file in ``directory`` (created, named ``name``): ``set(True)`` while its engine decodes
    with ``threads`` torch threads, ``set(False)`` when idle; writes only on a change. Raises OSError when the
    file cannot be created; ``set`` never raises (a failed write is logged once: lending is an optimisation)."""

    def __init__(self, directory: str | os.PathLike, name: str, threads: int):
        self.path = Path(directory) / name
        self._threads, self._busy, self._warned = threads, None, False
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.set(False)

    def set(self, busy: bool) -> None:
        if busy == self._busy:
            return
        self._busy = busy
        try:  # fixed width: a reader never sees a shorter record with a stale tail
            os.pwrite(self._fd, f"{self._threads if busy else 0:6d} {os.getpid():10d}\n".encode(), 0)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                logger.warning("core lending: cannot write %s: %s", self.path, exc)

    def close(self) -> None:
        """Mark idle and close (idempotent)."""
        if self._fd is not None:
            self.set(False)
            os.close(self._fd)
            self._fd = None


class CoreLender:
    """The trainer's side: ``apply()`` sets torch's intra-op threads to ``max_threads`` minus the threads of
    the rollers decoding now (their files in ``directory``), at least 1; returns the count."""

    def __init__(self, directory: str | os.PathLike, max_threads: int):
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.directory, self.max_threads, self.current = Path(directory), max_threads, None

    def busy_threads(self) -> int:
        """Threads of the rollers decoding now (files that do not parse, or whose pid is gone, count 0)."""
        total = 0
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return 0
        for entry in entries:
            try:
                with open(entry.path, "rb") as f:
                    threads, pid = (int(x) for x in f.read(64).split()[:2])
            except (OSError, ValueError):
                continue
            if threads > 0 and _alive(pid):
                total += threads
        return total

    def apply(self) -> int:
        n = max(1, self.max_threads - self.busy_threads())
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n
        return n

    def hook(self, module, args) -> None:
        """A ``register_forward_pre_hook`` hook: ``apply()`` before each forward (returns None: inputs kept)."""
        self.apply()

    def attach(self, model: torch.nn.Module, blocks: Iterable[torch.nn.Module] = ()) -> None:
        """Re-decide the threads before ``model``'s forward and before each of ``blocks``' (e.g. the decoder
        layers) forward *and* backward: a roller turns busy or idle many times during one micro-batch's
        forward/backward of seconds, so a decision per block follows it within one block's compute (one
        per micro-batch lent cores by chance). The backward side is a hook on each block's output gradient,
        which autograd calls just before that block's backward runs."""
        model.register_forward_pre_hook(self.hook)
        for block in blocks:
            block.register_forward_pre_hook(self.hook)
            block.register_forward_hook(self._hook_output_grad)

    def _hook_output_grad(self, module, args, output) -> None:
        """A forward hook: a gradient hook on the block's output (a tensor, or the first tensor of a tuple),
        when it is part of a graph."""
        if isinstance(output, (tuple, list)):
            output = next((t for t in output if isinstance(t, torch.Tensor)), None)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._grad_hook)

    def _grad_hook(self, grad):
        self.apply()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True
