"""The ``broadcast`` backend's group and data path, following SGLang's weight-update protocol.

SGLang (``/init_weights_update_group``, ``/update_weights_from_distributed``; see
``sglang/srt/managers/io_struct.py`` ``InitWeightsUpdateGroupReqInput`` /
``UpdateWeightsFromDistributedReqInput``) forms a ``torch.distributed`` group of trainer rank 0 (rank 0)
plus every engine (rank ``rank_offset`` + its tp rank) under ``group_name``; an update then names the
tensors (``names``, ``dtypes``, ``shapes``) and rank 0 broadcasts each one, in that order. The groups
here are built the way SGLang builds them (``init_custom_process_group``): a TCP rendezvous hosted by
rank 0 and a process group of its own, independent of the process's default group, so a trainer's own
FSDP group and a roller's engine are unaffected.

This is the one implementation of that group (on torch's private ``_new_process_group_helper``, as
SGLang's is): the ``broadcast`` backend uses it on both sides (``backends/broadcast.py``), the rollers'
SGLang-API server joins with ``init_weights_update_group`` and ``SGLangEngine.load_weights`` forms one
with ``create_sender_store`` + ``create_sender_group`` (a store that listens on loopback only).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpointengine.bucket import dtype_from_name
from common import net

GROUP_BACKENDS = ("gloo", "nccl")


@dataclass
class WeightUpdateGroup:
    """A stateless broadcast group; ``rank`` 0 is the sender. ``store`` is kept alive with the group."""

    process_group: dist.ProcessGroup
    store: dist.Store
    rank: int
    world_size: int
    group_name: str
    backend: str
    master_port: int

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _rendezvous(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(c10d.rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return store


def _new_group(store: dist.Store, rank: int, world_size: int, group_name: str, backend: str,
               timeout_s: float, master_addr: str, who: str) -> dist.ProcessGroup:
    """A process group of its own under ``group_name``, built exactly as SGLang's
    ``init_custom_process_group`` does (torch's ``_new_process_group_helper``), so both sides derive
    the same store keys whichever of them is ours. A gloo group binds the interface on ``master_addr``'s
    network (``common.net.gloo_interface``: loopback for a one-node job, not the host name's address)."""
    from torch.distributed import distributed_c10d as c10d

    if backend not in GROUP_BACKENDS:
        raise ValueError(f"broadcast backend {backend!r} is not one of {list(GROUP_BACKENDS)}")
    with net.gloo_interface(master_addr, who) if backend == "gloo" else contextlib.nullcontext():
        group, _ = c10d._new_process_group_helper(
            world_size, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
            group_name=group_name, backend_options=None, timeout=datetime.timedelta(seconds=timeout_s),
        )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def create_sender_store(host: str = "127.0.0.1", port: int = 0, world_size: int = 2,
                        timeout_s: float = 120.0) -> dist.Store:
    """The rendezvous store of a new group, served by the sender on ``host``:``port`` (0 = a free port;
    read it back from ``store.port``). Call before telling the rollers to join; it does not wait for them."""
    return net.tcp_store(host, port, world_size, True, timeout_s, wait_for_workers=False)


def create_sender_group(store: dist.Store, world_size: int, group_name: str, backend: str = "gloo",
                        timeout_s: float = 120.0, host: str = "127.0.0.1") -> WeightUpdateGroup:
    """Rank 0's side of the group; blocks until all ``world_size`` members joined (or ``timeout_s``).
    ``host``: the address the store listens on (``create_sender_store``); a gloo group binds the interface
    on its network (``common.net.gloo_interface``)."""
    pg = _new_group(store, 0, world_size, group_name, backend, timeout_s, host, "weight sender")
    return WeightUpdateGroup(pg, store, 0, world_size, group_name, backend, store.port)


def init_weights_update_group(master_address: str, master_port: int, rank_offset: int, world_size: int,
                              group_name: str, backend: str = "gloo", timeout_s: float = 120.0
                              ) -> WeightUpdateGroup:
    """A roller's side of SGLang's ``/init_weights_update_group``: join as rank ``rank_offset``.

    Blocks until the group is complete; raises ValueError for a rank outside ``[1, world_size)`` or an
    unknown backend, and torch's DistStoreError/RuntimeError when the rendezvous times out.
    """
    if not 1 <= rank_offset < world_size:
        raise ValueError(f"rank_offset={rank_offset} must be in [1, world_size={world_size})")
    if backend not in GROUP_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {list(GROUP_BACKENDS)}")
    store = _rendezvous(master_address, master_port, rank_offset, world_size, timeout_s)
    pg = _new_group(store, rank_offset, world_size, group_name, backend, timeout_s, master_address,
                    f"weight receiver rank {rank_offset}")
    return WeightUpdateGroup(pg, store, rank_offset, world_size, group_name, backend, master_port)


def _broadcast(group: WeightUpdateGroup, tensor: torch.Tensor):
    return dist.broadcast(tensor, src=0, group=group.process_group, async_op=True)


def broadcast_tensors(group: WeightUpdateGroup, tensors: Iterable[torch.Tensor]) -> list:
    """Rank 0: start one broadcast per tensor (contiguous, on ``group.device``), in order; returns the
    pending works — call ``wait()`` on each before touching the tensors again."""
    works = []
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError("broadcast tensors must be contiguous")
        works.append(_broadcast(group, tensor))
    return works


def receive_tensors(group: WeightUpdateGroup, names: Sequence[str], dtypes: Sequence[str],
                    shapes: Sequence[Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """A roller's side of SGLang's ``/update_weights_from_distributed``: receive one broadcast per name.

    ``dtypes`` are names (``"bfloat16"``, also ``"torch.bfloat16"`` as SGLang clients send them);
    returns ``[(name, tensor)]`` on ``group.device``. Raises ValueError when the lists differ in length.
    """
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names/dtypes/shapes differ in length: {len(names)}/{len(dtypes)}/{len(shapes)}")
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(tuple(shape), dtype=dtype_from_name(dtype),
                             device=group.device)
        _broadcast(group, tensor).wait()
        out.append((name, tensor))
    return out


def destroy_group(group: WeightUpdateGroup | None) -> None:
    """Release a group (idempotent on ``None``)."""
    if group is None:
        return
    try:
        dist.destroy_process_group(group.process_group)
    except (RuntimeError, ValueError, KeyError):  # already torn down by a peer's exit
        pass
