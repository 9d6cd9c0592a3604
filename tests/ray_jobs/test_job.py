"""Whole jobs on the session's Ray cluster: the shard-sum invariant, outputs, failure paths."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from jobspec.step_record import read_telemetry
from orchestrator.accounting.summary import EVENT_COUNTERS
from orchestrator.job.reading import load_job
from orchestrator.launch import run_job
from ringleader.cli import main
from tests.helpers.jobs import assert_control_differs, assert_same_params, params, run

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_parameters_do_not_depend_on_worker_count_or_assignment(tmp_path, reference):
    """docs/architecture.md, "Commit and census": any assignment of shards to workers gives the
    same update (to float noise: tests/helpers/jobs.py; the ``reference`` fixture checks that
    another seed lands far outside that bound)."""
    variants = {
        "w3": run(tmp_path, "w3", "scaling.workers=3"),
        "w4": run(tmp_path, "w4", "scaling.workers=4"),
        "w4-shuffled": run(tmp_path, "w4s", "scaling.workers=4", "chaos.shuffle_shards=true"),
        "w4-native": run(tmp_path, "w4n", "scaling.workers=4", "collective.algorithm=native"),
        "w4-ring": run(tmp_path, "w4r", "scaling.workers=4", "collective.algorithm=ring"),
        "w3-hierarchical": run(tmp_path, "w3h", "scaling.workers=3", "collective.algorithm=hierarchical"),
        "w3-no-overlap-unfused": run(
            tmp_path, "w3n", "scaling.workers=3", "collective.overlap=false", "worker.fuse_shards=false"
        ),
    }
    for name, result in variants.items():
        assert_same_params(params(result.run_dir), reference, name)


def test_dropout_model_is_invariant_with_unfused_shards(tmp_path, one_worker):
    """Per-shard seeding makes forward randomness depend on (seed, step, shard) only.

    SGD, not Adam: the attention key bias has a true gradient of zero, and Adam would scale its
    float noise up to full-size updates.
    """
    tiny = [
        "optimizer={name: sgd, kwargs: {lr: 0.1, momentum: 0.9}}",
        "model={factory: 'ringleader_examples.tinylm:make_model', kwargs: {d_model: 32, layers: 1, heads: 2, seq_len: 16, dropout: 0.2}}",
        "dataset={factory: 'ringleader_examples.tinylm:make_dataset', kwargs: {seq_len: 16}}",
        "batch_size=32", "shards=8", "steps=6", "worker.fuse_shards=false",
    ]
    # Unfused, each shard's forward is seeded by the shard: the yardstick's shuffled order on
    # one worker draws the same dropout masks, so it re-orders the sums and nothing else.
    one = one_worker(*tiny)
    three = params(run(tmp_path, "lm3", *tiny, "scaling.workers=3", "chaos.shuffle_shards=true").run_dir)
    assert_same_params(three, one, "3 workers, shuffled")
    # Control: fused passes draw different dropout masks, and the comparison sees it.
    fused = params(run(tmp_path, "lm1f", *tiny, "scaling.workers=1", "worker.fuse_shards=true").run_dir)
    assert_control_differs(fused, one, "fused shards (other dropout masks)")


def test_shuffled_assignment_really_moves_shards(tmp_path):
    result = run(tmp_path, "moves", "scaling.workers=4", "chaos.shuffle_shards=true", "steps=3")
    lines = read_telemetry(result.run_dir / "telemetry.jsonl")
    counts = {(r["step"], r["rank"]): len(r["shards"]) for r in lines}
    assert len(set(counts.values())) > 1


def test_builtin_example_end_to_end(tmp_path, capsys):
    """`ringleader run` with no job file: 4 workers, held-out accuracy >= 0.95, full run dir."""
    run_dir = tmp_path / "example"
    assert main(["run", "--run-dir", str(run_dir), "--no-progress"]) == 0
    assert "finished: 300 steps" in capsys.readouterr().out

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["eval"]["accuracy"] >= 0.95
    assert summary["steps"] == 300 and summary["samples"] == 300 * 256
    assert summary["shards_committed"] == summary["shards_expected"] == 300 * 16
    assert summary["workers"] == {"start": 4, "end": 4}
    assert set(summary["events"]) == set(EVENT_COUNTERS)
    # Nothing failed; straggler counters may move on a busy machine (workers really are late).
    assert not any(summary["events"][k] for k in ("failures", "recoveries", "steps_redone", "checkpoints"))
    for key in ("wall_s", "samples_per_s", "final_loss"):
        assert summary[key] > 0
    # The launch's breakdown: the workers' code loaded, then their models built, before the
    # driver saw them started, the group formed and the first step done.
    launch = summary["startup_s"]
    order = ["worker_code_loaded", "worker_built", "workers_started", "group_formed", "first_step"]
    assert [launch[k] for k in order] == sorted(launch[k] for k in order) and launch["worker_code_loaded"] > 0
    assert launch["worker_process_started"] <= launch["worker_code_loaded"]

    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "job_start" and kinds[-1] == "job_end"
    assert kinds.count("step") == 300 and "eval" in kinds
    states = [(e["old"], e["new"]) for e in events if e["event"] == "state"]
    assert states == [("starting", "running"), ("running", "finished")]
    # collective.algorithm: auto probed the links once, as the group formed, and said what it chose.
    (choice,) = [e for e in events if e["event"] == "collective_choice"]
    assert kinds.index("collective_choice") < kinds.index("workers_ready")
    assert {entry["algorithm"] for entry in choice["by_size"]} <= {"native", "ring"}
    assert set(choice["bandwidth_mb_s"]) == {"native", "ring"}
    assert all(len(bws) == len(choice["probe_bytes"]) and min(bws) > 0 for bws in choice["bandwidth_mb_s"].values())
    # On CPU workers the bucket is the largest size probed (at least 1 MB): fewest calls.
    assert choice["bucket_mb"] == round(max(1.0, choice["probe_bytes"][-1] / 2**20), 3)

    telemetry = read_telemetry(run_dir / "telemetry.jsonl")
    assert len(telemetry) == 300 * 4
    assert {r["rank"] for r in telemetry} == {0, 1, 2, 3}
    assert all(r["compute_s"] > 0 and r["comm_s"] > 0 for r in telemetry)
    assert sum(r["samples"] for r in telemetry if r["step"] == 7) == 256

    state = params(run_dir)
    model = load_job(None).model
    from jobspec.targets import build

    build(model.factory, model.kwargs).load_state_dict(state)


def test_epochs_give_a_short_last_step(tmp_path):
    # 1437 training samples x 0.5 epochs = 718 samples at batch 256: 256, 256, 206.
    job = load_job(None, ["steps=null", "epochs=0.5", "scaling.workers=2", "eval=null"])
    summary = run_job(job, run_dir=tmp_path / "epochs").summary
    assert summary["status"] == "finished"
    assert summary["steps"] == 3 and summary["samples"] == 718
    assert summary["shards_committed"] == summary["shards_expected"] == 3 * 16


def test_worker_error_fails_the_job_with_its_reason(tmp_path, capsys):
    code = main(
        [
            "run", "--run-dir", str(tmp_path / "broken"), "--no-progress", "--workers", "2",
            "--set", "dataset.factory=tests.helpers.factories:make_broken_dataset",
            "--set", "dataset.kwargs={}",
        ]
    )
    assert code == 1
    assert "training data not found at /nowhere/data.bin" in capsys.readouterr().err
    summary = json.loads((tmp_path / "broken" / "summary.json").read_text())
    assert summary["status"] == "failed" and "FileNotFoundError" in summary["error"]


def test_step_timeout_fails_instead_of_hanging(tmp_path):
    job = load_job(
        None,
        [
            "model.factory=tests.helpers.factories:make_sleepy_model",
            "model.kwargs={seconds: 30}",
            "scaling.workers=2",
            "timeouts.step_s=2",
            "eval=null",
        ],
    )
    result = run_job(job, run_dir=tmp_path / "slow")
    assert result.summary["status"] == "failed"
    assert "did not finish within 2s" in result.summary["error"]
    assert result.summary["wall_s"] < 30


def _signal_state(pid: int) -> str:
    """The ignored, blocked and caught signal masks of process ``pid`` (Linux), or why not."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as err:
        return f"unreadable ({err})"
    return " ".join(line.replace("\t", "") for line in status if line.startswith(("SigIgn", "SigBlk", "SigCgt")))


