"""Jobs sharing a ``checkpoint.path``: each run checkpoints, prunes and resumes in its own
namespace (``<root>/<run id>/``), one live driver at a time holds a namespace's lease, and a run
directory made before run ids still resumes from its flat checkpoints; a copied run directory
is refused, a moved one is the same run. The lease's own scenarios are in
``test_namespace_lease.py``.

Most scenarios run on the in-process fake group (``tests/helpers/fake_group.py``); the last two
run real jobs on the session's Ray."""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from orchestrator.checkpoints.lease import LEASE_FILE, NamespaceBusy, NamespaceLease
from orchestrator.checkpoints.namespace import OWNER_FILE, hold_namespace, namespace_root
from orchestrator.checkpoints.resume_point import config_hash, find_resume_point
from orchestrator.controller import JobController
from orchestrator.group.chaos_control import ChaosControl
from orchestrator.job.reading import load_job
from orchestrator.launch import run_job
from orchestrator.output.run_dir import RUN_ID_FILE, RunDirectory
from orchestrator.store.rendezvous import RendezvousStore
from tests.helpers.fake_group import FakeWorkerGroup
from tests.helpers.jobs import jsonl, run
from tests.helpers.leases import lease_file, put_lease, wait_for
from workers.checkpoint.manifest import MANIFEST, verify_checkpoint
from workers.checkpoint.storage import CheckpointStorage

LEARNING_RATES = ("optimizer.kwargs={lr: 0.05}", "optimizer.kwargs={lr: 0.1}")


def _job(*overrides: str) -> JobConfig:
    return load_job(None, ["steps=20", "eval=null", "scaling.workers=2", "stragglers.rebalance=false", *overrides], resolve=False)


def _fake_run(run: RunDirectory, job: JobConfig, lease: NamespaceLease | None = None) -> dict:
    """``job`` to its end on the fake group, in ``run``; its summary."""
    store = RendezvousStore("127.0.0.1", 10.0)
    chaos = ChaosControl(job.chaos, None, 0, run.event)
    controller = JobController(job, run, FakeWorkerGroup(job), store, chaos=chaos, launched=time.perf_counter(), lease=lease)
    return controller.execute().summary


def _namespaces(shared: Path) -> dict[str, dict[str, dict]]:
    """Every namespace under ``shared``: its checkpoints, each verified (its manifest)."""
    found = {}
    for namespace in CheckpointStorage(str(shared)).list_dirs():
        storage = CheckpointStorage(str(shared / namespace))
        found[namespace] = {name: verify_checkpoint(storage, name) for name in storage.list_dirs()}
    return found


def test_jobs_sharing_a_checkpoint_path_keep_to_their_own_namespaces(tmp_path):
    """Two jobs with different learning rates, one after the other and then two more at once, on
    one checkpoint.path with keep=1: every run keeps its own newest checkpoint (another's write
    neither overwrites it, counts towards its keep nor is pruned as abandoned), resumes from it,
    and every manifest verifies."""
    shared = tmp_path / "shared"
    common = ("checkpoint.every_steps=5", "checkpoint.keep=1", f"checkpoint.path={shared}")
    jobs = {name: _job(*common, LEARNING_RATES[i % 2]) for i, name in enumerate(("a", "b", "c", "d"))}
    runs = {name: RunDirectory(tmp_path / name) for name in jobs}
    for name in ("a", "b"):
        assert _fake_run(runs[name], jobs[name])["status"] == "finished"
    with ThreadPoolExecutor(2) as pool:
        at_once = [pool.submit(_fake_run, runs[name], jobs[name]) for name in ("c", "d")]
        assert [f.result(timeout=120)["status"] for f in at_once] == ["finished", "finished"]
    namespaces = _namespaces(shared)
    assert sorted(namespaces) == sorted(r.run_id for r in runs.values())
    for name, job in jobs.items():
        warnings: list[str] = []
        point = find_resume_point(job, runs[name].path, warnings.append)
        assert point is not None and warnings == []
        assert point.root == str(shared / runs[name].run_id) and point.name == "step-00000020"
        assert list(namespaces[runs[name].run_id]) == ["step-00000020"]  # keep=1: its own only
        assert namespaces[runs[name].run_id]["step-00000020"]["meta"]["config_hash"] == config_hash(job)


def test_a_run_directory_from_before_run_ids_resumes_from_its_flat_checkpoints(tmp_path):
    """No ``run_id`` file: the run reads and writes the flat layout it started, beside (and
    blind to) the namespaces of newer runs on the same path."""
    shared = tmp_path / "shared"
    job = _job("checkpoint.every_steps=5", "checkpoint.keep=1", f"checkpoint.path={shared}")
    newer = RunDirectory(tmp_path / "newer")
    assert _fake_run(newer, job)["status"] == "finished"
    old = RunDirectory(tmp_path / "old")
    old.save_job(job.model_dump(mode="json", exclude_unset=True))
    (old.path / RUN_ID_FILE).unlink()
    old.close()
    legacy = RunDirectory(old.path, resume=True)
    assert legacy.run_id is None and namespace_root(job, legacy.path, None) == str(shared)
    assert _fake_run(legacy, job)["status"] == "finished"
    point = find_resume_point(job, old.path, print)
    assert point is not None and point.root == str(shared) and point.name == "step-00000020"
    assert verify_checkpoint(CheckpointStorage(str(shared / newer.run_id)), "step-00000020")  # not pruned by it
    assert sorted(CheckpointStorage(str(shared)).list_dirs()) == sorted([newer.run_id, "step-00000020"])


