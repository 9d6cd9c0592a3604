"""A job's live figures as Ray metrics (``ray.util.metrics``), recorded by the driver.

Ray's metrics agent on the driver's node serves them in Prometheus text at the node's metrics
export port (``ray start --metrics-export-port``), prefixed ``ray_``; Ray adds ``Counter``s a
``_total`` suffix. Every series is tagged ``ringleader_job`` (the job's name; not ``job``,
which Prometheus sets to its scrape job's name); per-worker ones also ``worker`` (the worker
id), events ``kind``, lost time ``cause``, phases ``phase``.
``deploy/grafana/ringleader.json`` is a dashboard on these series.

A ``MetricsListener`` subscribed to the run (``RunDirectory.subscribe``, as tracking is)
records them from what the run records: each ``step``, ``recovered`` and ``checkpoint`` event
and the summary. A failure to record is reported once (a ``metrics_failed`` event) and stops
the recording: metrics never fail a job.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from jobspec.step_record import StepRecord
from policies.goodput import Goodput

#: name -> (description, tag keys) of every gauge.
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "ringleader_step_seconds": ("wall seconds of the last committed step (the slowest worker's)", ("ringleader_job",)),
    "ringleader_samples_per_second": ("samples per second of the last committed step", ("ringleader_job",)),
    "ringleader_tokens_per_second": ("loss weight (tokens for a token-level loss) per second, last step", ("ringleader_job",)),
    "ringleader_loss": ("the last committed step's loss", ("ringleader_job",)),
    "ringleader_learning_rate": ("the last committed step's learning rate", ("ringleader_job",)),
    "ringleader_steps_committed": ("steps committed so far", ("ringleader_job",)),
    "ringleader_workers_alive": ("workers in the group", ("ringleader_job",)),
    "ringleader_worker_shard_seconds": (
        "a worker's compute seconds per shard, at a step of the last WORKER_GAUGES_EVERY_S", ("ringleader_job", "worker")
    ),
    "ringleader_goodput": ("share of wall time spent on committed steps, so far", ("ringleader_job",)),
    "ringleader_lost_seconds": ("wall seconds not spent on committed steps, by cause", ("ringleader_job", "cause")),
    "ringleader_recovery_seconds": ("the last recovery's seconds, by phase", ("ringleader_job", "phase")),
    "ringleader_checkpoint_seconds": ("the last checkpoint's seconds: copy (training held) and write", ("ringleader_job", "phase")),
}
EVENTS = "ringleader_events"  # a Counter: what happened, by kind (failures, recoveries, ...)
#: A recovery's phases, each ``<phase>_s`` in its ``recovered`` event.
RECOVERY_PHASES = ("detect", "reform", "transfer", "redo")
#: The per-worker gauges are set at most this often (seconds): one a worker a step is ~9 us of
#: the driver per worker (37 ms a step at 4096), and Prometheus scrapes every 10-15 s anyway.
WORKER_GAUGES_EVERY_S = 5.0


class JobMetrics:
    """Records a job's figures under ``job``. Needs Ray initialised in this process."""

    def __init__(self, job: str) -> None:
        from ray.util.metrics import Counter, Gauge

        self.job = job
        self._gauges = {name: Gauge(name, description=text, tag_keys=tags) for name, (text, tags) in GAUGES.items()}
        self._events = Counter(EVENTS, description="what happened during the job, by kind", tag_keys=("ringleader_job", "kind"))
        self._counted: dict[str, int] = {}
        self._workers_set_at: float | None = None  # monotonic, when the per-worker gauges were last set

    def _set(self, name: str, value: float, **tags: str) -> None:
        self._gauges[name].set(float(value), tags={"ringleader_job": self.job, **tags})

    def observe_step(
        self, record: StepRecord | None, step_s: float, steps_done: int, workers: int,
        counters: Mapping[str, int], goodput: Goodput,
    ) -> None:
        """After a committed step: its figures (``record``: the ranks' accounts, which agree on
        the step's totals), the job's event counters (recorded as increments) and goodput."""
        if record is not None and len(record):
            self._set("ringleader_step_seconds", step_s)
            if step_s > 0:
                self._set("ringleader_samples_per_second", record.first("global_samples") / step_s)
                self._set("ringleader_tokens_per_second", record.first("weight") / step_s)
            self._set("ringleader_loss", record.first("loss"))
            self._set("ringleader_learning_rate", record.first("lr"))
            now = time.monotonic()
            if self._workers_set_at is None or now - self._workers_set_at >= WORKER_GAUGES_EVERY_S:
                self._workers_set_at = now
                for worker, shard_s in zip(record.column("worker").astype(int).tolist(), record.column("shard_s").tolist()):
                    self._set("ringleader_worker_shard_seconds", shard_s, worker=str(worker))
        self._set("ringleader_steps_committed", steps_done)
        self._set("ringleader_workers_alive", workers)
        self.observe_counters(counters)
        self.observe_goodput(goodput)

    def observe_counters(self, counters: Mapping[str, int]) -> None:
        """The job's event counters, recorded as increments since the last call."""
        for kind, count in counters.items():
            if count > self._counted.get(kind, 0):
                self._events.inc(count - self._counted.get(kind, 0), tags={"ringleader_job": self.job, "kind": kind})
                self._counted[kind] = count

    def observe_goodput(self, goodput: Goodput) -> None:
        self._set("ringleader_goodput", goodput.share)
        for cause, seconds in goodput.lost_s.items():
            self._set("ringleader_lost_seconds", seconds, cause=cause)

    def observe_recovery(self, phases: Mapping[str, Any]) -> None:
        """A finished recovery's seconds by phase (detect, reform, transfer, redo)."""
        for phase, seconds in phases.items():
            if isinstance(seconds, (int, float)):
                self._set("ringleader_recovery_seconds", seconds, phase=phase)

    def observe_checkpoint(self, copy_s: float, write_s: float) -> None:
        self._set("ringleader_checkpoint_seconds", copy_s, phase="copy")
        self._set("ringleader_checkpoint_seconds", write_s, phase="write")


