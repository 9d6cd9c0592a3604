"""The peers of the recovery benchmark: how long Ray Train's ``FailureConfig`` (restart the
group from the last checkpoint) and Ray Train + torchft (replace the dead replica group, which
heals from a live peer) take to get training going again after a worker is SIGKILLed, and what
they lose.

The runs themselves are ``benchmarks/raytrain_recovery_entry.py`` and
``benchmarks/torchft_entry.py`` (their docstrings define every number), launched in a fresh
process exactly as ``benchmarks.throughput.run_once`` launches the peers' throughput runs: each
starts its own local Ray, never one this process points at.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

from benchmarks.throughput import BenchmarkError, run_command
from jobspec.job import JobConfig


def ray_train_recovery_command(
    job_file: Path, result: Path, kill_step: int, kill_rank: int, checkpoint_every: int
) -> list[str]:
    """The command line of one recovery run (``python -m benchmarks.raytrain_recovery_entry ...``)."""
    return [
        sys.executable, "-m", "benchmarks.raytrain_recovery_entry",
        "--job", str(job_file), "--result", str(result),
        "--kill-step", str(kill_step), "--kill-rank", str(kill_rank), "--checkpoint-every", str(checkpoint_every),
    ]


def torchft_recovery_command(job_file: Path, result: Path, kill_step: int, kill_rank: int, scratch: Path) -> list[str]:
    """The command line of one torchft recovery run (``python -m benchmarks.torchft_entry ...``)."""
    return [
        sys.executable, "-m", "benchmarks.torchft_entry", "--job", str(job_file), "--result", str(result),
        "--kill-step", str(kill_step), "--kill-rank", str(kill_rank), "--scratch", str(scratch),
    ]


def run_ray_train_recovery(
    job: JobConfig, workdir: Path, kill_step: int, kill_rank: int, checkpoint_every: int, timeout_s: float = 600
) -> dict[str, Any]:
    """Run ``job`` under Ray Train, kill rank ``kill_rank`` in (0-based) step ``kill_step`` of the
    first attempt, checkpoint every ``checkpoint_every`` steps, and return the entry's result:
    ``recovery_s``, ``full_size_s``, ``restart_s``, ``steps_lost``, ``samples_dropped``,
    ``resumed_from``, ``first_step_after``, ``wall_s``, ``attempts``, ``final_loss`` and more
    (see ``benchmarks.raytrain_recovery_entry``); rank 0's final parameters are in
    ``workdir/model.pt``.

    Writes ``job.json`` and ``result.json`` in ``workdir`` (created if missing). Raises
    ``BenchmarkError`` (a ``RuntimeError``) carrying the end of the run's output when it exits
    non-zero, writes no result, or runs longer than ``timeout_s``.
    """
    return _run_entry(
        job, workdir, timeout_s, "ray_train recovery run",
        lambda job_file, result: ray_train_recovery_command(job_file, result, kill_step, kill_rank, checkpoint_every),
    )


def run_torchft_recovery(
    job: JobConfig, workdir: Path, kill_step: int, kill_rank: int, timeout_s: float = 600
) -> dict[str, Any]:
    """Run ``job`` under Ray Train + torchft, kill worker ``kill_rank`` in step ``kill_step`` of
    its first life and return ``benchmarks.torchft_entry.summarize``'s figures (``recovery_s``,
    ``full_size_s``, ``steps_lost``, ``samples_dropped``, ...) with ``eval`` and ``final_loss``;
    replica 0's final parameters are in ``workdir/model.pt``. Errors as
    ``run_ray_train_recovery``'s."""
    return _run_entry(
        job, workdir, timeout_s, "torchft recovery run",
        lambda job_file, result: torchft_recovery_command(job_file, result, kill_step, kill_rank, workdir / "scratch"),
    )


def _run_entry(
    job: JobConfig, workdir: Path, timeout_s: float, what: str, command: Callable[[Path, Path], list[str]]
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    job_file = workdir / "job.json"
    job_file.write_text(job.model_dump_json())
    result = workdir / "result.json"
    result.unlink(missing_ok=True)  # never read a stale result from an earlier run
    run_command([*command(job_file, result), "--model", str(workdir / "model.pt")], timeout_s, what)
    if not result.exists():
        raise BenchmarkError(f"{what} wrote no result at {result}")
    return json.loads(result.read_text())


__all__ = ["ray_train_recovery_command", "run_ray_train_recovery", "run_torchft_recovery", "torchft_recovery_command"]
