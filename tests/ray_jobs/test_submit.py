"""Jobs on a real Ray head (``ray start --head`` with the dashboard and token authentication,
one head for the module): ``ringleader submit --follow`` of a short job with checkpoints,
``status``/``logs``, token errors as one line, and ``ringleader run --address auto`` from
another working directory, then ``ringleader resume``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from benchmarks.ray_head import RayHead, start_head
from tests.helpers.paths import REPO

SUBMIT_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> Iterator[RayHead]:
    yield from start_head(tmp_path_factory.mktemp("head"))


def _ringleader(head: RayHead, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # The CLI as a user runs it, from ``cwd``; the repository on the path as an install would put it.
    environment = {**(env or head.env), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "ringleader", *args], cwd=cwd, env=environment,
        capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S,
    )


def _job_file(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "job.yaml"
    path.write_text("name: submitted\nsteps: 12\neval: null\nshards: 4\nbatch_size: 64\n")
    return path


def test_submit_follow_runs_the_job_on_the_cluster_with_its_checkpoints(head, tmp_path):
    project = tmp_path / "project"  # holds only the job file: ringleader travels as py_modules
    _job_file(project)
    run_dir = tmp_path / "run"
    done = _ringleader(
        head, "submit", "job.yaml", "--address", head.address, "--follow", "--run-dir", str(run_dir),
        "--set", "scaling={workers: 2, resources_per_worker: {CPU: 1}}", "--set", "checkpoint.every_steps=5",
        cwd=project,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    submission_id = done.stdout.splitlines()[0]
    assert submission_id.startswith("raysubmit_")
    assert "ringleader: finished: 12 steps" in done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["workers"]["start"] == 2
    checkpoints = Path(summary["checkpoints"]["root"])
    assert checkpoints.parent == run_dir / "checkpoints" and checkpoints.name == (run_dir / "run_id").read_text().strip()
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000005", "step-00000010", "step-00000012"]
    status = _ringleader(head, "status", submission_id, "--address", head.address, cwd=project)
    assert status.returncode == 0 and status.stdout.startswith(f"{submission_id}: SUCCEEDED")
    logs = _ringleader(head, "logs", submission_id, "--address", head.address, cwd=project)
    assert "ringleader: finished: 12 steps" in logs.stdout


def test_a_wrong_or_missing_token_is_one_line(head, tmp_path):
    (tmp_path / "bad").write_text("not-the-token\n")
    wrong = _ringleader(head, "status", "raysubmit_x", "--address", head.address, "--token-file", str(tmp_path / "bad"), cwd=tmp_path)
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == f"ringleader: the Ray cluster at {head.address} refused the token from --token-file {tmp_path / 'bad'}"
    nobody = {**head.env, "HOME": str(tmp_path)}  # no ~/.ray/auth_token here
    nobody.pop("RAY_AUTH_MODE")
    missing = _ringleader(head, "submit", "job.yaml", "--address", head.address, cwd=_job_file(tmp_path / "p").parent, env=nobody)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "requires a token and none was found" in missing.stderr
    bad_field = _ringleader(head, "submit", "job.yaml", "--address", head.address, "--set", "steps=0", cwd=tmp_path / "p")
    assert bad_field.returncode == 2 and "field 'steps'" in bad_field.stderr  # refused before any upload


def test_run_with_address_auto_from_another_directory_then_resume(head, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    job = _job_file(elsewhere)
    env = {**head.env, "RAY_ADDRESS": head.gcs_address}
    first = _ringleader(
        head, "run", str(job), "--address", "auto", "--run-dir", "run", "--no-progress",
        "--set", "checkpoint.every_steps=5", "--set", "scaling.workers=2", cwd=elsewhere, env=env,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = (elsewhere / "run" / "run_id").read_text().strip()
    assert (elsewhere / "run" / "checkpoints" / run_id / "step-00000012" / "manifest.json").is_file()
    more = _ringleader(head, "resume", "run", "--set", "steps=20", "--no-progress", cwd=elsewhere, env=env)
    assert more.returncode == 0, more.stderr[-3000:]
    events = [json.loads(line) for line in (elsewhere / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["checkpoint"] for e in events if e["event"] == "resume"] == ["step-00000012"]
    assert json.loads((elsewhere / "run" / "summary.json").read_text())["steps"] == 20
    assert os.environ.get("RAY_ADDRESS") != head.gcs_address  # the test's own environment is untouched


SCRAPE = """
import json, sys, time, urllib.request
import ray
import ringleader

ray.init(address=sys.argv[1], logging_level="ERROR")  # the job reuses this driver's Ray
result = ringleader.run(
    {"name": "scraped", "steps": 12, "eval": None, "shards": 4, "batch_size": 64,
     "scaling": {"workers": 2}, "checkpoint": {"every_steps": 5}},
    run_dir=sys.argv[3],
)
deadline, found = time.monotonic() + 30, []
while time.monotonic() < deadline:
    text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[2]}/metrics", timeout=5).read().decode()
    found = [l for l in text.splitlines() if l.startswith("ray_ringleader_") and 'ringleader_job="scraped"' in l]
    # Recorded before run() returned; served after the agent's next report (1 s here).
    if any('kind="checkpoints"' in l and l.endswith(" 3.0") for l in found) and any("steps_committed" in l and l.endswith(" 12.0") for l in found):
        break
    time.sleep(1)
print(json.dumps({"status": result.status, "lines": found, "goodput": result.summary["goodput"]}))
"""


def _series(lines: list[str], name: str, **tags: str) -> float:
    """The value of ``name``'s series with ``tags`` among Prometheus text ``lines``."""
    for line in lines:
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{") and all(f'{k}="{v}"' in head for k, v in tags.items()):
            return float(value)
    raise AssertionError(f"no {name} {tags} in {lines}")


def test_the_job_metrics_reach_rays_prometheus_endpoint(head, tmp_path):
    env = {**head.env, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", SCRAPE, head.gcs_address, str(head.metrics_port), str(tmp_path / "run")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    lines = out["lines"]
    assert out["status"] == "finished"
    assert _series(lines, "ray_ringleader_steps_committed") == 12
    assert _series(lines, "ray_ringleader_workers_alive") == 2
    assert _series(lines, "ray_ringleader_events_total", kind="checkpoints") == 3  # steps 5, 10 and the final one
    assert _series(lines, "ray_ringleader_step_seconds") > 0
    assert _series(lines, "ray_ringleader_tokens_per_second") == pytest.approx(_series(lines, "ray_ringleader_samples_per_second"))
    assert _series(lines, "ray_ringleader_worker_shard_seconds", worker="0") > 0
    assert _series(lines, "ray_ringleader_worker_shard_seconds", worker="1") > 0
    assert _series(lines, "ray_ringleader_lost_seconds", cause="startup") > 0
    assert 0 < _series(lines, "ray_ringleader_goodput") < 1
    assert _series(lines, "ray_ringleader_checkpoint_seconds", phase="write") > 0
    summary = out["goodput"]
    assert 0 < summary["goodput"] < 1 and set(summary["lost_s"]) >= {"startup", "checkpoint_stalls", "stragglers", "finishing"}
    assert summary["productive_s"] + sum(summary["lost_s"].values()) == pytest.approx(summary["wall_s"])
