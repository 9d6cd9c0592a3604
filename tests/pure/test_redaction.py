"""Credentials in URIs are masked wherever ringleader prints or saves a value."""

from __future__ import annotations

import json

import pytest

from jobspec.redaction import redact, redact_all
from orchestrator.output.run_dir import RunDirectory
from workers.checkpoint.storage import CheckpointStorage

SECRET_URI = "s3://AKIAKEY:s3cr3t@bucket/ckpt?X-Amz-Signature=deadbeef&region=eu&token=t0k"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (SECRET_URI, "s3://***@bucket/ckpt?X-Amz-Signature=***&region=eu&token=***"),
        ("gs://bucket/path", "gs://bucket/path"),
        ("failed: https://user@host:8265/api?X-Amz-Security-Token=abc rest", "failed: https://***@host:8265/api?X-Amz-Security-Token=*** rest"),
        ("a=1, b=2 plain", "a=1, b=2 plain"),
        # Names that merely contain a secret word, and values outside a URI, stay as they are.
        ("s3://b/x?monkey=3&session_name=run1&keyframe=5&lr=0.001", "s3://b/x?monkey=3&session_name=run1&keyframe=5&lr=0.001"),
        ("a&monkey=3 x;turkey=1 weights#keyframe=5 /data/train.bin", "a&monkey=3 x;turkey=1 weights#keyframe=5 /data/train.bin"),
        ("https://h/p?access_token=abc&key=k1", "https://h/p?access_token=***&key=***"),
    ],
)
def test_redact(text, want):
    assert redact(text) == want


def test_run_directory_files_never_hold_the_secret(tmp_path):
    run = RunDirectory(tmp_path / "run")
    run.save_job({"checkpoint": {"path": SECRET_URI}})
    run.event("checkpoint_abandoned", reason=f"cannot check {SECRET_URI}/step-1/part", nested=[{"uri": SECRET_URI}])
    run.save_summary({"checkpoints": {"root": SECRET_URI}})
    run.close()
    for name in ("job.json", "events.jsonl", "summary.json"):
        text = (tmp_path / "run" / name).read_text()
        assert "s3cr3t" not in text and "deadbeef" not in text and "t0k" not in text and "AKIAKEY" not in text
        assert "s3://***@bucket/ckpt" in text
    assert json.loads((tmp_path / "run" / "job.json").read_text())["checkpoint"]["path"].startswith("s3://***@")


def test_checkpoint_messages_name_files_without_the_secret():
    storage = CheckpointStorage("mock://KEY:SECRET@bucket/ckpt")
    assert storage.location("step-00000001/manifest.json") == "mock://***@bucket/ckpt/step-00000001/manifest.json"
    assert redact_all({"a": ["mock://KEY:SECRET@b"], "n": 3}) == {"a": ["mock://***@b"], "n": 3}


def test_resuming_a_job_whose_saved_credential_was_masked_asks_for_it_again(tmp_path):
    from jobspec.fields import ConfigError
    from orchestrator.job.reading import load_job

    run = RunDirectory(tmp_path / "run")
    run.save_job({"checkpoint": {"path": SECRET_URI}, "steps": 5})
    run.close()
    with pytest.raises(ConfigError, match="'checkpoint.path' hold a credential that was masked"):
        load_job(tmp_path / "run" / "job.json", resolve=False)
    job = load_job(tmp_path / "run" / "job.json", [f"checkpoint.path={SECRET_URI}"], resolve=False)
    assert job.checkpoint.path == SECRET_URI  # given again: the run goes on with it


def test_the_cli_never_prints_the_secret(tmp_path, capsys):
    from ringleader.cli import main

    # A value that is not valid YAML: the message quotes the whole --set item back.
    code = main(["run", "--run-dir", str(tmp_path / "r"), "--set", f"checkpoint.path=[{SECRET_URI}"])
    err = capsys.readouterr().err
    assert code == 2 and "not valid YAML" in err and "s3://***@bucket" in err and "s3cr3t" not in err
