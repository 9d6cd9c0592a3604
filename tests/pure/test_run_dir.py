"""The run directory's id and its folder: a new run claims a free folder, alone, and a new run
that fails before its job is saved leaves the folder as it found it, deleting nothing of
another run's."""

from __future__ import annotations

import pytest

from jobspec.fields import ConfigError
from orchestrator.output.run_dir import RUN_ID_FILE, RunDirectory


def test_a_run_id_file_that_holds_no_run_id_is_one_line_naming_it(tmp_path):
    made = RunDirectory(tmp_path / "run")
    made.save_job({})
    made.close()
    (tmp_path / "run" / RUN_ID_FILE).write_text("../../elsewhere\n")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'run' / RUN_ID_FILE}: expected a run id like"):
        RunDirectory(tmp_path / "run", resume=True)


def test_a_new_run_that_fails_before_its_job_is_saved_leaves_its_folder_as_it_found_it(tmp_path):
    for path in (tmp_path / "missing", tmp_path / "empty"):
        if path.name == "empty":
            path.mkdir()
        made = RunDirectory(path)
        made.event("job_start")
        (path / "checkpoints").mkdir()
        made.close(discard_unsaved=True)
        assert path.exists() == (path.name == "empty") and (not path.exists() or not any(path.iterdir()))
    saved = RunDirectory(tmp_path / "saved")
    saved.save_job({})
    saved.close(discard_unsaved=True)
    resumed = RunDirectory(tmp_path / "saved", resume=True)
    resumed.close(discard_unsaved=True)
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["events.jsonl", "job.json", RUN_ID_FILE, "telemetry.jsonl"]


def test_two_new_runs_made_in_one_folder_at_once_claim_it_one_only(tmp_path, monkeypatch):
    """Both find the folder free (two runs started in the same second share a default run
    directory) before either records its id: only the first to create ``run_id`` gets the
    folder; the second writes nothing, and nothing it does deletes the first's."""
    path = tmp_path / "run"
    first = RunDirectory(path)
    first.event("job_start")
    monkeypatch.setattr(RunDirectory, "ensure_free", staticmethod(lambda path: None))  # it checked before the first wrote
    with pytest.raises(FileExistsError) as refused:
        RunDirectory(path)
    assert "\n" not in str(refused.value) and f"run directory {path} was just taken by another run" in str(refused.value)
    assert (path / RUN_ID_FILE).read_text().strip() == first.run_id
    assert (path / "events.jsonl").read_text() != ""
    first.close(discard_unsaved=True)
    assert not path.exists()


def test_a_failed_new_run_discards_nothing_once_its_folder_holds_another_run_id(tmp_path):
    path = tmp_path / "run"
    made = RunDirectory(path)
    (path / RUN_ID_FILE).write_text("20261125-030605-9f3a1c2e\n")  # the folder is another run's now
    (path / "theirs.txt").write_text("another run's")
    made.close(discard_unsaved=True)
    assert sorted(p.name for p in path.iterdir()) == ["events.jsonl", RUN_ID_FILE, "telemetry.jsonl", "theirs.txt"]
