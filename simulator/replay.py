"""A recorded run's telemetry fed back through the straggler policies the simulator runs: the
decisions it makes must be those the real driver made (events.jsonl). This is what ties the
simulator to the real system: same classes, same inputs, same verdicts."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.config import JobConfig
from policies.straggler_policies import StepColumns, StragglerPolicies, arrival_s

#: The events a replay reproduces, and what identifies each decision.
DECISIONS = ("straggler", "rebalance", "evict")


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None


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
    return [decision(e) for e in _lines(run_dir / "events.jsonl") if e["event"] in DECISIONS]


def replayed_decisions(run_dir: Path) -> list[tuple[Any, ...]]:
    """The decisions ``StragglerPolicies`` makes from the run's ``telemetry.jsonl`` under its
    ``job.json``, in the driver's order. Raises ValueError for a run whose group changed (a
    failure, an eviction or growth re-forms it: the replay would need the driver's regrouping
    too)."""
    job = JobConfig.model_validate_json((run_dir / "job.json").read_text())
    events = _lines(run_dir / "events.jsonl")
    if any(e["event"] in ("failure", "group_reformed", "evict", "grow") for e in events):
        raise ValueError(f"{run_dir}: the group changed during the run; replay needs a run without failures, evictions or growth")
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in _lines(run_dir / "telemetry.jsonl"):
        by_step[record["step"]].append(record)
    config = job.stragglers
    mitigation = config.mitigation
    policies = StragglerPolicies(job.shards, **config.policy_kwargs())
    first = sorted(by_step)[0] if by_step else 0
    policies.regroup(sorted(r["worker"] for r in by_step.get(first, [])), [])
    out: list[tuple[Any, ...]] = []
    for step in sorted(by_step):
        reports = sorted(by_step[step], key=lambda r: r["rank"])
        columns = StepColumns(
            workers=np.array([r["worker"] for r in reports], np.int64),
            shards=np.array([r["shards_run"] for r in reports], np.int64),
            shard_s=np.array([r["shard_s"] for r in reports]),
            arrival=np.array([arrival_s(r["shards_run"], r["compute_s"], r["stalled_s"], r["gave_up"]) for r in reports]),
        )
        decided = policies.observe(
            step, columns, rebalance=mitigation and config.rebalance and not job.chaos.shuffle_shards, evict=False
        )
        out += [("straggler", step, w, "late") for w in decided.verdict.late]
        out += [("straggler", step, w, "persistent") for w in decided.verdict.newly_persistent]
        if decided.rebalance is not None:
            out.append(("rebalance", step, tuple(sorted(decided.rebalance.counts.items()))))
    return out
