"""``ringleader bench control-plane --synthetic N...``: the driver's own work per step at
thousands of ranks, measured on the real controller without the actors.

``bench control-plane`` runs real actors, but only up to 64 on this machine, where they time-share
2 cores: its fit to 4096 extrapolates from an oversubscribed host. Here ``JobController`` (the
same code as a job's: pipeline, plans, commit, ledger, telemetry line, events, straggler
policies, the control-plane meter, and with ``metrics`` the Prometheus listener a job has)
drives ``SyntheticGroup``, a worker group whose leader answers each batch at once with a step
record of N ranks (what ``TrainWorker.lead_steps`` returns). The driver's side of Ray's
transport is counted as far as it is Python: the plans pickled for the call, the leader's
records unpickled from its result (O(N) each); the leader's own pickling is not the driver's and
is left out with the making of the records. What it leaves out: Ray's C++ for one call and one
result per batch, the followers' watched calls in each ``ray.wait`` (O(N) refs; measured apart,
docs/architecture.md, "The control plane at scale"), and the progress polls of eviction,
which a batch shorter than ``stragglers.silent_s / 2`` never makes (as here).
"""

from __future__ import annotations

import pickle
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jobspec.job import JobConfig
from jobspec.step_record import COLUMNS, StepRecord
from jobspec.wire import Phase, Progress, SnapshotOrder, SnapshotRequest, StepTelemetry, WorkerInfo
from orchestrator.controller import JobController
from orchestrator.group.chaos_control import ChaosControl
from orchestrator.group.interface import Call, Submitted
from orchestrator.group.membership import Membership
from orchestrator.output.metrics import WORKER_GAUGES_EVERY_S, JobMetrics, MetricsListener
from orchestrator.output.run_dir import RunDirectory
from orchestrator.store.rendezvous import RendezvousStore
from policies.work_stealing import StepPlan

_COLUMN = {name: i for i, name in enumerate(COLUMNS)}


@dataclass
class SyntheticMember:
    info: WorkerInfo


class SyntheticGroup(Membership[SyntheticMember, SyntheticMember]):
    """N ranks that apply every batch at once: the leader's answer is made on submission, each
    rank's seconds per shard ``shard_s`` with a few percent of noise (nobody slow). The CPU
    seconds spent making the answers and pickling them (``build_s``, this thread's) are the
    workers', not the driver's: the bench takes them out. The plans are pickled and the answers
    unpickled as Ray would on the driver."""

    def __init__(self, job: JobConfig, shard_s: float = 0.01) -> None:
        super().__init__(job.scaling)
        self.job = job
        self.shard_s = shard_s
        self.build_s = 0.0
        self.steps_built = 0
        self._rng = np.random.default_rng(0)
        self._next_step = 0

    def start(self, count: int) -> list[WorkerInfo]:
        now = time.time()
        steps = self.job.steps or 0
        self.members = [
            SyntheticMember(WorkerInfo(self._new_worker_id(), 1, steps, 1, "cpu", "node", "host", 0, None, now, now))
            for _ in range(count)
        ]
        return self.info

    def form_group(self, store: RendezvousStore, step: int = -1) -> float:
        store.next_prefix()
        return 0.0

    def submit_steps(self, first: int, plans: Sequence[StepPlan], snapshot: SnapshotOrder | None = None) -> Submitted:
        assert snapshot is None, "the synthetic job takes no checkpoints"
        pickle.dumps(list(plans), protocol=pickle.HIGHEST_PROTOCOL)  # the call's argument, as Ray sends it
        started = time.thread_time()
        records = [self._record(first + index, plan) for index, plan in enumerate(plans)]
        answer = pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL)  # the leader's result, as Ray sends it
        self.build_s += time.thread_time() - started
        self._next_step = first + len(plans)
        self.steps_built += len(plans)
        return Submitted((Call(self.workers[0], answer),))

    def _record(self, step: int, plan: StepPlan) -> StepRecord:
        ranks = self.size
        counts = np.array([len(shards) for shards in plan.shards_by_rank], dtype=np.float64)
        shard_s = self.shard_s * (1 + 0.03 * self._rng.random(ranks))
        table = np.zeros((ranks, len(COLUMNS)))
        per_shard = self.job.batch_size / self.job.shards
        columns = {
            "step": step, "rank": np.arange(ranks), "worker": np.array(self.workers), "samples": counts * per_shard,
            "global_samples": self.job.batch_size, "loss": 1.0 / (step + 1), "compute_s": counts * shard_s,
            "step_s": float((counts * shard_s).max()), "shards_counted": plan.num_shards, "lr": 1e-3,
            "weight": self.job.batch_size, "grad_norm": 1.0, "shards_run": counts, "shard_s": shard_s,
        }
        for name, values in columns.items():
            table[:, _COLUMN[name]] = values
        return StepRecord(step, table, plan.shards_by_rank)

    def release_followers(self) -> None:
        """No followers to release: the synthetic leader answers for every rank."""

    def kept_reports(self, workers: Sequence[int], first: int, end: int, timeout_s: float) -> list[StepTelemetry]:
        return []

    def wait(self, calls: Sequence[Call], num_returns: int, timeout_s: float) -> tuple[list[Call], list[Call]]:
        return list(calls), []

    def result(self, call: Call) -> Any:
        return pickle.loads(call.handle)

    def progress(self, timeout_s: float) -> dict[int, Progress | None]:
        return {w: Progress(self._next_step - 1, Phase.DONE, 0.0, self._next_step) for w in self.workers}

    def abort_all(self, generation: int, pending: Sequence[Call], timeout_s: float) -> None:
        raise AssertionError("nothing fails in the synthetic group")

    def _kill(self, member: SyntheticMember) -> None:
        raise AssertionError("nothing dies in the synthetic group")

    def fill_slots(self, dead_nodes: set[str]) -> int:
        return 0

    def ready_joiners(self, timeout_s: float = 0.0) -> list[SyntheticMember]:
        return []

    def snapshot(self, requests: Sequence[SnapshotRequest], timeout_s: float) -> tuple[list[Call], list[Call]]:
        raise AssertionError("the synthetic job takes no checkpoints")

    def await_writes(self, requests: Sequence[SnapshotRequest], timeout_s: float) -> list[Call]:
        raise AssertionError("the synthetic job takes no checkpoints")

    def cancel_writes(self, workers: Sequence[int], name: str, tag: str) -> None:
        raise AssertionError("the synthetic job takes no checkpoints")

    def restore(self, root: str, name: str, manifest: dict[str, Any]) -> None:
        raise AssertionError("the synthetic job does not resume")

    def evaluate(self, timeout_s: float) -> dict[str, float]:
        return {}

    def model_state(self, timeout_s: float) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        self.members = []


