"""``ringleader report``: one self-contained HTML page with PNG plots, from a run with chaos."""

from __future__ import annotations

import base64
import json
import re

import pytest

from orchestrator.commands.report import ReportError, marker_times, read_run, write_report
from ringleader.cli import main
from tests.helpers.jobs import run

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def chaotic_run(tmp_path_factory):
    """A run where a worker is slow (stragglers, rebalancing), one is SIGKILLed (a failure, a
    recovery, a replacement joining: a pause in compute, which nobody can take over, gives it
    time to load) and checkpoints are taken."""
    return run(
        tmp_path_factory.mktemp("report"), "chaos", "steps=200", "scaling.workers=3", "checkpoint.every_steps=50",
        "chaos.slow=[{worker: 2, factor: 3, from_step: 3}]", "chaos.kill=[{at_step: 10, worker: 1, how: sigkill}]",
        "chaos.stall=[{worker: 0, at_step: 20, seconds: 12, during: compute}]", "stragglers.evict=false",
    ).run_dir


def test_the_report_is_one_page_with_every_plot_and_the_events_marked(chaotic_run, tmp_path, capsys):
    assert main(["report", str(chaotic_run), "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "report.html").read_text()
    assert (tmp_path / "out" / "report.html").stat().st_mode & 0o044  # readable by others, to share
    assert str(tmp_path / "out" / "report.html") in capsys.readouterr().out
    images = re.findall(r'<h2>([^<]+)</h2><img alt="[^"]+" src="data:image/png;base64,([^"]+)"', page)
    assert [title for title, _ in images] == ["Loss and throughput", "Step time per worker", "Shards per worker", "Goodput"]
    for _, data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "http" not in page.split("<body>")[1].replace("https://", "").split("data:image")[0]  # nothing fetched
    markers = marker_times(read_run(chaotic_run))
    assert len(markers["failure"]) == 1 and len(markers["recovered"]) == 1 and len(markers["join"]) >= 1
    assert len(markers["checkpoint"]) >= 2 and markers["straggler"]
    assert "failure 1" in page and "finished" in page


def test_a_directory_without_a_run_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(ReportError, match="is not a run directory"):
        write_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path} is not a run directory" in capsys.readouterr().err


def test_a_run_still_writing_is_reported_from_what_it_has(tmp_path):
    (tmp_path / "events.jsonl").write_text(
        '{"time": 1.0, "event": "job_start"}\n{"time": 2.0, "event": "step", "step": 0, "loss": 1.0, "samples": 8, "step_s": 0.5}\n{"time": 3'
    )
    page = write_report(tmp_path).read_text()
    assert "running (no summary.json yet)" in page and page.count("data:image/png") == 1


def test_a_long_run_is_binned_and_a_corrupt_summary_named(tmp_path):
    events = [{"time": float(i), "event": "step", "step": i, "loss": 1.0, "samples": 8, "step_s": 0.1} for i in range(5000)]
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    (tmp_path / "telemetry.jsonl").write_text(
        "\n".join(json.dumps({"step": i, "worker": w, "step_s": 0.1, "shards": [w]}) for i in range(5000) for w in (0, 1)) + "\n"
    )
    assert write_report(tmp_path).stat().st_size > 0
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(ReportError, match="summary.json is not JSON"):
        write_report(tmp_path)
