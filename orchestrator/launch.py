"""Launching a job: Ray starts while torch and the user's code load, then the driver takes over.

Starting a local Ray takes seconds, spent mostly waiting on its processes; importing torch and
the job's factories takes seconds of CPU. Done one after the other they were most of the
launch-to-first-step time, so this module imports nothing heavy and runs them side by side.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from jobspec.stream import DataFeed
from jobspec.fields import ConfigError, first_line
from jobspec.job import JobConfig
from jobspec.recipe import BUILTIN_LOSSES
from orchestrator.job.loss_check import LossTrial
from orchestrator.job.reading import resolve_job
from orchestrator.output.run_dir import RunDirectory, RunListener

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from orchestrator.accounting.summary import JobResult
    from orchestrator.checkpoints.resume_point import ResumePoint
    from orchestrator.group.chaos_control import ChaosControl
    from orchestrator.group.ray_group import RayWorkerGroup

# Imports cannot hang, but a wedged file system could; never wait forever.
PRELOAD_TIMEOUT_S = 300.0
# How long the launch waits for a user's loss to be tried (check_loss, in a child process
# killed then: orchestrator/job/loss_check.py), from when the child has the job: a convenience, an
# early refusal of a scalar loss, not worth delaying Ray's start for long; the workers refuse
# one at step 0 anyway.
LOSS_CHECK_S = 20.0
# A cluster address is tried before Ray is: Ray itself retries a dead one for minutes.
CONNECT_CHECK_S = 5.0


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
    Yields a RaySession. Raises ConfigError, before Ray is started or joined, if
    ``local_nodes`` is not an integer >= 0 or is combined with an address, or if no cluster
    answers at the address (``address``, else ``RAY_ADDRESS``).
    """
    import ray

    check_local_nodes(local_nodes, address or os.environ.get("RAY_ADDRESS") or ray.is_initialized())
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
    if address or os.environ.get("RAY_ADDRESS"):
        where = "address" if address else "RAY_ADDRESS"
        target = address or os.environ["RAY_ADDRESS"]
        _check_reachable(target, where)
        try:
            ray.init(address=address, logging_level="WARNING")
        except ConnectionError as err:  # "auto" with no cluster on this machine, and the like
            raise ConfigError(f"{where} {target}: no Ray cluster to join ({first_line(err)})") from None
    else:
        with _quiet_token_notice():
            ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    try:
        yield RaySession(None, started_here=not address and not os.environ.get("RAY_ADDRESS"))
    finally:
        ray.shutdown()


def check_local_nodes(local_nodes: Any, joining: Any = False) -> None:
    """ConfigError unless ``local_nodes`` is an integer >= 0, and 0 when ``joining`` a
    cluster (an address, ``RAY_ADDRESS`` or this process's Ray): local nodes are a cluster of
    their own."""
    if isinstance(local_nodes, bool) or not isinstance(local_nodes, int) or local_nodes < 0:
        raise ConfigError(f"local_nodes (--local-nodes): expected an integer >= 0, got {local_nodes!r}")
    if local_nodes and joining:
        raise ConfigError(
            "local_nodes (--local-nodes) starts its own cluster; it cannot join one (an address, RAY_ADDRESS, "
            "or the Ray this process already runs)"
        )


def _check_reachable(address: str, where: str) -> None:
    """ConfigError naming ``where`` unless something accepts a connection where Ray would
    dial for ``address`` (its ``host:port``, localhost as Ray resolves it); forms Ray resolves
    otherwise (``auto``, ``ray://``) are left to it."""
    from ray._private.services import canonicalize_bootstrap_address

    if address == "auto" or "://" in address:
        return
    try:
        dialled = canonicalize_bootstrap_address(address)
    except ValueError as err:
        raise ConfigError(f"{where} {address}: not a Ray address ({first_line(err)}); expected HOST:PORT or auto") from None
    host, _, port = (dialled or "").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_CHECK_S).close()
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        raise ConfigError(f"{where} {address}: no Ray cluster answers there ({reason})") from None


class _TokenNoticeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