class LiveAccount(Protocol):
    """What the metrics read of a job at a committed step beyond its ``step`` event
    (``orchestrator/accounting/step_sinks.py``'s StepAccounting)."""

    @property
    def last_record(self) -> StepRecord | None: ...
    @property
    def workers(self) -> int: ...
    @property
    def counters(self) -> Mapping[str, int]: ...
    def goodput(self) -> Goodput: ...


class MetricsListener:
    """Records a run's figures in ``metrics`` (a ``RunListener``, see the module doc), reading
    the rest of a step's from ``account``; ``report(kind, **fields)`` records its failure."""

    def __init__(self, metrics: JobMetrics, account: LiveAccount, report: Callable[..., None]) -> None:
        self.metrics: JobMetrics | None = metrics
        self.account = account
        self.report = report

    def _record(self, record: Callable[[JobMetrics], None]) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        try:
            record(metrics)
        except Exception as err:  # noqa: BLE001 - Ray's metrics agent, our accounting: never the job's end
            self.metrics = None
            self.report("metrics_failed", error=f"{type(err).__name__}: {err}")

    def on_event(self, record: Mapping[str, Any]) -> None:
        kind = record["event"]
        if kind == "step":
            account = self.account
            steps_done = record["step"] + 1  # steps commit in order: step s is the (s + 1)th
            self._record(
                lambda metrics: metrics.observe_step(
                    account.last_record, record["step_s"], steps_done, account.workers, account.counters, account.goodput()
                )
            )
        elif kind == "recovered":
            self._record(lambda metrics: metrics.observe_recovery({p: record[f"{p}_s"] for p in RECOVERY_PHASES}))
        elif kind == "checkpoint":
            self._record(lambda metrics: metrics.observe_checkpoint(record["copy_s"], record["write_s"]))

    def on_model(self, path: Path) -> None:
        """The model file is no figure."""

    def on_summary(self, summary: Mapping[str, Any]) -> None:
        """The final counters and goodput (the summary's)."""

        def final(metrics: JobMetrics) -> None:
            goodput = summary["goodput"]
            metrics.observe_counters(summary["events"])
            metrics.observe_goodput(Goodput(goodput["wall_s"], goodput["lost_s"]))

        self._record(final)