def test_a_driver_whose_lease_was_taken_writes_no_more_manifests(tmp_path):
    job = _job("checkpoint.every_steps=5", f"checkpoint.path={tmp_path / 'shared'}")
    run_dir = RunDirectory(tmp_path / "run")
    with hold_namespace(job, run_dir) as lease:
        assert lease is not None
        root = Path(namespace_root(job, run_dir.path, run_dir.run_id))
        taken = {**lease_file(root), "owner": {"host": "elsewhere", "pid": 1, "started": 0.0, "token": "f" * 16}}
        put_lease(root, taken)
        summary = _fake_run(run_dir, job, lease)
    assert summary["status"] == "failed" and "no longer this driver's (now held by pid 1 on elsewhere" in summary["error"]
    assert not list(root.glob(f"*/{MANIFEST}"))
    abandoned = [e for e in jsonl(run_dir.path / "events.jsonl") if e["event"] == "checkpoint_abandoned"]
    assert abandoned and abandoned[0]["name"] == "step-00000005"
    assert lease_file(root) == taken  # released: but not its own, so left alone


@pytest.mark.usefixtures("ray_cluster")
def test_a_second_driver_of_a_run_is_refused_before_it_writes_anything(tmp_path):
    job = load_job(None, ["steps=20", "eval=null", "scaling.workers=1", "checkpoint.every_steps=5"])
    made = RunDirectory(tmp_path / "run")
    made.save_job(job.model_dump(mode="json", exclude_unset=True))
    made.close()
    saved = (tmp_path / "run" / "job.json").read_bytes()
    holder = NamespaceLease(namespace_root(job, made.path, made.run_id), settle_s=0.0)
    holder.acquire()
    try:
        with pytest.raises(NamespaceBusy, match=f"in use by another driver \\(pid {os.getpid()} on .*{LEASE_FILE}"):
            run_job(load_job(None, ["steps=30", "eval=null", "scaling.workers=1", "checkpoint.every_steps=5"]), run_dir=made.path)
    finally:
        holder.release()
    assert (tmp_path / "run" / "job.json").read_bytes() == saved
    assert (tmp_path / "run" / "events.jsonl").read_text() == ""


@pytest.mark.usefixtures("ray_cluster")
def test_real_jobs_on_one_checkpoint_path_resume_from_their_own_checkpoints(tmp_path):
    """The issue's case on Ray: two jobs (different learning rates) on one checkpoint.path, run
    one after the other, then both resumed at once; each goes on from its own newest checkpoint."""
    common = ("scaling.workers=2", "checkpoint.every_steps=5", f"checkpoint.path={tmp_path / 'shared'}")
    for name, rate in zip("ab", LEARNING_RATES):
        run(tmp_path, name, "steps=10", rate, *common)
    with ThreadPoolExecutor(2) as pool:
        resumed = [pool.submit(run, tmp_path, name, "steps=15", rate, *common) for name, rate in zip("ab", LEARNING_RATES)]
        results = [f.result(timeout=300) for f in resumed]
    for result in results:
        run_id = (result.run_dir / RUN_ID_FILE).read_text().strip()
        assert [e["checkpoint"] for e in jsonl(result.run_dir / "events.jsonl") if e["event"] == "resume"] == ["step-00000010"]
        assert result.summary["checkpoints"]["root"] == str(tmp_path / "shared" / run_id)
    namespaces = _namespaces(tmp_path / "shared")
    assert len(namespaces) == 2 and all(list(n) == ["step-00000005", "step-00000010", "step-00000015"] for n in namespaces.values())


def test_a_refresher_that_keeps_failing_marks_the_lease_lost_and_the_job_fails(tmp_path, monkeypatch):
    """Any exception in the refresher is recorded and tried again; failing past stale_s (when
    another driver may take the lease) loses the lease, and the next manifest fails the job."""
    root = tmp_path / "ns"
    lease = NamespaceLease(str(root), refresh_s=0.05, stale_s=1.0, settle_s=0.0)
    lease.acquire()

    def broken(relpath: str) -> bytes:
        raise RuntimeError("storage client broke")

    monkeypatch.setattr(lease.storage, "read_bytes", broken)
    wait_for(lambda: lease.trouble is not None, "the refresher to record its failure")
    assert lease.trouble == "RuntimeError: storage client broke" and lease.lost is None
    wait_for(lambda: lease.lost is not None, "the lease to be lost")
    assert lease._refresher is not None
    lease._refresher.join(timeout=10)
    assert not lease._refresher.is_alive()
    assert "went unrefreshed for" in lease.lost and "RuntimeError: storage client broke" in lease.lost
    monkeypatch.undo()
    job = _job("checkpoint.every_steps=5", f"checkpoint.path={tmp_path / 'shared'}")
    summary = _fake_run(RunDirectory(tmp_path / "run"), job, lease)
    assert summary["status"] == "failed" and "went unrefreshed for" in summary["error"]
    lease.release()


