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
def ray_session(address: str | None) -> Iterator[None]:
    """Use the Ray already initialised in this process, else connect or start one.

    No ``address`` and no ``RAY_ADDRESS`` (set by ``ray job submit``) starts a fresh local Ray,
    which is shut down on exit; a given address joins that cluster.
    """
    import ray

    if ray.is_initialized():
        yield
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
    run_dir: Path | None = None,
    progress: bool = False,
    source: str = "job",
) -> JobResult:
    """Run ``job`` to the end on Ray (see ``ray_session`` for which Ray).

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
        with ray_session(address):
            ray_ready = time.perf_counter() - launched
            driver = preload.result(timeout=PRELOAD_TIMEOUT_S)
            job_driver = driver.JobDriver(job, RunDirectory(path), progress=progress, launched=launched)
            job_driver.mark("ray_ready", ray_ready)
            return job_driver.execute()