@contextlib.contextmanager
def _quiet_token_notice() -> Iterator[None]:
    """Drop Ray's notice that the cluster it starts has token authentication on: a cluster
    ringleader starts for its own job should not warn the user about itself. Only that
    notice, only while the local cluster starts; joining a user's cluster keeps Ray's words."""
    noisy = logging.getLogger("ray._private.authentication.authentication_token_setup")
    quiet = _TokenNoticeFilter()
    noisy.addFilter(quiet)
    try:
        yield
    finally:
        noisy.removeFilter(quiet)




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
    from orchestrator.output.tracking import TrackingListener, make_trackers

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


def _preload(job: JobConfig, source: str, checked: Future[None]) -> None:
    """Import torch, check the job's user code (``resolve_job``, and a user's loss in a
    ``LossTrial`` for at most ``LOSS_CHECK_S``), settling ``checked`` with the outcome
    (whatever fails, the import of torch included: the launch waits on it), then import the
    driver's modules. Raises ConfigError for a bad factory or loss."""
    try:
        with LossTrial(job, source) as trial:  # its child imports torch beside this thread
            import torch  # noqa: F401 - the bulk of the work, first, before anything waits on it

            resolve_job(job, source)
            trial.settle(LOSS_CHECK_S)
    except BaseException as err:
        checked.set_exception(err)
        raise
    checked.set_result(None)
    import orchestrator.controller  # noqa: F401
    import orchestrator.group.ray_group  # noqa: F401 - imports Ray's actor machinery and torch


