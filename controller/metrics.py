"""Prometheus metrics of a job (prefix ``hflow_``), served on one loopback HTTP endpoint.

The controller feeds these from metadata only: queue counts and tags from the TransferQueue index,
stats dicts returned by rollers and trainers, and its own timings. Series (DESIGN.md, "Metrics"):

=====================================  =========  ============================================
series                                 type       meaning
=====================================  =========  ============================================
hflow_queue_depth{task}                gauge      samples ready and not yet consumed by task
hflow_queue_lag                        histogram  staleness of trained samples: trainer weight_version
                                                  − sample min_weight_version (DESIGN's "queue lag")
hflow_sample_age_seconds               histogram  time from a group's admission to its training
hflow_samples_produced_total           counter    samples with a finished response
hflow_samples_consumed_total           counter    samples trained on
hflow_samples_dropped_total            counter    samples discarded by stale_policy=drop
hflow_roller_busy_ratio{roller}        gauge      fraction of wall time a roller was decoding
hflow_trainer_wait_seconds_total       counter    trainer time spent waiting for data
hflow_weight_sync_seconds              histogram  one weight sync, pause to resume
hflow_weight_sync_bytes_total          counter    bytes moved by weight syncs
hflow_tokens_per_second                gauge      generated tokens per second (all rollers)
hflow_step_seconds                     histogram  one trainer step
hflow_reward_mean                      gauge      mean sequence reward of the last step
hflow_response_length                  histogram  response length in tokens
hflow_response_clip_ratio              gauge      share of the last step's responses cut by a length
                                                  limit (finish_reason=length; max_response_length
                                                  or the model's context length)
hflow_weight_version                   gauge      trainer weight version
=====================================  =========  ============================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
_TIME_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LENGTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class JobMetrics:
    """The series of one job in a private registry; ``serve(host, port)`` exposes them over HTTP."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("hflow_queue_depth", "Samples ready, not yet consumed", ["task"], registry=r)
        self.queue_lag = Histogram("hflow_queue_lag", "Staleness of trained samples: trainer weight_version "
                                   "minus sample min_weight_version", buckets=_STALENESS_BUCKETS, registry=r)
        self.sample_age = Histogram("hflow_sample_age_seconds", "Admission-to-training time of a sample",
                                    buckets=_TIME_BUCKETS, registry=r)
        self.produced = Counter("hflow_samples_produced", "Samples with a finished response", registry=r)
        self.consumed = Counter("hflow_samples_consumed", "Samples trained on", registry=r)
        self.dropped = Counter("hflow_samples_dropped", "Samples dropped as too stale", registry=r)
        self.roller_busy = Gauge("hflow_roller_busy_ratio", "Fraction of time decoding", ["roller"], registry=r)
        self.trainer_wait = Counter("hflow_trainer_wait_seconds", "Trainer time waiting for data", registry=r)
        self.sync_seconds = Histogram("hflow_weight_sync_seconds", "One weight sync", buckets=_TIME_BUCKETS,
                                      registry=r)
        self.sync_bytes = Counter("hflow_weight_sync_bytes", "Bytes moved by weight syncs", registry=r)
        self.tokens_per_s = Gauge("hflow_tokens_per_second", "Generated tokens per second", registry=r)
        self.step_seconds = Histogram("hflow_step_seconds", "One trainer step", buckets=_TIME_BUCKETS, registry=r)
        self.reward_mean = Gauge("hflow_reward_mean", "Mean sequence reward of the last step", registry=r)
        self.response_length = Histogram("hflow_response_length", "Response length in tokens",
                                         buckets=_LENGTH_BUCKETS, registry=r)
        self.response_clip_ratio = Gauge("hflow_response_clip_ratio", "Share of the last step's responses cut "
                                         "by a length limit (finish_reason=length)", registry=r)
        self.weight_version = Gauge("hflow_weight_version", "Trainer weight version", registry=r)
        self._server = None

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint on ``host:port`` (port 0 picks a free one); returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_port

    def close(self) -> None:
        """Stop the HTTP endpoint (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def series_names(self) -> list[str]:
        """Every metric family name this job exports (for tests and docs)."""
        return sorted({m.name for m in self.registry.collect()})
