"""The submission's pieces without a cluster: entrypoint quoting, what travels, the token."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from orchestrator.commands.submit import (
    PACKAGES,
    SubmissionError,
    find_token,
    job_entrypoint,
    job_path_within,
    runtime_env,
)
from tests.helpers.paths import REPO


def test_no_user_value_reaches_the_shell_unquoted():
    entry = job_entrypoint("my job.yaml; id", ".ringleader-submit-x.json", "/runs/x y$(whoami)")
    assert shlex.split(entry) == [
        "python", "-m", "ringleader", "run", "my job.yaml; id", "--no-progress",
        "--set-file", ".ringleader-submit-x.json", "--run-dir", "/runs/x y$(whoami)",
    ]


def test_ringleader_travels_as_py_modules_unless_the_working_dir_holds_it(tmp_path):
    outside = runtime_env(tmp_path)
    assert outside["working_dir"] == str(tmp_path) and ".venv" in outside["excludes"]
    assert sorted(Path(p).name for p in outside["py_modules"]) == sorted(PACKAGES)
    assert "py_modules" not in runtime_env(REPO)


def test_the_job_file_must_travel_with_the_working_dir(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "job.yaml").write_text("steps: 1\n")
    (tmp_path / "job.yaml").write_text("steps: 1\n")
    assert job_path_within(tmp_path / "in" / "job.yaml", tmp_path) == "in/job.yaml"
    with pytest.raises(SubmissionError, match="is not inside the working directory"):
        job_path_within(tmp_path / "job.yaml", tmp_path / "in")
    with pytest.raises(SubmissionError, match="does not exist"):
        job_path_within(tmp_path / "none.yaml", tmp_path)


def test_the_token_comes_from_where_ray_looks_in_its_order(tmp_path, monkeypatch):
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert find_token(None) is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home\n")
    assert find_token(None).value == "from-home"
    (tmp_path / "path_token").write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "path_token"))
    assert find_token(None).value == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert find_token(None).source == "RAY_AUTH_TOKEN"
    (tmp_path / "file").write_text("from-file")
    assert find_token(tmp_path / "file").value == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SubmissionError, match="is empty"):
        find_token(tmp_path / "empty")
    with pytest.raises(SubmissionError, match="cannot read the token from --token-file"):
        find_token(tmp_path / "missing")


def test_an_address_given_wins_over_ray_address(monkeypatch):
    """Ray's client lets RAY_ADDRESS override the address it is given; ours must not (the
    token would go to the other cluster)."""
    from orchestrator.commands.submit import Cluster

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:2")
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    with pytest.raises(SubmissionError) as err:
        Cluster("http://127.0.0.1:1", None).status("raysubmit_x")
    message = str(err.value)
    assert message.startswith("cannot reach the Ray job server at http://127.0.0.1:1:")
    assert "127.0.0.1:2" not in message  # Ray's own part names where it really tried
    assert "RAY_API_SERVER_ADDRESS" not in __import__("os").environ
