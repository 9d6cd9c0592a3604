"""Experiment tracking from the driver: TensorBoard event files and an MLflow file store read
back, a user's tracker through the callback interface, a failing tracker that does not fail
the job."""

from __future__ import annotations

import json

import pytest

from tests.helpers.jobs import jsonl, run

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_tensorboard_mlflow_and_a_callback_see_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants it for a local store
    store = f"file://{tmp_path / 'mlruns'}"
    calls = tmp_path / "calls.json"
    result = run(
        tmp_path, "tracked", "steps=6", "scaling.workers=2",
        "eval={factory: 'ringleader_examples.digits:make_dataset', kwargs: {split: test}}",
        f"tracking={{tensorboard: tb, mlflow: {{tracking_uri: '{store}', experiment: tests}}, "
        f"callbacks: [{{factory: 'tests.helpers.trackers:RecordingTracker', kwargs: {{path: '{calls}'}}}}, "
        "{factory: 'tests.helpers.trackers:FailingTracker'}]}",
    )
    steps = {e["step"]: e for e in jsonl(result.run_dir / "events.jsonl") if e["event"] == "step"}
    failed = [e for e in jsonl(result.run_dir / "events.jsonl") if e["event"] == "tracking_failed"]
    assert [(e["tracker"], e["method"]) for e in failed] == [("FailingTracker", "log_step")]  # once, then dropped

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(result.run_dir / "tb"))
    board.Reload()
    losses = {e.step: e.value for e in board.Scalars("train/loss")}
    assert losses == pytest.approx({s: e["loss"] for s, e in steps.items()})
    assert board.Scalars("eval/accuracy")[0].value == pytest.approx(result.summary["eval"]["accuracy"])

    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "lr")}
    assert history == pytest.approx({s: e["lr"] for s, e in steps.items()})
    assert mlflow_run.data.params["optimizer.name"] == "adam" and mlflow_run.data.params["steps"] == "6"
    assert mlflow_run.data.metrics["eval/accuracy"] == pytest.approx(result.summary["eval"]["accuracy"])
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "tracked"
    artifacts = {a.path for a in client.list_artifacts(mlflow_run.info.run_id)}
    assert {"model.pt", "job.json", "summary.json"} <= artifacts

    recorded = json.loads(calls.read_text())
    assert recorded[0] == ["start", str(result.run_dir), "digits"]
    assert [c[1] for c in recorded if c[0] == "log_step"] == list(range(6))
    assert recorded[-1] == ["finish", "finished", 6, str(result.run_dir / "model.pt")]
