"""A custom sampler the index process imports through ``transferqueue.sampler_modules`` (test helper)."""

from __future__ import annotations

from transferqueue.samplers import register_sampler


class NewestFirst:
    """The most recently readied samples first."""

    def select(self, view, batch_size: int, options: dict) -> list[int] | str:
        ids = list(view.ready_ids())
        if len(ids) < batch_size:
            return f"insufficient ready samples: {len(ids)} ready, {batch_size} requested"
        return ids[::-1][:batch_size]


register_sampler("newest_first", NewestFirst())


class FailsWhenRetried:
    """Answers its first call with a reason (so a long-poll parks) and raises on every later one: a custom
    sampler that fails while its request waits at the index."""

    def __init__(self):
        self.calls = 0

    def select(self, view, batch_size: int, options: dict) -> list[int] | str:
        self.calls += 1
        if self.calls > 1:
            raise ValueError("fails_when_retried: failing on purpose")
        return "not yet"


register_sampler("fails_when_retried", FailsWhenRetried())
