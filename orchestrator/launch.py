"""Launching a job: Ray starts while torch and the user's code load, then the driver takes over.

Starting a local Ray takes seconds, spent mostly waiting on its processes; importing torch and
the job's factories takes seconds of CPU. Done one after the other they were most of the
launch-to-first-step time, so this module imports nothing heavy and runs them side by side.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from orchestrator.job_file import resolve_job
from orchestrator.run_dir import RunDirectory, RunListener

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from orchestrator.summary import JobResult

# Imports cannot hang, but a wedged file system could; never wait forever.
PRELOAD_TIMEOUT_S = 300.0


class LaunchTimeout(RuntimeError):
    """Launching did not finish in time (nothing was started that outlives it)."""


@dataclass(frozen=True)
class RaySession:
    """The Ray a job runs on: ``cluster``, the local ``ray.cluster_utils.Cluster`` (for chaos
    that adds and removes nodes) or None; ``started_here``: this process started it, so its
    resources are all it will ever have (no autoscaler behind it)."""

    cluster: Any
    started_here: bool


@contextlib.contextmanager
def ray_session(address: str | None, local_nodes: int = 0) -> Iterator[RaySession]:
    """Use the Ray already initialised in this process, else connect or start one.

    No ``address`` and no ``RAY_ADDRESS`` (set by ``ray job submit``) starts a fresh local Ray,
    which is shut down on exit; a given address joins that cluster. ``local_nodes`` > 0 starts
    that many simulated Ray nodes on this machine instead (``ray.cluster_utils.Cluster``, each
    with an equal share of its CPUs), for trying node loss and the hierarchical all-reduce.
    Yields a RaySession. Raises ValueError if ``local_nodes`` is combined with an address.
    """
    import ray

    if local_nodes and (address or os.environ.get("RAY_ADDRESS") or ray.is_initialized()):
        raise ValueError("local_nodes starts its own cluster; it cannot join one (address, RAY_ADDRESS, or this process's Ray)")
    if ray.is_initialized():
        yield RaySession(None, started_here=False)
        return
    if local_nodes:
        with _local_cluster(local_nodes) as cluster:
            ray.init(address=cluster.address, logging_level="WARNING")
            try:
                yield RaySession(cluster, started_here=True)
            finally:
                ray.shutdown()
        return
    if address:
        ray.init(address=address, logging_level="WARNING")
    elif os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level="WARNING")
    else:
        ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    try:
        yield RaySession(None, started_here=not address and not os.environ.get("RAY_ADDRESS"))
    finally:
        ray.shutdown()


def local_node_cpus(nodes: int) -> int:
    """CPUs of each simulated node: this machine's, shared out."""
    return max(1, (os.cpu_count() or 1) // nodes)


@contextlib.contextmanager
def _local_cluster(nodes: int) -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    cpus = local_node_cpus(nodes)
    # Node loss is what local nodes are for: have Ray declare a removed node dead in ~1.5 s
    # rather than its production default (tens of seconds), so its bundles move on quickly.
    system_config = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": cpus, "include_dashboard": False, "_system_config": system_config},
    )
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus)
        yield cluster
    finally:
        cluster.shutdown()


def _track(job: JobConfig, run: RunDirectory) -> None:
    """Subscribe the job's trackers (``tracking``) to the run's record, if it asks for any."""
    config = job.tracking
    if config.tensorboard is None and config.mlflow is None and not config.callbacks:
        return
    from orchestrator.tracking import TrackingListener, make_trackers

    report = lambda kind, **fields: run.event(kind, quiet=True, **fields)  # noqa: E731
    try:
        trackers = make_trackers(config, run.path)
    except (ValueError, TypeError, ImportError) as err:
        raise ConfigError(f"field 'tracking': {err}") from None
    run.subscribe(TrackingListener(trackers, run.path, report))


def default_run_dir(job: JobConfig) -> Path:
    if job.run_dir:
        return Path(job.run_dir)
    return Path("runs") / f"{job.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _in_background(function: Callable[..., None], *args: Any) -> Future[None]:
    """Run ``function`` on a daemon thread. Not a ThreadPoolExecutor: its exit (and the
    interpreter's) would wait for a wedged import, so no timeout could bound it."""
    future: Future[None] = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as err:  # handed to whoever waits on the future
            future.set_exception(err)

    threading.Thread(target=run, name="ringleader-preload", daemon=True).start()
    return future


