"""The job's store (rendezvous and shard claims, a child process of the driver) killed by its
PID mid-run: the job ends ``failed`` through the state machine (``summary.json``, a ``job_end``
event, a result returned, not raised) with a summary that names the store's address, within
seconds: with mitigation on (the driver and the workers use the store every step), off
(nothing uses it until a rendezvous), and while a recovery re-forms the group."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import orchestrator.store.rendezvous
from orchestrator.controller import JobController
from orchestrator.group.chaos_control import ChaosControl
from orchestrator.job.reading import load_job
from orchestrator.launch import run_job
from orchestrator.output.run_dir import RunDirectory
from orchestrator.store.rendezvous import RendezvousStore
from tests.helpers.fake_group import FakeWorkerGroup, Faults
from tests.helpers.jobs import jsonl

KILL_AT = 5
RENDEZVOUS_S = 60.0
# Well under 5 x rendezvous_s (what a dead store took to show before: five failed re-formings).
NAMED_WITHIN_S = 15.0


class KillStore:
    """A run listener that SIGKILLs the job's store process (the latest of ``stores``) by its
    PID at the first event ``when`` picks, and waits until it has died."""

    def __init__(self, stores: list[RendezvousStore], when: Callable[[dict[str, Any]], bool]) -> None:
        self.stores = stores
        self.when = when
        self.killed_at: float | None = None

    def on_event(self, record: dict[str, Any]) -> None:
        if self.killed_at is not None or not self.when(record):
            return
        process = self.stores[-1].process
        assert process is not None
        os.kill(process.pid, signal.SIGKILL)
        self.killed_at = time.time()
        deadline = time.monotonic() + 10.0
        while process.exit_status() is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def on_model(self, path: Path) -> None:
        pass

    def on_summary(self, summary: dict[str, Any]) -> None:
        pass


def _assert_failed_naming(store: RendezvousStore, run_dir: Path, summary: dict[str, Any], killer: KillStore) -> None:
    assert killer.killed_at is not None, "the store was not killed"
    assert summary["status"] == "failed"
    assert f"the job's store (rendezvous and shard claims) at {store.host}:{store.port} died" in summary["error"]
    events = jsonl(run_dir / "events.jsonl")
    assert events[-1]["event"] == "job_end" and events[-1]["status"] == "failed"
    failed_at = next(e["time"] for e in events if e["event"] == "state" and e["new"] == "failed")
    assert failed_at - killer.killed_at < NAMED_WITHIN_S
    assert (run_dir / "summary.json").exists()


def _step_committed(step: int) -> Callable[[dict[str, Any]], bool]:
    return lambda record: record["event"] == "step" and record["step"] == step


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("mitigation", [True, False], ids=["mitigation-on", "mitigation-off"])
def test_a_killed_store_fails_the_job_at_once_naming_the_store(tmp_path, monkeypatch, mitigation):
    stores: list[RendezvousStore] = []
    make_store = orchestrator.store.rendezvous.driver_store

    def recorded_store(timeout_s: float, claim_stores: int = 1) -> RendezvousStore:
        stores.append(make_store(timeout_s, claim_stores))
        return stores[-1]

    monkeypatch.setattr(orchestrator.store.rendezvous, "driver_store", recorded_store)
    killer = KillStore(stores, _step_committed(KILL_AT))
    job = load_job(None, [
        "steps=40", "eval=null", "scaling.workers=2", f"stragglers.mitigation={str(mitigation).lower()}",
        f"timeouts.rendezvous_s={RENDEZVOUS_S}",
    ])
    result = run_job(job, run_dir=tmp_path / "run", listeners=[killer])  # returns: no traceback
    _assert_failed_naming(stores[-1], result.run_dir, result.summary, killer)
    assert KILL_AT < result.summary["steps"] < 40


def test_a_store_killed_while_the_group_re_forms_is_named_not_retried(tmp_path):
    """Worker 1 dies in step 5; the store dies as the recovery starts; the first re-forming
    fails (worker 2 dies joining): the job fails naming the store, rather than trying again."""
    job = load_job(None, ["steps=20", "eval=null", "scaling.workers=3", "stragglers.rebalance=false"], resolve=False)
    run = RunDirectory(tmp_path / "run")
    store = RendezvousStore("127.0.0.1", RENDEZVOUS_S, own_process=True)
    killer = KillStore([store], lambda record: record["event"] == "failure")
    run.subscribe(killer)
    group = FakeWorkerGroup(job, Faults(die_in_step={(1, KILL_AT): False}, die_joining={2: KILL_AT}))
    try:
        controller = JobController(
            job, run, group, store, chaos=ChaosControl(job.chaos, None, 0, run.event), launched=time.perf_counter()
        )
        summary = controller.execute().summary
    finally:
        store.close()
    _assert_failed_naming(store, run.path, summary, killer)
    assert group.generations == 2  # formed at the start, then the one failed re-forming: no retry
