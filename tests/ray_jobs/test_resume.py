"""Resuming a run from its checkpoints: on another worker count the rest of the trajectory is
the same, a corrupt newest checkpoint falls back to the previous one with a message naming the
bad file, and a checkpoint of another job is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobspec.fields import ConfigError
from orchestrator.job.reading import load_job
from orchestrator.launch import run_job
from ringleader.cli import main
from tests.helpers.jobs import assert_control_differs, assert_same_params, jsonl, params, run

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _resumes(run_dir):
    return [e for e in jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]


def test_resume_on_another_worker_count_continues_the_same_trajectory(tmp_path, reference):
    first = run(tmp_path, "run", "steps=12", "scaling.workers=2", "checkpoint.every_steps=5")
    assert [e["step"] for e in jsonl(first.run_dir / "events.jsonl") if e["event"] == "checkpoint"] == [5, 10, 12]
    resumed = run(tmp_path, "run", "steps=25", "scaling.workers=3", "checkpoint.every_steps=5")
    (resume,) = _resumes(resumed.run_dir)
    assert resume["checkpoint"] == "step-00000012" and resume["skipped"] == []
    assert resumed.summary["steps"] == 25 and resumed.summary["workers"]["start"] == 3
    assert_same_params(params(resumed.run_dir), reference, "resumed on 3 workers")


def test_a_run_from_before_index_shuffles_resumes_in_whole_epoch_permutations(tmp_path, one_worker, reference):
    """A run that drew whole-epoch permutations (its checkpoints hash as every checkpoint did
    before ``dataset.shuffle`` existed: tests/pure/test_resume_point.py), resumed by a job that
    leaves ``shuffle`` unset, goes on in them: it ends where an uninterrupted run in permutations
    does, which is not where the index order ends."""
    old = "dataset.shuffle=permutation"
    clean = one_worker(old)
    run(tmp_path, "old", "steps=12", "scaling.workers=2", "checkpoint.every_steps=5", old)
    resumed = run(tmp_path, "old", "scaling.workers=2", "checkpoint.every_steps=5")
    assert [e["checkpoint"] for e in _resumes(resumed.run_dir)] == ["step-00000012"]
    assert_same_params(params(resumed.run_dir), clean, "an old run resumed with shuffle unset")
    assert_control_differs(params(resumed.run_dir), reference, "the index order")


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, reference, capsys):
    first = run(tmp_path, "run", "steps=12", "scaling.workers=2", "checkpoint.every_steps=4")
    (bad,) = (Path(first.summary["checkpoints"]["root"]) / "step-00000012").glob("part-00001-of-00002-*.pt")
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: only the sha256 can tell
    bad.write_bytes(bytes(data))
    code = main(["resume", str(first.run_dir), "--workers", "3", "--set", "steps=25", "--no-progress"])
    assert code == 0
    err = capsys.readouterr().err
    assert str(bad) in err and "sha256" in err and "step-00000008" in err
    (resume,) = _resumes(first.run_dir)
    assert resume["checkpoint"] == "step-00000008" and str(bad) in resume["skipped"][0]
    assert_same_params(params(first.run_dir), reference, "resumed from the previous checkpoint")


def test_a_checkpoint_of_another_job_is_refused(tmp_path):
    first = run(tmp_path, "run", "steps=4", "scaling.workers=1", "checkpoint.every_steps=2")
    other = load_job(None, ["steps=8", "eval=null", "seed=1", "scaling.workers=1"])
    with pytest.raises(ConfigError, match="seed"):
        run_job(other, run_dir=first.run_dir)


def test_a_relative_run_dir_holds_every_part_when_workers_run_elsewhere(tmp_path, monkeypatch, reference):
    """The run directory is relative to the driver; workers run in other directories. Parts
    must land where the manifest is, and the run resumes from them."""
    monkeypatch.chdir(tmp_path)
    elsewhere = ("model.factory=tests.helpers.factories:make_model_elsewhere", "checkpoint.every_steps=5")
    job = load_job(None, ["steps=12", "eval=null", "scaling.workers=2", *elsewhere])
    first = run_job(job, run_dir=Path("relative-run"))
    assert first.summary["status"] == "finished"
    events = jsonl(tmp_path / "relative-run" / "events.jsonl")
    periodic = [e["step"] for e in events if e["event"] == "checkpoint" and e["why"] == "periodic"]
    # Every 5 steps, counted from the newest taken: one due while the last is still being written
    # is taken later (at 10 or 11 here, as fast as the write of 5 goes), never sooner.
    assert periodic[0] == 5 and all(b - a >= 5 for a, b in zip(periodic, periodic[1:])), periodic
    assert [e["step"] for e in events if e["event"] == "checkpoint" and e["why"] == "final"] == [12]
    resumed = run_job(load_job(None, ["steps=25", "eval=null", "scaling.workers=2", *elsewhere]), run_dir=Path("relative-run"))
    assert resumed.summary["status"] == "finished"
    assert [e["checkpoint"] for e in _resumes(tmp_path / "relative-run")] == ["step-00000012"]
    assert_same_params(params(tmp_path / "relative-run"), reference, "relative run dir")


def test_a_step_schedule_resumes_on_another_worker_count_with_the_same_rates(tmp_path, one_worker):
    """The schedule's factor depends on the step only (``step`` does not depend on the job's
    step count, so extending the run keeps the earlier rates): resumed on 3 workers after 2, the
    run ends where a clean single-worker run with the same schedule does."""
    schedule = ("schedule={name: step, warmup_steps: 3, step_size: 6, gamma: 0.5}", "optimizer.kwargs={lr: 0.01}")
    clean = one_worker(*schedule)
    run(tmp_path, "split", "steps=12", "scaling.workers=2", "checkpoint.every_steps=5", *schedule)
    resumed = run(tmp_path, "split", "scaling.workers=3", "checkpoint.every_steps=5", *schedule)
    assert [e["checkpoint"] for e in _resumes(resumed.run_dir)] == ["step-00000012"]
    rates = [e["lr"] for e in jsonl(resumed.run_dir / "events.jsonl") if e["event"] == "step"]
    assert rates[0] == pytest.approx(0.01 / 3) and rates[-1] == pytest.approx(0.01 * 0.5**3)
    assert_same_params(params(resumed.run_dir), clean, "step schedule resumed on 3 workers")
