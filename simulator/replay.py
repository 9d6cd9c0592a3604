"""A recorded run's telemetry fed back through the straggler policies the simulator runs: the
decisions it makes must be those the real driver made (events.jsonl). This is what ties the
simulator to the real system: same classes, same inputs, same verdicts."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from jobspec.durable import read_jsonl
from jobspec.job import JobConfig
from jobspec.step_record import read_telemetry
from jobspec.wire import StepTelemetry
from policies.straggler_policies import StepColumns, StragglerPolicies

#: The events a replay reproduces, and what identifies each decision.
DECISIONS = ("straggler", "rebalance", "evict")


def decision(event: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a decision event: its kind, step (at_step for evictions) and verdict."""
    kind = event["event"]
    if kind == "straggler":
        return (kind, event["step"], event["worker"], event["status"])
    if kind == "rebalance":
        return (kind, event["step"], tuple(sorted((int(w), c) for w, c in event["counts"].items())))
    return (kind, event["worker"], event["reason"])


def recorded_decisions(run_dir: Path) -> list[tuple[Any, ...]]:
    """The straggler, rebalance and evict decisions the real run's driver logged."""
    return [decision(e) for e in read_jsonl(run_dir / "events.jsonl") if e["event"] in DECISIONS]


def replayed_decisions(run_dir: Path) -> list[tuple[Any, ...]]:
    """The decisions ``StragglerPolicies`` makes from the run's ``telemetry.jsonl`` under its
    ``job.json``, in the driver's order. Raises ValueError for a run whose group changed (a
    failure, an eviction or growth re-forms it: the replay would need the driver's regrouping
    too)."""
    job = JobConfig.model_validate_json((run_dir / "job.json").read_text())
    if any(e["event"] in ("failure", "group_reformed", "evict", "grow") for e in read_jsonl(run_dir / "events.jsonl")):
        raise ValueError(f"{run_dir}: the group changed during the run; replay needs a run without failures, evictions or growth")
    by_step: dict[int, list[StepTelemetry]] = defaultdict(list)
    for record in read_telemetry(run_dir / "telemetry.jsonl"):
        by_step[record["step"]].append(StepTelemetry(**record))
    if not by_step:
        raise ValueError(f"{run_dir}: telemetry.jsonl holds no step")
    policies = StragglerPolicies(job.shards, **job.stragglers.policy_kwargs())
    policies.regroup(sorted(r.worker for r in by_step[min(by_step)]), [])
    out: list[tuple[Any, ...]] = []
    for step in sorted(by_step):
        reports = sorted(by_step[step], key=lambda r: r.rank)
        decided = policies.observe(step, StepColumns.of_reports(reports), rebalance=job.rebalancing, evict=False)
        out += [("straggler", step, w, "late") for w in decided.verdict.late]
        out += [("straggler", step, w, "persistent") for w in decided.verdict.newly_persistent]
        if decided.rebalance is not None:
            out.append(("rebalance", step, tuple(sorted(decided.rebalance.counts.items()))))
    return out
