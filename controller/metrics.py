"""Prometheus metrics of a job (prefix ``hflow_``), served on one loopback HTTP endpoint.

The controller feeds these from metadata only: queue counts from the TransferQueue index, sample tags,
stats dicts returned by rollers and trainers, and its own timings. Each series is counted where the
controller sees its event; gauges marked *polled* are refreshed every 2 s (``controller/job.py``). The
README's "Metrics" table is this one, for users. Series:

=====================================  =========  ==========================================================
series                                 type       meaning (what one count or observation is)
=====================================  =========  ==========================================================
hflow_queue_depth{task}                gauge      samples ready for consumer ``task`` and not yet taken by it
                                                  (``rollout``: prompts waiting for a roller; ``train``:
                                                  scored samples waiting for the trainer; ``validate``:
                                                  validation samples waiting for the controller); polled
hflow_queue_lag                        histogram  per trained sample: trainer version it was trained at −
                                                  its ``min_weight_version`` (its staleness, in versions)
hflow_sample_age_seconds               histogram  per trained sample: seconds from its prompt's admission
                                                  to the end of the step that trained it
hflow_samples_produced_total           counter    samples generated and scored; counted when the controller
                                                  receives them or a roller reports them, whichever comes
                                                  first, so it is never below consumed + dropped
hflow_samples_consumed_total           counter    samples trained on (at the end of their step)
hflow_samples_dropped_total            counter    samples discarded untrained: too stale
                                                  (``stale_policy=drop``) or in a zero-variance group
                                                  (``dynamic_sampling``)
hflow_roller_busy_ratio{roller}        gauge      share of the roller's wall time with a request in
                                                  flight, since it started; polled
hflow_trainer_wait_seconds_total       counter    seconds the trainer sat idle: neither in an update (a
                                                  step, its checkpoint included) nor pushing weights;
                                                  counted as they pass (a scrape sees a wait so far)
hflow_weight_sync_seconds              histogram  per weight sync: seconds from send to the last roller's
                                                  acknowledgement (pause and resume included)
hflow_weight_sync_bytes_total          counter    bytes of weights sent to rollers (per roller, summed)
hflow_tokens_per_second                gauge      tokens generated per second, all rollers, averaged since
                                                  each started; polled
hflow_step_seconds                     histogram  per trainer step: seconds of the update (log-probs,
                                                  advantages, optimizer steps, checkpoint if due)
hflow_reward_mean                      gauge      mean sequence reward of the last step's samples
hflow_accuracy_ratio                   gauge      share of the last step's samples scored correct (reward >=
                                                  0.999, the progress line's ``acc``)
hflow_response_length                  histogram  per trained sample: response length in tokens
hflow_response_clip_ratio              gauge      share of the last step's responses cut by a length limit
                                                  (finish_reason=length: rollout.max_response_length or the
                                                  model's context length)
hflow_weight_version                   gauge      the trainer's weight version (updates completed)
hflow_roller_pool_size                 gauge      active rollers (joined and taking work; not draining)
hflow_roller_scale_events_total{reason}  counter  rollers joining or leaving the pool, by reason:
                                                  ``scale_up``/``scale_down`` (a scale request),
                                                  ``autoscale_up``/``autoscale_down``, ``replacement``,
                                                  ``lost_died``/``lost_unresponsive``/``lost_weight_sync``
hflow_roller_restarts_total            counter    replacements started for lost rollers
hflow_reissued_groups_total            counter    prompt groups re-issued because their roller left the pool
hflow_weight_sync_timeouts_total       counter    rollers taken out of rotation for not acknowledging a
                                                  weight update in time
hflow_val_accuracy{kind}               gauge      held-out accuracy of the last validation round: ``sampled``
                                                  (pass@1 at rollout.temperature) or ``greedy``
hflow_val_reward_mean{kind}            gauge      held-out mean reward of the last validation round, per kind
hflow_val_pass_at_k{k}                 gauge      held-out unbiased pass@k of the last validation round
hflow_val_weight_version               gauge      the weight version the last validation round evaluated
=====================================  =========  ==========================================================
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
_TIME_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LENGTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


# Why a roller joined or left the pool (``controller.pool_keeper.PoolKeeper.event``): a scale request, the
# autoscaler, a replacement, or a loss (the roller died, stopped answering, or missed a weight update).
SCALE_REASONS = ("scale_up", "scale_down", "autoscale_up", "autoscale_down", "replacement", "lost_died",
                 "lost_unresponsive", "lost_weight_sync")


class TrainerWaitClock:
    """``hflow_trainer_wait_seconds_total``: seconds the trainer sat idle, counted as they pass. Idle is
    neither in an update (a step, its job checkpoint included) nor pushing weights; it starts when the
    schedule's stages do. The stages mark the changes (``busy``, ``idle``); the step records and the
    autoscaler ask (``total_s``).

    Counted as they pass, not when a wait ends: a wait booked whole at its end fell into the scrape window
    where it ended, so the dashboard's rate over that window read up to 1.3 (and 0 over the windows the
    trainer waited through). Now no window holds more idle seconds than it lasts. Locked: the HTTP endpoint
    reads it from its own thread, and a read halfway through ``busy`` would miss the wait that just ended
    (the counter would drop, which Prometheus takes for a reset)."""

    NAME = "hflow_trainer_wait_seconds"
    HELP = ("Seconds the trainer sat idle: neither in an update (its checkpoint included) nor pushing weights; "
            "counted as they pass")

    def __init__(self, registry: CollectorRegistry):
        self._lock = threading.Lock()
        self._total_s = 0.0  # idle seconds of the waits that ended
        self._idle_since: float | None = None  # time.monotonic() the current wait began; None: busy
        registry.register(self)

    def idle(self) -> None:
        """The trainer is idle from now on (no-op when it already is)."""
        with self._lock:
            if self._idle_since is None:
                self._idle_since = time.monotonic()

    def busy(self) -> None:
        """The trainer's idle time ends now: an update or a weight push starts (no-op when it is busy)."""
        with self._lock:
            if self._idle_since is not None:
                self._total_s += time.monotonic() - self._idle_since
                self._idle_since = None

    def total_s(self) -> float:
        """Idle seconds so far, the current wait included."""
        with self._lock:
            return self._total_s + (0.0 if self._idle_since is None else time.monotonic() - self._idle_since)

    def describe(self):
        yield CounterMetricFamily(self.NAME, self.HELP)

    def collect(self):
        yield CounterMetricFamily(self.NAME, self.HELP, value=self.total_s())