def measure_synthetic(job: JobConfig, scratch: Path, metrics: bool = False) -> dict[str, Any]:
    """Run ``job`` (its ``scaling.workers`` ranks) through ``JobController`` on a
    ``SyntheticGroup``; its summary's ``control_plane`` medians, with ``driver_cpu_ms`` less
    the CPU spent making the synthetic answers (spread over the steps), and ``workers``.
    ``metrics``: with the job's Prometheus listener (needs Ray initialised here)."""
    run = RunDirectory(scratch / f"synthetic-{job.scaling.workers}")
    group = SyntheticGroup(job)
    store = RendezvousStore("127.0.0.1", 30.0)
    try:
        controller = JobController(
            job, run, group, store, chaos=ChaosControl(job.chaos, None, 0, run.event), launched=time.perf_counter(),
            progress=False,
        )
        if metrics:
            run.subscribe(MetricsListener(JobMetrics(job.name), controller.accounting, run.event))
        summary = controller.execute().summary
    finally:
        store.close()
    if summary["status"] != "finished":
        raise RuntimeError(f"the synthetic job with {job.scaling.workers} ranks ended {summary['status']}: {summary.get('error')}")
    measured = dict(summary["control_plane"])
    build_ms = 1000.0 * group.build_s / max(1, group.steps_built)
    measured["synthetic_build_ms"] = build_ms
    measured["driver_cpu_ms"] = measured["driver_cpu_ms"] - build_ms
    measured["driver_busy_ms"] = measured["driver_busy_ms"] - build_ms
    return {"workers": job.scaling.workers, **measured}


def main_synthetic(job_of: Any, counts: list[int], steps: int) -> list[dict[str, Any]]:
    """``measure_synthetic`` of ``job_of(n, steps)`` for each of ``counts``, with the metrics
    listener (a local Ray started here for it), printed as it goes."""
    import ray

    rows = []
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="driver-scale-") as tmp:
            for count in counts:
                row = measure_synthetic(job_of(count, steps), Path(tmp), metrics=True)
                row["worker_gauges_ms"] = worker_gauges_ms(count)
                rows.append(_measured(row))
    finally:
        ray.shutdown()
    return rows


def worker_gauges_ms(ranks: int) -> float:
    """Milliseconds of one pass setting the per-worker gauges of ``ranks`` workers (done every
    ``WORKER_GAUGES_EVERY_S``: the synthetic steps take no wall time, so a run makes ~one)."""
    metrics = JobMetrics("gauges")
    started = time.thread_time()
    for worker in range(ranks):
        metrics._set("ringleader_worker_shard_seconds", 0.01, worker=str(worker))
    return 1000.0 * (time.thread_time() - started)


def _measured(row: dict[str, Any]) -> dict[str, Any]:
    """``row``, printed."""
    print(
        f"synthetic {row['workers']:>6} ranks: driver CPU {row['driver_cpu_ms']:8.2f} ms, busy {row['driver_busy_ms']:8.2f} ms "
        f"per step (the synthetic answers, {row['synthetic_build_ms']:.2f} ms, taken out); "
        f"{row['steps_per_call']:.1f} steps per call; the per-worker gauges {row['worker_gauges_ms']:.1f} ms every "
        f"{WORKER_GAUGES_EVERY_S:.0f} s, so {row['worker_gauges_ms'] / WORKER_GAUGES_EVERY_S:.1f} ms a 1 s step",
        flush=True,
    )
    return row
