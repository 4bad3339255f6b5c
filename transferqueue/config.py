"""The ``transferqueue`` config section."""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.net import check_bind_host
from common.settings import check_settings, setting

MIN_REQUEST_IDS = 4096
DEFAULT_MAX_SAMPLES = 1 << 20  # max_samples of a TransferQueue started alone: about 150-700 MB of index
SAMPLES_HEADROOM = 4  # max_samples sized by a job: this many times what its admission can hold
P2P_BACKENDS = ("", "gloo", "nccl")
P2P_DEVICES = ("cpu", "cuda")


@dataclass
class TransferQueueConfig:
    """Data plane. ``capacity_bytes`` per storage unit; ``shared_memory`` enables the same-node fast
    path; ``curve`` enables ZMQ CURVE auth/encryption (for sockets that leave the node); ``host`` is the
    servers' bind address: loopback unless configured; one IPv4 address, or ``node`` for the launcher's
    (the driver's) Ray node address (``common.net``). Clients connect to the endpoints the servers report.

    ``route_block``: samples ``[k*route_block, (k+1)*route_block)`` live on unit ``k % num_storage_units``.
    ``shm_min_bytes``: puts smaller than this go over ZMQ frames even on one node (a shared-memory put
    costs one more round trip). ``sampler_modules``: modules the index imports at start so their
    ``register_sampler`` calls add custom samplers. ``start_timeout_s``: how long to wait for servers.

    Bounds on what requests may make the servers hold (a request past one gets an error reply naming the
    key and its value; the server keeps serving and keeps everything it had accepted). The defaults are
    far above what a training job uses:

    * ``max_request_ids``: sample ids one request may name or allocate (``put``/``get`` ids on a unit,
      ``notify``/``prepare_put`` ids on the index, a ``reserve`` or new-sample ``prepare_put`` count,
      ``get_meta`` batch size, ``sample_info`` limit; not ``clear``, which only frees). A bigger ``put``
      must be split. At least 4096 (a client reserves fresh ids 4096 at a time).
    * ``max_client_reserved_ids``: ids one client connection may hold reserved (fresh ids it has not put
      yet; each reservation counts as at least 64 ids, its bookkeeping); ``max_reserved_ids``: the same,
      summed over every client.
    * ``reservation_lease_s``: a reservation lapses this long after it was made; its unused ids are
      never handed out (ids are never reused). That is how the index forgets clients that went away;
      a client takes ids from a reservation only while its put can finish before the lease ends.
    * ``max_samples``: samples the index holds at once, over all partitions (each costs the index about
      150 bytes bare, about 700 with a training sample's tags): a ``prepare_put`` or new-sample ``notify``
      past it is refused (``LimitExceeded``) until ``clear`` frees room. 0 (the default): sized by the job
      (``sized_for``: ``SAMPLES_HEADROOM`` x what its admission can ever hold, at least ``max_request_ids``),
      ``DEFAULT_MAX_SAMPLES`` (or ``max_request_ids`` if larger) for a TransferQueue started alone
      (``sample_bound``). At least ``max_request_ids`` when set. ``max_client_partitions``: partitions one
      client connection may have created that are not cleared yet (``max_partitions`` bounds them all).
    * ``max_fields`` per partition and ``max_tasks`` (consumer tasks, over all partitions): each adds a bit
      to every sample's field/consumption mask. ``max_partitions``: partitions the index holds at once.
      ``max_name_chars``: length of a partition, field or task name.
    * ``max_subscriptions``: cached (task, field set) views per partition; past it the least recently
      used one is dropped (rebuilt by one scan on its next ``get_meta``), never an error.
    * ``max_parked``, ``max_parked_bytes``: long-poll ``get_meta`` requests waiting at the index, and the
      bytes of their headers.
    * ``max_p2p_links``: device-path links (one process group each) a storage unit holds; a client's link
      lives as long as the unit.
    """

    num_storage_units: int = setting(2, ge=1, doc="storage server processes holding sample tensors")
    capacity_bytes: int = setting(2 * 1024**3, ge=1, doc="memory each storage unit may hold, bytes")
    shared_memory: bool = setting(
        True, doc="same-node clients move tensors through shared memory, not sockets")
    curve: bool = setting(
        False, doc="ZMQ CURVE authentication and encryption (for sockets that leave the node)")
    host: str = setting(
        "127.0.0.1",
        doc="bind address of the servers: IPv4 (loopback default) | node (the "
            "driver's Ray node address)")
    request_timeout_s: float = setting(60.0, gt=0, doc="seconds one client request may wait for its reply")
    route_block: int = setting(
        64, ge=1, doc="samples [k*B, (k+1)*B) live on storage unit k mod num_storage_units")
    shm_min_bytes: int = setting(64 * 1024, ge=0, doc="puts smaller than this go over ZMQ even on one node")
    sampler_modules: list[str] = setting(
        factory=list, doc="modules the index imports at start to register custom samplers")
    start_timeout_s: float = setting(60.0, gt=0, doc="seconds to wait for the servers to start")
    p2p_backend: str = setting(
        "", choices=P2P_BACKENDS, doc="device path between units and clients; '' = off")
    p2p_device: str = setting(
        "cpu", choices=P2P_DEVICES, doc="device of the p2p path's tensors (nccl needs cuda)")
    max_request_ids: int = setting(
        1 << 17, ge=MIN_REQUEST_IDS, doc="most sample ids one request may name or allocate (at least 4096)")
    max_client_reserved_ids: int = setting(
        1 << 20, ge=1, doc="most ids one client connection may hold reserved, not yet put")
    max_reserved_ids: int = setting(1 << 24, ge=1, doc="most ids reserved over all clients")
    reservation_lease_s: float = setting(
        600.0, gt=0, doc="seconds until an unused id reservation lapses (clients that went away)")
    max_fields: int = setting(256, ge=1, doc="most fields per partition")
    max_tasks: int = setting(256, ge=1, doc="most consumer tasks over all partitions")
    max_samples: int = setting(
        0, ge=0,
        doc="most samples the index holds; 0 = 4x what the job's admission holds, "
            "2^20 standalone, both >= max_request_ids")
    max_partitions: int = setting(1 << 16, ge=1, doc="most partitions the index holds at once")
    max_client_partitions: int = setting(
        1024, ge=1, doc="most uncleared partitions one client connection may have created")
    max_name_chars: int = setting(1024, ge=1, doc="longest partition, field or task name, in characters")
    max_subscriptions: int = setting(64, ge=1, doc="cached (task, field set) views per partition (LRU)")
    max_parked: int = setting(10_000, ge=1, doc="most long-poll get_meta requests waiting at the index")
    max_parked_bytes: int = setting(
        64 * 1024**2, ge=1, doc="most header bytes of the waiting long-poll requests")
    max_p2p_links: int = setting(1024, ge=1, doc="most device-path links one storage unit holds")

    def __post_init__(self):
        check_settings(self, "transferqueue")
        if self.p2p_backend == "nccl" and self.p2p_device != "cuda":
            raise ValueError("transferqueue.p2p_backend=nccl needs transferqueue.p2p_device=cuda")
        check_bind_host("transferqueue.host", self.host)
        self._check_bounds()

    def _check_bounds(self) -> None:
        """ValueError naming the key for a bound that contradicts another (the reserved-ids bounds must hold two
        full-size reservations; an explicit ``max_samples`` must hold one full request)."""
        if self.max_client_reserved_ids < 2 * self.max_request_ids:
            raise ValueError(f"transferqueue.max_client_reserved_ids must be >= 2 * max_request_ids "
                             f"({2 * self.max_request_ids}), got {self.max_client_reserved_ids}")
        if self.max_reserved_ids < self.max_client_reserved_ids:
            raise ValueError(f"transferqueue.max_reserved_ids must be >= max_client_reserved_ids "
                             f"({self.max_client_reserved_ids}), got {self.max_reserved_ids}")
        if 0 < self.max_samples < self.max_request_ids:
            raise ValueError(f"transferqueue.max_samples must be 0 (sized by the job) or >= max_request_ids "
                             f"({self.max_request_ids}: one full request fits an empty index), got {self.max_samples}")

    @property
    def sample_bound(self) -> int:
        """The samples the index may hold at once: ``max_samples``; when it is 0 (a TransferQueue started
        alone: a job sets it, ``sized_for``), ``DEFAULT_MAX_SAMPLES`` or ``max_request_ids`` if that is larger,
        so one full request always fits an empty index."""
        return self.max_samples or max(DEFAULT_MAX_SAMPLES, self.max_request_ids)

    def sample_bound_source(self) -> str:
        """``sample_bound`` as an error message names it: the key and its value, or, when the key is 0, the
        bound and the default it came from."""
        if self.max_samples:
            return f"transferqueue.max_samples={self.max_samples}"
        return (f"the index's bound of {self.sample_bound} samples (transferqueue.max_samples=0: the default of a "
                f"TransferQueue started alone, max({DEFAULT_MAX_SAMPLES}, max_request_ids={self.max_request_ids}))")

    def sized_for(self, num_samples: int) -> TransferQueueConfig:
        """This config for a job whose index can hold ``num_samples`` samples at once (what its admission
        bound lets it start, counted by the controller): with ``max_samples`` 0, a copy whose ``max_samples``
        is ``SAMPLES_HEADROOM * num_samples``, at least ``max_request_ids``; else this config unchanged.
        Raises ValueError when ``num_samples < 1``, or when an explicit ``max_samples`` is below ``num_samples``
        (the job would be refused mid-run)."""
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"sized_for: num_samples must be a positive int, got {num_samples!r}")
        if self.max_samples == 0:
            return replace(self, max_samples=max(SAMPLES_HEADROOM * num_samples, self.max_request_ids))
        if self.max_samples < num_samples:
            raise ValueError(f"transferqueue.max_samples={self.max_samples} is below the {num_samples} samples this "
                             f"job's admission can hold in the index at once: set it >= {num_samples}, or 0 (sized "
                             "by the job)")
        return self

    def limits(self) -> dict:
        """The bounds the servers enforce (``LIMIT_KEYS``), as plain values for a server's spec."""
        return {k: getattr(self, k) for k in LIMIT_KEYS}


LIMIT_KEYS = ("max_request_ids", "max_client_reserved_ids", "max_reserved_ids", "reservation_lease_s", "max_fields",
              "max_tasks", "max_samples", "max_partitions", "max_client_partitions", "max_name_chars",
              "max_subscriptions", "max_parked", "max_parked_bytes", "max_p2p_links")
