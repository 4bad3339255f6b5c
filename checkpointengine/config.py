"""The ``checkpointengine`` config section."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("shm", "zmq", "broadcast", "disk")
ENGINE_DTYPES = ("float32", "bfloat16", "float16")
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class CheckpointEngineConfig:
    """Weight plane. ``bucket_bytes``: bucket size in bytes; ``dtype``: dtype weights arrive in at the
    engine; ``pause_mode``: what a roller does with in-flight requests during an update (SGLang's
    ``/pause_generation`` modes); ``timeout_s``: every wait of an update."""

    backend: str = "shm"
    bucket_bytes: int = 64 * 1024**2
    dtype: str = "float32"
    pause_mode: str = "retract"
    timeout_s: float = 120.0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"checkpointengine.backend={self.backend!r} is not one of {list(BACKENDS)}")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"checkpointengine.dtype={self.dtype!r} is not one of {list(ENGINE_DTYPES)}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"checkpointengine.pause_mode={self.pause_mode!r} is not one of {list(PAUSE_MODES)}"
            )
        if self.bucket_bytes < 1024:
            raise ValueError(f"checkpointengine.bucket_bytes must be >= 1024, got {self.bucket_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"checkpointengine.timeout_s must be > 0, got {self.timeout_s}")
