"""Launching a job: Ray starts while torch and the user's code load, then the driver takes over.

Starting a local Ray takes seconds, spent mostly waiting on its processes; importing torch and
the job's factories takes seconds of CPU. Done one after the other they were most of the
launch-to-first-step time, so this module imports nothing heavy and runs them side by side.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Iterator

from orchestrator.config import JobConfig, resolve_job
from orchestrator.run_dir import RunDirectory

if TYPE_CHECKING:
    from orchestrator.driver import JobResult

# Imports cannot hang, but a wedged file system could; never wait forever.
PRELOAD_TIMEOUT_S = 300.0


@contextlib.contextmanager
def ray_session(address: str | None, local_nodes: int = 0) -> Iterator[None]:
    """Use the Ray already initialised in this process, else connect or start one.

    No ``address`` and no ``RAY_ADDRESS`` (set by ``ray job submit``) starts a fresh local Ray,
    which is shut down on exit; a given address joins that cluster. ``local_nodes`` > 0 starts
    that many simulated Ray nodes on this machine instead (``ray.cluster_utils.Cluster``, each
    with an equal share of its CPUs), for trying node loss and the hierarchical all-reduce.
    Raises ValueError if ``local_nodes`` is combined with an address.
    """
    import ray

    if local_nodes and (address or os.environ.get("RAY_ADDRESS") or ray.is_initialized()):
        raise ValueError("local_nodes starts its own cluster; it cannot join one (address, RAY_ADDRESS, or this process's Ray)")
    if ray.is_initialized():
        yield
        return
    if local_nodes:
        with _local_cluster(local_nodes) as cluster_address:
            ray.init(address=cluster_address, logging_level="WARNING")
            try:
                yield
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
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _local_cluster(nodes: int) -> Iterator[str]:
    from ray.cluster_utils import Cluster

    cpus = max(1, (os.cpu_count() or 1) // nodes)
    cluster = Cluster(
        initialize_head=True, connect=False, head_node_args={"num_cpus": cpus, "include_dashboard": False}
    )
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus)
        yield cluster.address
    finally:
        cluster.shutdown()


def default_run_dir(job: JobConfig) -> Path:
    if job.run_dir:
        return Path(job.run_dir)
    return Path("runs") / f"{job.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _preload(job: JobConfig, source: str) -> ModuleType:
    """Import torch, the user's factories and the driver; raises ConfigError for bad factories."""
    import torch  # noqa: F401 - the bulk of the work, first, before anything waits on it

    resolve_job(job, source)
    import orchestrator.driver

    return orchestrator.driver


def run_job(
    job: JobConfig,
    *,
    address: str | None = None,
    local_nodes: int = 0,
    run_dir: Path | None = None,
    progress: bool = False,
    source: str = "job",
) -> JobResult:
    """Run ``job`` to the end on Ray (see ``ray_session`` for which Ray, and ``local_nodes``).

    ``job`` may come from ``load_job(..., resolve=False)``: the import-heavy checks run here,
    alongside Ray's start, and still before any worker starts. Returns the run directory and
    summary whatever the outcome; ``summary["status"]`` is ``finished``, ``failed`` or
    ``stopped``. Raises FileExistsError if ``run_dir`` is not empty and ConfigError (before
    any actor starts) if a factory or the optimizer does not resolve; ``source`` names the job
    in that message.
    """
    launched = time.perf_counter()
    path = run_dir or default_run_dir(job)
    RunDirectory.ensure_free(path)
    with ThreadPoolExecutor(1, thread_name_prefix="ringleader-preload") as pool:
        preload = pool.submit(_preload, job, source)
        with ray_session(address, local_nodes):
            ray_ready = time.perf_counter() - launched
            driver = preload.result(timeout=PRELOAD_TIMEOUT_S)
            job_driver = driver.JobDriver(job, RunDirectory(path), progress=progress, launched=launched)
            job_driver.mark("ray_ready", ray_ready)
            return job_driver.execute()
