"""A job's Ray Data streams on the driver's side: each ``ray_data`` source built (a lazy plan,
checked for a deterministic order), its feeder actor started and its rows counted, the count
kept in the run directory (a resumed run whose stream changed length is refused), and at the
end the feeders' figures recorded and the feeders stopped. The driver never touches a row."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

from jobspec import targets as factories
from jobspec.durable import write_atomic
from jobspec.job import JobConfig
from jobspec.recipe import DataSource
from jobspec.stream import FedStream
from orchestrator.data.feeder import StreamFeeder, unseeded_shuffles
from orchestrator.data.index import refused
from orchestrator.data.stream_passes import is_hf_stream


def stream_path(run_dir: Path, name: str) -> Path:
    return run_dir / "data" / f"{name}-stream.json"


def leave_room_for_streams(job: JobConfig, fixed_cluster: bool, warn: Callable[[str], None]) -> None:
    """A job with a Ray Data stream needs a CPU its workers leave free: Ray Data runs the
    pipeline in tasks that take one each, and with every CPU held by a worker its first read
    waits until it times out. On a ``fixed_cluster`` (its resources are all it will have) that
    is a ConfigError naming the field; elsewhere (an autoscaler may add a node) a warning."""
    if all(source is None or source.ray_data is None for source in (job.dataset, job.eval)):
        return
    total = ray.cluster_resources().get("CPU", 0.0)
    per_worker = job.scaling.resources_per_worker.get("CPU", 0.0)
    left = total - job.scaling.max_workers * per_worker
    if left >= 1:
        return
    problem = (
        f"a ray_data stream runs its pipeline in Ray tasks of a CPU each, and {job.scaling.max_workers} workers x "
        f"{per_worker:g} CPU leave {max(left, 0):g} of the cluster's {total:g}: give the workers fewer "
        "(resources_per_worker.CPU) or the cluster more"
    )
    if fixed_cluster:
        raise refused("scaling.resources_per_worker", problem)
    warn(f"scaling.resources_per_worker: {problem}")


def feeder_path(run_dir: Path, name: str) -> Path:
    return run_dir / "data" / f"{name}-feeder.json"


def build_stream(source: DataSource, name: str) -> Any:
    """``source.ray_data`` called with its ``kwargs``: a ``ray.data.Dataset`` whose plan runs in
    the same order every pass, or a Hugging Face ``IterableDataset``. Raises ConfigError naming
    the field otherwise."""
    import ray.data  # heavy: only for jobs that stream

    assert source.ray_data is not None
    dataset = factories.build(source.ray_data, source.kwargs)
    if is_hf_stream(dataset):  # iterated in its own order by the feeder
        return dataset
    if not isinstance(dataset, ray.data.Dataset):
        raise refused(
            f"{name}.ray_data", f"{source.ray_data!r} returned a {type(dataset).__name__}, expected a ray.data.Dataset "
            "or a Hugging Face datasets.IterableDataset",
        )
    unseeded = unseeded_shuffles(dataset)
    if unseeded:
        raise refused(
            f"{name}.ray_data", f"the dataset's order changes from pass to pass ({', '.join(unseeded)}): every epoch "
            "and every redone shard would read other samples; give each shuffle a fixed seed "
            "(seed=N; for a file shuffle FileShuffleConfig(seed=N, reseed_after_execution=False))",
        )
    return dataset


@contextmanager
def fed_streams(
    sources: dict[str, tuple[DataSource | None, int]], run_dir: Path, resuming: bool, timeout_s: float,
    note: Callable[[str], None], before_ray_data: Callable[[], None] = lambda: None,
) -> Iterator[dict[str, FedStream]]:
    """A feeder for each ``ray_data`` source of ``sources`` (name -> (source, rows a step
    reads: a chunk's)), running while the block runs; on the way out each feeder is stopped,
    its ``stats`` kept in ``feeder_path``. Raises ConfigError for a bad source, or one whose
    row count differs from the count the run recorded when it began. ``before_ray_data()`` is
    called once, before any feeder starts, if a source is a Ray Data pipeline (not for a
    Hugging Face stream: the feeder iterates that one itself, in no task of its own)."""
    built = {
        name: (source, build_stream(source, name), step_rows)
        for name, (source, step_rows) in sources.items() if source is not None and source.ray_data is not None
    }
    if any(not is_hf_stream(dataset) for _, dataset, _ in built.values()):
        before_ray_data()
    feeders: dict[str, Any] = {}
    try:
        yield {name: _start(name, source, dataset, step_rows, run_dir, resuming, timeout_s, feeders, note)
               for name, (source, dataset, step_rows) in built.items()}
    finally:
        for name, feeder in feeders.items():
            _stop(name, feeder, run_dir, timeout_s)


def _stop(name: str, feeder: Any, run_dir: Path, timeout_s: float) -> None:
    """Keep ``feeder``'s figures in ``feeder_path`` (its error, if it cannot give them) and
    stop it; never raises, so the job's own outcome is what a caller sees."""
    try:
        figures = ray.get(feeder.stats.remote(), timeout=timeout_s)
    except Exception as err:  # noqa: BLE001 - the figures are a report
        figures = {"error": f"{type(err).__name__}: {err}"}
    try:
        ray.kill(feeder)
    except Exception:  # noqa: BLE001 - gone already: nothing to stop
        pass
    text = json.dumps(figures).encode()
    try:
        feeder_path(run_dir, name).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(feeder_path(run_dir, name), lambda out: out.write(text))
    except OSError:  # the report is lost; the error the job ended with is the one to see
        pass


def _start(
    name: str, source: DataSource, dataset: Any, chunk_rows: int, run_dir: Path, resuming: bool, timeout_s: float,
    feeders: dict[str, Any], note: Callable[[str], None],
) -> FedStream:
    # A step's chunk and the next (a step that crosses an epoch's end spans two), for each
    # step held ahead.
    held = 2 * source.ahead_steps
    feeder = ray.remote(StreamFeeder).options(num_cpus=0, max_restarts=-1, max_task_retries=-1).remote(
        dataset, chunk_rows, held, timeout_s
    )
    feeders[name] = feeder
    samples = ray.get(feeder.samples.remote(), timeout=timeout_s)
    if samples == 0:
        raise refused(f"{name}.ray_data", "the dataset yields no rows")
    path = stream_path(run_dir, name)
    if resuming and path.is_file():
        recorded = json.loads(path.read_text())["samples"]
        if recorded != samples:
            raise refused(f"{name}.ray_data", f"the stream changed since the run began: {samples} rows a pass, it had {recorded}")
    else:
        text = json.dumps({"samples": samples}).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda out: out.write(text))
    note(f"{name}: {samples} rows a pass from {source.ray_data!r}, {held} chunks of {chunk_rows} held at most")
    return FedStream(feeder, samples, chunk_rows, source.column, timeout_s)