def _stuck_process_report(proc, run_dir: Path) -> str:
    """What a run that will not stop was doing: its threads' stacks (py-spy, Ray's dependency,
    where the machine allows it, and faulthandler's on SIGABRT), its last events and whether it
    wrote its summary. The process is killed: never left running."""
    import os
    import signal
    import subprocess
    import sys

    signal_state = _signal_state(proc.pid)
    spy = Path(sys.executable).parent / "py-spy"
    stacks = "py-spy: not installed"
    if spy.exists():
        dump = subprocess.run([str(spy), "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60)
        stacks = dump.stdout + dump.stderr
    proc.send_signal(signal.SIGABRT)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    events = run_dir / "events.jsonl"
    last = events.read_text().splitlines()[-8:] if events.exists() else []
    return "\n".join([
        f"its signal masks: {signal_state}", f"this process's: {_signal_state(os.getpid())}",
        f"summary.json written: {(run_dir / 'summary.json').exists()}", "last events:", *last,
        "py-spy:", stacks, "stderr (faulthandler) ends:", err[-8000:],
    ])


def test_ctrl_c_stops_cleanly_and_releases_actors(tmp_path):
    """The CLI joins this session's cluster by --address; SIGINT mid-run exits 130, writes the
    summary, and frees every actor and the placement group."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import ray

    run_dir = tmp_path / "interrupted"
    command = [
        sys.executable, "-m", "ringleader", "run", "--no-progress", "--workers", "2",
        "--address", ray.get_runtime_context().gcs_address, "--run-dir", str(run_dir),
        "--set", "steps=100000", "--set", "eval=null",
    ]
    # Ctrl-C reaches a foreground process whose SIGINT is at its default. A process inherits an
    # ignored or blocked SIGINT across exec (a background job of a non-interactive shell ignores
    # it), and Python then keeps it ignored: started so, the run would rightly never see it. So
    # the run starts from the default, whatever this test process was started with.
    at_default = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); os.execv(sys.executable, sys.argv[1:])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", at_default, *command],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONFAULTHANDLER="1"),  # SIGABRT then prints every thread's stack
    )
    events = run_dir / "events.jsonl"
    deadline = time.monotonic() + 120
    while not (events.exists() and '"event": "step"' in events.read_text()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no step within 120 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"no exit within 120 s of SIGINT; where it was:\n{_stuck_process_report(proc, run_dir)}")
    assert proc.returncode == 130, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and 0 < summary["steps"] < 100000
    assert summary["shards_committed"] == summary["shards_expected"]

    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, f"resources not released: {ray.available_resources()}"
        time.sleep(0.2)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_topk_compression_with_error_feedback_keeps_digits_accuracy(tmp_path):
    """1% of the gradient entries per step; error feedback delivers the rest later."""
    job = load_job(None, ["collective.compression=topk", "collective.topk_ratio=0.01"])
    summary = run_job(job, run_dir=tmp_path / "topk").summary
    assert summary["status"] == "finished", summary.get("error")
    assert summary["eval"]["accuracy"] >= 0.93
    # The shard census rides outside the compressed sum: still exact.
    assert summary["shards_committed"] == summary["shards_expected"] == job.steps * job.shards


def test_a_wedged_preload_fails_the_launch_in_time(tmp_path, monkeypatch, capsys, ray_cluster):
    """The import thread (torch, the job's code) is bounded: a wedged one fails the launch with a
    clear message after the timeout instead of holding it (or the process's exit) forever."""
    import threading

    import orchestrator.launch as launch

    release = threading.Event()
    monkeypatch.setattr(launch, "PRELOAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(launch, "_preload", lambda job, source, checked: release.wait(60))
    started = time.perf_counter()
    try:
        code = main(["run", "--run-dir", str(tmp_path / "wedged"), "--no-progress", "--set", "steps=5"])
    finally:
        release.set()
    assert code == 1 and time.perf_counter() - started < 10
    assert "importing torch and the job's code (built-in example) did not finish within" in capsys.readouterr().err
