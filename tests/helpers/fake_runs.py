"""A whole job run by the real controller over the in-process fake worker group
(``tests/helpers/fake_group.py``): no Ray, milliseconds a run, the events and the members'
applied steps kept for the invariant's checks (``Ran.assert_exact``)."""

from __future__ import annotations

import time
from pathlib import Path

from jobspec.job import JobConfig
from orchestrator.controller import JobController
from orchestrator.group.chaos_control import ChaosControl
from orchestrator.job.reading import load_job
from orchestrator.output.metrics import MetricsListener
from orchestrator.output.run_dir import RunDirectory
from orchestrator.store.rendezvous import RendezvousStore
from tests.helpers.fake_group import FakeWorkerGroup, Faults
from tests.helpers.jobs import jsonl

STEPS = 20


def fake_job(*overrides: str) -> JobConfig:
    """A job of ``STEPS`` steps on 3 workers, no eval, no rebalancing: the fake runs' default."""
    return load_job(None, [f"steps={STEPS}", "eval=null", "scaling.workers=3", "stragglers.rebalance=false", *overrides], resolve=False)


class Ran:
    """A finished fake run: its summary, events, states and group."""

    def __init__(
        self, tmp_path: Path, faults: Faults | None, overrides: tuple[str, ...], metrics: object = None, **group_options: object
    ) -> None:
        self.job = fake_job(*overrides)
        run = RunDirectory(tmp_path / "run")
        self.group = FakeWorkerGroup(self.job, faults, **group_options)  # type: ignore[arg-type]
        store = RendezvousStore("127.0.0.1", 10.0)
        controller = JobController(
            self.job, run, self.group, store, chaos=ChaosControl(self.job.chaos, None, 0, run.event), launched=time.perf_counter()
        )
        if metrics is not None:  # as run_job subscribes it, with a recorder for Ray's metrics
            run.subscribe(MetricsListener(metrics, controller.accounting, run.event))  # type: ignore[arg-type]
        started = time.perf_counter()
        self.summary = controller.execute().summary
        self.seconds = time.perf_counter() - started
        self.run_dir = run.path
        self.events = jsonl(run.path / "events.jsonl")
        self.states = [e["new"] for e in self.events if e["event"] == "state"]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]

    def assert_exact(self) -> None:
        assert self.summary["status"] == "finished", self.summary.get("error")
        assert [e["step"] for e in self.of("step")] == list(range(STEPS))
        assert self.summary["steps"] == STEPS
        # Every step committed with its reports (a batch cut by a failure included).
        assert all(e["samples"] == self.job.batch_size for e in self.of("step"))
        assert len(self.group.at_shutdown) == self.summary["workers"]["end"] > 0
        for member in self.group.at_shutdown:
            assert member.next_step == STEPS
            assert member.applied == sorted(set(member.applied)), f"worker {member.worker} applied {member.applied}"


def fake_run(tmp_path: Path, faults: Faults | None = None, *overrides: str, **group_options: object) -> Ran:
    """``fake_job(*overrides)`` run to its end over a fake group with ``faults``."""
    return Ran(tmp_path, faults, overrides, **group_options)