def _finished_run(path: Path, job: JobConfig) -> RunDirectory:
    """A run of ``job`` in ``path`` to its end, its job saved and its namespace held as ``run_job`` does."""
    made = RunDirectory(path)
    made.save_job(job.model_dump(mode="json", exclude_unset=True))
    with hold_namespace(job, made) as lease:
        assert _fake_run(made, job, lease)["status"] == "finished"
    return made


def test_a_copied_run_directory_is_refused_on_a_shared_checkpoint_path(tmp_path):
    """A copy keeps the run id: with a shared checkpoint.path it would write (and prune) the
    original's namespace. Refused, in one line saying so, before anything is written; the
    original still resumes; a copy whose checkpoints are inside it (the default root) is its own."""
    job = _job("checkpoint.every_steps=5", "checkpoint.keep=1", f"checkpoint.path={tmp_path / 'shared'}")
    original = _finished_run(tmp_path / "original", job)
    shutil.copytree(original.path, tmp_path / "copy")
    root = Path(namespace_root(job, original.path, original.run_id))
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(ConfigError) as refused:
        find_resume_point(job, tmp_path / "copy", print)
    message = str(refused.value)
    assert "\n" not in message and f"run directory {tmp_path / 'copy'} is a copy of {original.path}" in message
    assert "start a new run with a new --run-dir" in message
    copy = RunDirectory(tmp_path / "copy", resume=True)
    with pytest.raises(ConfigError, match="is a copy of"):
        with hold_namespace(job, copy):
            pass
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # no lease, nothing pruned
    point = find_resume_point(job, original.path, print)
    assert point is not None and point.name == "step-00000020"
    # The remedy the message gives for a run directory moved rather than copied.
    (root / "owner.json").unlink()
    with hold_namespace(job, copy):
        pass
    with pytest.raises(ConfigError, match=f"{original.path} is a copy of {copy.path}"):
        find_resume_point(job, original.path, print)
    # Checkpoints under the run directory (no checkpoint.path) travel with the copy.
    inside = _job("checkpoint.every_steps=5")
    own = _finished_run(tmp_path / "own", inside)
    shutil.copytree(own.path, tmp_path / "own-copy")
    assert find_resume_point(inside, tmp_path / "own-copy", print).name == "step-00000020"
    with hold_namespace(inside, RunDirectory(tmp_path / "own-copy", resume=True)) as lease:
        assert lease is not None and lease.check() is None
    assert find_resume_point(inside, own.path, print).name == "step-00000020"


def test_a_moved_or_remounted_run_directory_is_the_same_run(tmp_path):
    """A run directory seen at another path is no copy when the path its namespace names is
    gone here (moved with mv; the run directory of a multi-node run mounted elsewhere on
    another host, a pod restarted with another mount path) or is this very directory (a bind
    mount, a link): it resumes, and the namespace records the path it has now."""
    job = _job("checkpoint.every_steps=5", "checkpoint.keep=1", f"checkpoint.path={tmp_path / 'shared'}")
    original = _finished_run(tmp_path / "original", job)
    root = Path(namespace_root(job, original.path, original.run_id))
    (tmp_path / "original").rename(tmp_path / "moved")
    moved = tmp_path / "moved"
    assert find_resume_point(job, moved, print).name == "step-00000020"
    with hold_namespace(job, RunDirectory(moved, resume=True)) as lease:
        assert lease is not None and lease.check() is None
    assert json.loads((root / OWNER_FILE).read_text())["run_dir"] == str(moved)
    (tmp_path / "mount").symlink_to(moved)
    for elsewhere in ("/mnt/on-another-host/run", str(tmp_path / "mount")):
        (root / OWNER_FILE).write_text(json.dumps({"format": 1, "run_dir": elsewhere}))
        assert find_resume_point(job, moved, print).name == "step-00000020"
        with hold_namespace(job, RunDirectory(moved, resume=True)):
            pass
        assert json.loads((root / OWNER_FILE).read_text())["run_dir"] == str(moved)


@pytest.mark.usefixtures("ray_cluster")
def test_unreachable_checkpoint_storage_is_one_line_and_the_run_dir_can_be_used_again(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the checkpoint directory should be")
    common = ("steps=4", "eval=null", "scaling.workers=1", "checkpoint.every_steps=2")
    with pytest.raises(ConfigError) as refused:
        run_job(load_job(None, [*common, f"checkpoint.path={blocked}"]), run_dir=tmp_path / "run")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("checkpoint.path: cannot") and str(blocked) in message
    assert not (tmp_path / "run").exists()
    result = run_job(load_job(None, list(common)), run_dir=tmp_path / "run")
    assert result.summary["status"] == "finished"