def _wait(future: Future[None], source: str) -> None:
    try:
        future.result(timeout=PRELOAD_TIMEOUT_S)
    except FutureTimeout:
        raise LaunchTimeout(
            f"importing torch and the job's code ({source}) did not finish within {PRELOAD_TIMEOUT_S:.0f}s"
        ) from None


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
    alongside Ray's start, and still before any worker starts (before Ray starts for a job
    with a user's loss, which ``check_loss`` tries once, on a meta-device model, in a child
    process killed after ``LOSS_CHECK_S``). A ``run_dir`` an earlier run left (with its ``job.json``) is
    resumed from its newest good checkpoint (from step 0 if it has none); checkpoints that
    fail verification are reported through ``warn`` and skipped. Returns the run directory
    and summary whatever the outcome; ``summary["status"]`` is ``finished``, ``failed`` or
    ``stopped``. Raises FileExistsError if ``run_dir`` is not empty and not a run, and
    ConfigError (before any actor starts) if a factory or the optimizer does not resolve,
    chaos needs local nodes, or the checkpoint is another job's, and before Ray starts if
    ``local_nodes`` or the address is bad or a user's loss returns a scalar (when the check
    finishes in time; else the workers refuse it at step 0); ``source`` names the job in that
    message. Raises NamespaceBusy (a ConfigError) if another live driver holds the run's
    checkpoint namespace (``orchestrator/checkpoints/namespace.py``).
    ``listeners`` are told what the run records (``RunDirectory.subscribe``); ``within``: a
    placement group reserved for the job (a Tune trial's) to run the workers in.
    """
    launched = time.perf_counter()
    path, resuming, resume = _run_directory(job, address, local_nodes, run_dir, source, warn)
    if resume is not None:
        job = resume.job  # an old run goes on in the epoch order it started in
    checked: Future[None] = Future()
    preload = _in_background(_preload, job, source, checked)
    if job.loss.name not in BUILTIN_LOSSES:
        # A user's loss is tried before Ray starts (LossTrial): that costs the overlap of
        # Ray's start with torch's import, and at most LOSS_CHECK_S more, for these jobs
        # only. Whatever _preload raises (torch's import failing too) ends here.
        _wait(checked, source)
    with ray_session(address, local_nodes) as session, contextlib.ExitStack() as held:
        ray_ready = time.perf_counter() - launched
        _wait(preload, source)
        from orchestrator.checkpoints.namespace import hold_namespace
        from orchestrator.controller import JobController
        from orchestrator.output.metrics import JobMetrics, MetricsListener
        from orchestrator.store.rendezvous import driver_store

        run = RunDirectory(path, resume=resuming)
        # Closed on every way out, after the lease is released; a new run that fails before its
        # job.json is saved (its checkpoint storage unreachable, say) leaves its folder free again.
        held.callback(run.close, discard_unsaved=True)
        # Before job.json is saved: a second driver of the run, or a copy of it, is refused.
        lease = held.enter_context(hold_namespace(job, run, warn))
        _track(job, run)
        for listener in listeners:
            run.subscribe(listener)
        run.save_job(job.model_dump(mode="json", exclude_unset=True))

        from orchestrator.data.index import run_indexes
        from orchestrator.data.streams import fed_streams, leave_room_for_streams

        def noted(message: str) -> None:
            run.event("data_index", message=message)

        data: dict[str, DataFeed] = {
            **run_indexes({"dataset": job.dataset, "eval": job.eval}, run.path, resuming, job.timeouts.start_s, noted)
        }
        # A stream's chunk is a step's rows (an eval batch's): a worker takes its shards' rows
        # from one or two chunks a step, one call to the feeder; rows from several calls
        # cost more than a worker's share of a step moved (measured: docs/benchmarks.md#data).
        streams = {"dataset": (job.dataset, job.batch_size)}
        if job.eval is not None:
            streams["eval"] = (job.eval, job.eval.batch_size)
        fixed = session.started_here and not job.chaos.add_node
        data.update(held.enter_context(fed_streams(
            streams, run.path, resuming, job.timeouts.start_s, noted, lambda: leave_room_for_streams(job, fixed, warn),
        )))
        group, chaos = _worker_group(job, run, session, local_nodes, within, warn, data)
        store = driver_store(job.timeouts.rendezvous_s, job.stragglers.claim_store_count(job.scaling.max_workers))
        try:
            controller = JobController(
                job, run, group, store, chaos=chaos, launched=launched, progress=progress, resume=resume, lease=lease,
            )
            run.subscribe(MetricsListener(JobMetrics(job.name), controller.accounting, run.event))
            controller.accounting.mark("ray_ready", ray_ready)
            return controller.execute()
        finally:
            store.close()


def _run_directory(
    job: JobConfig, address: str | None, local_nodes: int, run_dir: Path | None, source: str, warn: Callable[[str], None]
) -> tuple[Path, bool, ResumePoint | None]:
    """Before anything starts: the run directory (absolute, once: workers may run in another
    working directory than the driver), whether it is an earlier run's, and where that run
    resumes (None: from step 0). Raises ConfigError for bad ``local_nodes`` or chaos that needs
    them, FileExistsError for a directory that is neither free nor a run."""
    check_local_nodes(local_nodes, address or os.environ.get("RAY_ADDRESS"))
    path = (run_dir or default_run_dir(job)).absolute()
    if job.chaos.needs_local_nodes and not local_nodes:
        raise ConfigError(f"invalid job ({source}): chaos.kill with how: remove_node and chaos.add_node need --local-nodes N")
    if not RunDirectory.is_run(path):
        RunDirectory.ensure_free(path)
        return path, False, None
    from orchestrator.checkpoints.resume_point import find_resume_point

    return path, True, find_resume_point(job, path, warn)


def _worker_group(
    job: JobConfig, run: RunDirectory, session: RaySession, local_nodes: int, within: PlacementGroup | None,
    warn: Callable[[str], None], data: dict[str, DataFeed],
) -> tuple[RayWorkerGroup, ChaosControl]:
    """The job's Ray worker group (in ``within``, if given; its workers reading the file sources
    ``data`` indexes) and the driver's half of its chaos, both recording into ``run``; a wait for
    resources is also told to ``warn``."""
    from orchestrator.group.chaos_control import ChaosControl
    from orchestrator.group.ray_group import RayWorkerGroup

    def waiting(message: str) -> None:
        run.event("waiting_for_resources", message=message)
        warn(message)

    group = RayWorkerGroup(
        # Chaos that adds nodes makes even a local cluster grow.
        job, fixed_cluster=session.started_here and not job.chaos.add_node, on_wait=waiting, within=within,
        on_collective=lambda choice: run.event("collective_choice", **choice.to_json()), data=data,
    )
    node_cpus = local_node_cpus(local_nodes) if local_nodes else 0
    return group, ChaosControl(job.chaos, session.cluster, node_cpus, run.event)
