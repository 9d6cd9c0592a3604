"""``ringleader.run`` and ``ringleader.resume``: the CLI's ``run``/``resume`` as functions.

A job is a ``JobConfig``, a mapping of the same fields (a parsed YAML file) or the path of a
YAML job file. Where a job file names a ``package.module:function``, Python code may pass the
function (or class) itself: model and dataset factories, ``collate``, ``loss``,
``eval.metrics``, ``schedule.name`` and ``optimizer.name``. Ray ships such callables to the
workers by value (cloudpickle), so they may be defined in a notebook or in ``__main__``.
``job.json`` records a callable as ``module:qualname``, which imports again only when it is
defined at the top level of an importable module: to resume a run of other callables, pass the
job again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from typing_extensions import Unpack

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from orchestrator.job.reading import apply_overrides, job_from_mapping, load_job
from orchestrator.output.run_dir import JOB_FILE, RunDirectory

JobLike = JobConfig | Mapping[str, Any] | str | Path | None


@dataclass(frozen=True)
class RunResult:
    """A job's outcome: its run directory and summary (``summary.json`` there).

    ``status`` is ``finished``, ``failed`` or ``stopped``; a failed job's ``error`` says why
    (the job's failure is reported, not raised: its checkpoints and events are in ``run_dir``).
    """

    run_dir: Path
    summary: dict[str, Any]

    @property
    def status(self) -> str:
        return str(self.summary["status"])

    @property
    def error(self) -> str | None:
        return self.summary.get("error")

    @property
    def metrics(self) -> dict[str, float]:
        """The final evaluation's metrics ({} without an eval dataset)."""
        return dict(self.summary.get("eval") or {})

    def model_state(self) -> dict[str, Any]:
        """The trained parameters and buffers (``model.pt``), as CPU tensors by name."""
        import torch

        return torch.load(self.run_dir / "model.pt", weights_only=True)


def as_job(job: JobLike, overrides: Sequence[str] | None = ()) -> JobConfig:
    """``job`` validated into a JobConfig, with CLI-style ``overrides`` (``["steps=50"]``;
    None: none) applied to a mapping or file. Raises ConfigError naming the field on any problem."""
    overrides = _override_list(overrides)
    if isinstance(job, JobConfig):
        if overrides:
            return job_from_mapping(apply_overrides(job.model_dump(exclude_unset=True), list(overrides)), "Python job")
        return job
    if job is None or isinstance(job, (str, Path)):
        return load_job(job, list(overrides), resolve=False)
    if isinstance(job, Mapping):
        return job_from_mapping(apply_overrides(dict(job), list(overrides)), "Python job")
    raise ConfigError(f"job: expected a JobConfig, a mapping or a job file path, got {type(job).__name__}")


def _override_list(overrides: Any) -> list[str]:
    """``overrides`` as a list (None: none), or ConfigError if it is not a sequence of
    strings (a lone ``"steps=50"`` would otherwise be read letter by letter)."""
    if overrides is None:
        return []
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Sequence) or not all(
        isinstance(item, str) for item in overrides
    ):
        raise ConfigError(f"overrides: expected a list of 'FIELD=VALUE' strings, e.g. overrides=['steps=50'], got {overrides!r}")
    return list(overrides)


class LaunchOptions(TypedDict, total=False):
    """How ``run`` and ``resume`` launch a job, by keyword, all optional (a keyword that is
    none of these is a TypeError, as for any function).

    ``overrides``: CLI-style changes to the job (``["steps=600"]``; None: none). ``local_nodes``:
    simulated Ray nodes on this machine (0: none). ``progress``: a progress bar on stderr.
    ``warn``: called with each warning for the user. ``dataset``: a ``ray.data.Dataset`` to
    train on, in place of the job's ``dataset`` source (its ``column``, ``collate`` and
    ``ahead_steps`` stay). To ``resume`` such a run, pass the job and the dataset again (job.json
    records the dataset as a callable that does not import). A bad value of any is a ConfigError,
    raised before Ray starts.
    """

    overrides: Sequence[str] | None
    local_nodes: int
    progress: bool
    warn: Callable[[str], None]
    dataset: Any


def _check_options(function: str, options: Mapping[str, Any]) -> None:
    """TypeError naming the first key of ``options`` that is no ``LaunchOptions`` field (a
    misspelt ``local_node`` must not quietly run something else)."""
    known = LaunchOptions.__required_keys__ | LaunchOptions.__optional_keys__
    for name in options:
        if name not in known:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r} (it takes {sorted(known)})")


def run(
    job: JobLike = None, run_dir: str | Path | None = None, address: str | None = None, **options: Unpack[LaunchOptions]
) -> RunResult:
    """Train ``job`` (default: the built-in example) to the end and return its result.

    ``run_dir``: where its files go (default ``job.run_dir``, else ``runs/<name>-<time>``); a
    directory an earlier run left is resumed (see ``resume``). ``address``: a Ray cluster to
    join; none uses the Ray this process already initialised, else ``RAY_ADDRESS``, else a
    fresh local one. ``options``: see ``LaunchOptions``. Raises ConfigError (before any worker
    starts) for a bad job, FileExistsError if ``run_dir`` holds something that is not a run,
    and TypeError for an unknown keyword.
    """
    from orchestrator.launch import default_run_dir, run_job

    _check_options("run", options)
    config = as_job(job, options.get("overrides", ()))
    if options.get("dataset") is not None:
        config = _streaming(config, options["dataset"])
    path = Path(run_dir) if run_dir is not None else default_run_dir(config)
    result = run_job(
        config, address=address, local_nodes=options.get("local_nodes", 0), run_dir=path,
        progress=options.get("progress", False), source=str(job) if isinstance(job, (str, Path)) else "Python job",
        warn=options.get("warn", lambda message: None),
    )
    return RunResult(result.run_dir, result.summary)


def _streaming(job: JobConfig, dataset: Any) -> JobConfig:
    """``job`` with ``dataset`` (a ``ray.data.Dataset``) as its training data: ``dataset.ray_data``."""
    def given_dataset() -> Any:
        return dataset

    kept = job.dataset.model_dump(include={"column", "collate", "ahead_steps"}, exclude_unset=True)
    return job_from_mapping({**job.model_dump(exclude_unset=True), "dataset": {**kept, "ray_data": given_dataset}}, "Python job")


def resume(
    run_dir: str | Path, job: JobLike = None, address: str | None = None, **options: Unpack[LaunchOptions]
) -> RunResult:
    """Go on with the run in ``run_dir`` from its newest good checkpoint, on any worker count.

    ``job`` defaults to the run's ``job.json`` (pass it again when it holds callables that do
    not import by name); ``address`` and ``options`` as for ``run``, whose ``overrides`` change the job, e.g.
    ``["steps=600"]`` to train longer. Raises ConfigError if ``run_dir`` is not a run, or the
    job is not the one checkpointed, and TypeError for an unknown keyword.
    """
    _check_options("resume", options)
    path = Path(run_dir)
    if not RunDirectory.is_run(path):
        raise ConfigError(f"{path} is not a run directory (no {JOB_FILE})")
    if job is None:
        overrides = _override_list(options.get("overrides", ()))
        try:
            job = load_job(path / JOB_FILE, overrides, resolve=False)
        except ConfigError as err:
            raise ConfigError(f"{err}\n(if the run was given Python callables, pass job= again)") from None
        options = {**options, "overrides": ()}
    return run(job, path, address, **options)
