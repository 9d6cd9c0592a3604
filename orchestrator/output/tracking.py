"""Experiment tracking from the driver: one writer per job, fed from the run's own record.

``RunDirectory`` hands every event (and the saved model and summary) to its listeners; a
``TrackingListener`` turns them into calls on ``Tracker``s: TensorBoard, MLflow, or any object
a user names in ``tracking.callbacks`` with some of the same methods (W&B works this way:
``wandb.init(mode="offline")`` in ``start``, ``wandb.log`` in ``log_step``). A tracker that
raises is reported once (a ``tracking_failed`` event) and dropped: tracking never fails a job.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from jobspec import targets as factories
from jobspec.runtime import TrackingConfig

#: What a step event carries that trackers log, by metric name.
STEP_METRICS = ("loss", "lr", "grad_norm", "step_s", "weight", "weight_per_s")


class Tracker(Protocol):
    """The callback interface. Every method is optional for a user's tracker."""

    def start(self, run_dir: Path, config: Mapping[str, Any]) -> None: ...
    def log_step(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def finish(self, status: str, summary: Mapping[str, Any], model: Path | None) -> None: ...


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}`` (lists kept whole)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


class TensorBoardTracker:
    """Scalars ``train/<metric>`` per step and ``eval/<metric>``, the config and summary as text."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._writer: Any = None

    def start(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(self.log_dir))
        self._writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```")

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(f"train/{name}", value, step)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(f"eval/{name}", value, step)

    def finish(self, status: str, summary: Mapping[str, Any], model: Path | None) -> None:
        self._writer.add_text("summary", f"```\n{json.dumps(dict(summary), indent=2, default=str)}\n```")
        self._writer.close()


class MLflowTracker:
    """A run in ``experiment`` at ``tracking_uri`` (None: MLflow's default or
    ``MLFLOW_TRACKING_URI``): the config as params (dotted names) and as ``job.json``, metrics
    per step (``eval/<name>`` for eval), the summary and the final model as artifacts."""

    def __init__(self, tracking_uri: str | None, experiment: str, run_name: str | None) -> None:
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self._client: Any = None
        self._run_id = ""

    def start(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(self.tracking_uri)
        found = self._client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(self.experiment)
        run = self._client.create_run(experiment_id, run_name=self.run_name or run_dir.name)
        self._run_id = run.info.run_id
        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in flatten(config).items()]
        for lo in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self._client.log_batch(self._run_id, params=params[lo : lo + 100])
        self._client.log_dict(self._run_id, dict(config), "job.json")

    def _metrics(self, step: int, metrics: Mapping[str, float], prefix: str) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(f"{prefix}{k}", float(v), now, step) for k, v in metrics.items()])

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self._metrics(step, metrics, "")

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self._metrics(step, metrics, "eval/")

    def finish(self, status: str, summary: Mapping[str, Any], model: Path | None) -> None:
        self._client.log_dict(self._run_id, dict(summary), "summary.json")
        if model is not None:
            self._client.log_artifact(self._run_id, str(model))
        state = {"finished": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED")
        self._client.set_terminated(self._run_id, state)


def make_trackers(config: TrackingConfig, run_dir: Path) -> list[Any]:
    """The trackers ``config`` asks for; a relative TensorBoard directory is in ``run_dir``."""
    trackers: list[Any] = []
    if config.tensorboard is not None:
        path = Path(config.tensorboard)
        trackers.append(TensorBoardTracker(path if path.is_absolute() else run_dir / path))
    if config.mlflow is not None:
        trackers.append(MLflowTracker(config.mlflow.tracking_uri, config.mlflow.experiment, config.mlflow.run_name))
    trackers += [factories.build(spec.factory, spec.kwargs) for spec in config.callbacks]
    return trackers


class TrackingListener:
    """Feeds ``trackers`` from a run's records; ``report(kind, **fields)`` records a tracker's
    failure (not passed back to the listeners)."""

    def __init__(self, trackers: list[Any], run_dir: Path, report: Callable[..., None]) -> None:
        self.trackers = list(trackers)
        self.run_dir = run_dir
        self.report = report
        self.model: Path | None = None

    def _call(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            function = getattr(tracker, method, None)
            if function is None:
                continue
            try:
                function(*args)
            except Exception as err:  # a tracker's own problem: report it, drop it, train on
                self.trackers.remove(tracker)
                self.report("tracking_failed", tracker=type(tracker).__name__, method=method, error=f"{type(err).__name__}: {err}")

    def on_event(self, record: Mapping[str, Any]) -> None:
        kind = record["event"]
        if kind == "job_start":
            self._call("start", self.run_dir, record.get("config", {}))
        elif kind == "step":
            metrics = {k: record[k] for k in STEP_METRICS if isinstance(record.get(k), (int, float))}
            self._call("log_step", record["step"], metrics)
        elif kind == "eval":
            metrics = {k: v for k, v in record.get("metrics", {}).items() if isinstance(v, (int, float))}
            self._call("log_eval", record["step"], metrics)

    def on_model(self, path: Path) -> None:
        self.model = path

    def on_summary(self, summary: Mapping[str, Any]) -> None:
        self._call("finish", str(summary.get("status")), summary, self.model)