class JobMetrics:
    """The series of one job in a private registry; ``serve(host, port)`` exposes them over HTTP."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("hflow_queue_depth", "Samples ready for consumer task and not yet taken by it "
                                 "(rollout: prompts waiting for a roller; train: scored samples waiting for the "
                                 "trainer)", ["task"], registry=r)
        self.queue_lag = Histogram("hflow_queue_lag", "Per trained sample: the trainer version it was trained at "
                                   "minus its min_weight_version (staleness, versions)", buckets=_STALENESS_BUCKETS,
                                   registry=r)
        self.sample_age = Histogram("hflow_sample_age_seconds", "Per trained sample: seconds from its prompt's "
                                    "admission to the end of the step that trained it", buckets=_TIME_BUCKETS,
                                    registry=r)
        # consumed and dropped are registered (so collected, in a scrape) before produced: a scrape reads
        # them first, so the produced it reads next is never below them.
        self.consumed = Counter("hflow_samples_consumed", "Samples trained on (counted at the end of their step)",
                                registry=r)
        self.dropped = Counter("hflow_samples_dropped", "Samples discarded untrained: too stale "
                               "(stale_policy=drop) or in a zero-variance group (dynamic_sampling)", registry=r)
        self.produced = Counter("hflow_samples_produced", "Samples generated and scored (counted when the "
                                "controller receives them or a roller reports them, whichever comes first)",
                                registry=r)
        self.roller_busy = Gauge("hflow_roller_busy_ratio", "Share of the roller's wall time with a request in "
                                 "flight, since it started", ["roller"], registry=r)
        self.trainer_wait = TrainerWaitClock(r)
        self.sync_seconds = Histogram("hflow_weight_sync_seconds", "Per weight sync: seconds from send to the "
                                      "last roller's acknowledgement", buckets=_TIME_BUCKETS, registry=r)
        self.sync_bytes = Counter("hflow_weight_sync_bytes", "Bytes of weights sent to rollers (per roller, "
                                  "summed)", registry=r)
        self.tokens_per_s = Gauge("hflow_tokens_per_second", "Tokens generated per second by all rollers, "
                                  "averaged since each started", registry=r)
        self.step_seconds = Histogram("hflow_step_seconds", "Per trainer step: seconds of the update",
                                      buckets=_TIME_BUCKETS, registry=r)
        self.reward_mean = Gauge("hflow_reward_mean", "Mean sequence reward of the last step's samples", registry=r)
        self.accuracy = Gauge("hflow_accuracy_ratio", "Share of the last step's samples scored correct "
                              "(reward >= 0.999)", registry=r)
        self.response_length = Histogram("hflow_response_length", "Per trained sample: response length in tokens",
                                         buckets=_LENGTH_BUCKETS, registry=r)
        self.response_clip_ratio = Gauge("hflow_response_clip_ratio", "Share of the last step's responses cut "
                                         "by a length limit (finish_reason=length)", registry=r)
        self.weight_version = Gauge("hflow_weight_version", "The trainer's weight version (updates completed)",
                                    registry=r)
        self.pool_size = Gauge("hflow_roller_pool_size", "Active rollers (joined and taking work; not draining)",
                               registry=r)
        self.scale_events = Counter("hflow_roller_scale_events", "Rollers joining or leaving the pool, by reason",
                                    ["reason"], registry=r)
        for reason in SCALE_REASONS:  # every reason exported from the start (0 until it happens)
            self.scale_events.labels(reason=reason)
        self.restarts = Counter("hflow_roller_restarts", "Replacements started for lost rollers", registry=r)
        self.reissued_groups = Counter("hflow_reissued_groups", "Prompt groups re-issued because their roller "
                                       "left the pool", registry=r)
        self.weight_sync_timeouts = Counter("hflow_weight_sync_timeouts", "Rollers taken out of rotation for "
                                            "not acknowledging a weight update in time", registry=r)
        self.val_accuracy = Gauge("hflow_val_accuracy", "Held-out accuracy of the last validation round "
                                  "(kind: sampled = pass@1 at rollout.temperature, or greedy)", ["kind"], registry=r)
        self.val_reward_mean = Gauge("hflow_val_reward_mean", "Held-out mean reward of the last validation "
                                     "round (kind: sampled or greedy)", ["kind"], registry=r)
        self.val_pass_at_k = Gauge("hflow_val_pass_at_k", "Held-out unbiased pass@k (Chen et al. 2021) of the "
                                   "last validation round", ["k"], registry=r)
        self.val_weight_version = Gauge("hflow_val_weight_version", "The weight version the last validation "
                                        "round evaluated", registry=r)
        self._num_produced = 0.0  # what hflow_samples_produced_total holds
        self._server = None

    def count_produced(self, at_least: float) -> None:
        """Raise ``hflow_samples_produced_total`` to ``at_least`` samples (no-op when it is already there).

        Two sources report produced samples: the controller when it receives samples from the
        TransferQueue (each was produced), and the rollers' own counts, polled. Both are lower bounds
        of the truth; the counter follows whichever is ahead, so it never lags consumed + dropped.
        """
        if at_least > self._num_produced:
            self.produced.inc(at_least - self._num_produced)
            self._num_produced = at_least

    def observe_queue_depth(self, status, samples_per_row: dict[str, int]) -> dict[str, int]:
        """Set ``hflow_queue_depth{task}`` from the index's ``IndexStats`` (samples ready per task, summed over
        partitions and field sets; a row of partition ``p`` counts ``samples_per_row.get(p, 1)`` samples: a
        prompt row stands for its group's samples); returns it."""
        depth: dict[str, int] = {}
        for partition, counts in status.ready.items():
            for key, value in counts.items():
                task = key.split("|", 1)[0]
                depth[task] = depth.get(task, 0) + value * samples_per_row.get(partition, 1)
        for task, value in depth.items():
            self.queue_depth.labels(task=task).set(value)
        return depth

    async def observe_pool(self, pool) -> int:
        """Set the roller gauges (throughput, busy ratio, pool size, samples produced) from ``pool``
        (``controller.pool.RollerPool``); returns the groups it generated or failed so far."""
        stats = await pool.stats()
        self.count_produced(pool.totals("num_samples"))
        self.tokens_per_s.set(sum(s.get("tokens_per_s", 0.0) for s in stats.values()))
        self.pool_size.set(pool.size())
        for name, s in stats.items():
            self.roller_busy.labels(roller=name).set(s.get("busy_ratio", 0.0))
        return int(pool.totals("num_groups") + pool.totals("num_failed_groups"))

    def observe_validation(self, record: dict) -> None:
        """Set the ``hflow_val_*`` gauges from a validation record (``controller.validation``)."""
        self.val_weight_version.set(record["weight_version"])
        for kind, suffix in (("sampled", ""), ("greedy", "_greedy")):
            if f"val/accuracy{suffix}" in record:
                self.val_accuracy.labels(kind=kind).set(record[f"val/accuracy{suffix}"])
                self.val_reward_mean.labels(kind=kind).set(record[f"val/reward_mean{suffix}"])
        for key, value in record.items():
            if key.startswith("val/pass@"):
                self.val_pass_at_k.labels(k=key.removeprefix("val/pass@")).set(value)

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