def _preload(job: JobConfig, source: str) -> None:
    """Import torch, the user's factories and the driver's modules; raises ConfigError for bad
    factories."""
    import torch  # noqa: F401 - the bulk of the work, first, before anything waits on it

    resolve_job(job, source)
    import orchestrator.controller  # noqa: F401
    import orchestrator.worker_group  # noqa: F401 - imports Ray's actor machinery and torch


def run_job(
    job: JobConfig,
    *,
    address: str | None = None,
    local_nodes: int = 0,
    run_dir: Path | None = None,
    progress: bool = False,
    source: str = "job",
    warn: Callable[[str], None] = lambda message: None,
    listeners: Sequence[RunListener] = (),
    within: PlacementGroup | None = None,
) -> JobResult:
    """Run ``job`` to the end on Ray (see ``ray_session`` for which Ray, and ``local_nodes``).

    ``job`` may come from ``load_job(..., resolve=False)``: the import-heavy checks run here,
    alongside Ray's start, and still before any worker starts. A ``run_dir`` an earlier run
    left (with its ``job.json``) is resumed from its newest good checkpoint (from step 0 if it
    has none); checkpoints that fail verification are reported through ``warn`` and skipped.
    Returns the run directory and summary whatever the outcome; ``summary["status"]`` is
    ``finished``, ``failed`` or ``stopped``. Raises FileExistsError if ``run_dir`` is not
    empty and not a run, and ConfigError (before any actor starts) if a factory or the
    optimizer does not resolve, chaos needs local nodes, or the checkpoint is another job's;
    ``source`` names the job in that message. Raises NamespaceBusy (a ConfigError) if another
    live driver holds the run's checkpoint namespace (``orchestrator/checkpoint_namespace.py``).
    ``listeners`` are told what the run records (``RunDirectory.subscribe``); ``within``: a
    placement group reserved for the job (a Tune trial's) to run the workers in.
    """
    launched = time.perf_counter()
    # Absolute here, once: workers may run in another working directory than the driver.
    path = (run_dir or default_run_dir(job)).absolute()
    if job.chaos.needs_local_nodes and not local_nodes:
        raise ConfigError(f"invalid job ({source}): chaos.kill with how: remove_node and chaos.add_node need --local-nodes N")
    resuming = RunDirectory.is_run(path)
    if not resuming:
        RunDirectory.ensure_free(path)
    resume = None
    if resuming:
        from orchestrator.checkpointing import find_resume_point

        resume = find_resume_point(job, path, warn)
    preload = _in_background(_preload, job, source)
    with ray_session(address, local_nodes) as session, contextlib.ExitStack() as held:
        ray_ready = time.perf_counter() - launched
        try:
            preload.result(timeout=PRELOAD_TIMEOUT_S)
        except FutureTimeout:
            raise LaunchTimeout(
                f"importing torch and the job's code ({source}) did not finish within {PRELOAD_TIMEOUT_S:.0f}s"
            ) from None
        from orchestrator.chaos_control import ChaosControl
        from orchestrator.checkpoint_namespace import hold_namespace
        from orchestrator.controller import JobController
        from orchestrator.metrics import JobMetrics, MetricsListener
        from orchestrator.ray_calls import driver_store
        from orchestrator.worker_group import RayWorkerGroup

        run = RunDirectory(path, resume=resuming)
        # Before anything is written there: a second driver of the run is refused, its job.json unsaved.
        lease = held.enter_context(hold_namespace(job, run))
        _track(job, run)
        for listener in listeners:
            run.subscribe(listener)
        run.save_job(job.model_dump(mode="json", exclude_unset=True))
        node_cpus = local_node_cpus(local_nodes) if local_nodes else 0

        def waiting(message: str) -> None:
            run.event("waiting_for_resources", message=message)
            warn(message)

        # Chaos that adds nodes makes even a local cluster grow.
        fixed = session.started_here and not job.chaos.add_node
        store = driver_store(job.timeouts.rendezvous_s)
        try:
            controller = JobController(
                job,
                run,
                RayWorkerGroup(
                    job, fixed_cluster=fixed, on_wait=waiting, within=within,
                    on_collective=lambda choice: run.event("collective_choice", **choice.to_json()),
                ),
                store,
                chaos=ChaosControl(job.chaos, session.cluster, node_cpus, run.event),
                launched=launched,
                progress=progress,
                resume=resume,
                lease=lease,
            )
            run.subscribe(MetricsListener(JobMetrics(job.name), controller.accounting, run.event))
            controller.accounting.mark("ray_ready", ray_ready)
            return controller.execute()
        finally:
            store.close()
