"""What a run leaves in ``summary.json``: the outcome, counts and timings of one job."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.job import JobConfig
from orchestrator.accounting.ledger import CommitLedger
from orchestrator.accounting.recovery_log import Recovery
from policies.goodput import Goodput, RecoverySpans, account

#: Counters of what happened during a job (``summary["events"]``).
EVENT_COUNTERS = (
    "failures",
    "recoveries",
    "steps_redone",
    "stragglers_detected",
    "speculative_shards",
    "speculative_won",
    "races_lost",
    "stolen_shards",
    "rescues",
    "rescued_shards",
    "rebalances",
    "checkpoints",
    "evictions",
    "joins",
)


@dataclass(frozen=True)
class JobResult:
    """A finished job's run directory and its summary (also saved there)."""

    run_dir: Path
    summary: dict[str, Any]


def job_summary(
    job: JobConfig,
    status: str,
    ledger: CommitLedger,
    num_steps: int,
    *,
    started: float,
    train_s: float,
    startup_s: dict[str, float],
    metrics: dict[str, float],
    workers: dict[str, int],
    counters: dict[str, int],
    recoveries: list[Recovery],
    checkpoints: dict[str, Any],
    goodput: Goodput,
    control_plane: dict[str, Any],
    error: str | None,
) -> dict[str, Any]:
    """The summary of a job that ended in ``status``; ``started`` is ``perf_counter()`` at launch,
    ``train_s`` the seconds from the first step to the last, ``workers`` the group's size at
    ``start`` and ``end``."""
    summary: dict[str, Any] = {
        "name": job.name,
        "status": status,
        "steps": ledger.steps_done,
        "steps_planned": num_steps,
        "samples": ledger.samples,
        "wall_s": time.perf_counter() - started,
        "train_s": train_s,
        "first_step_s": startup_s.get("first_step"),
        "startup_s": dict(startup_s),
        "samples_per_s": ledger.samples / train_s if train_s else 0.0,
        "final_loss": ledger.final_loss,
        "eval": metrics,
        "workers": workers,
        "shards_expected": ledger.steps_done * job.shards,
        "shards_committed": ledger.shards_committed,
        "events": dict(counters),
        "recoveries": [r.to_json() for r in recoveries],
        "checkpoints": checkpoints,
        "goodput": goodput.to_json(),
        "control_plane": control_plane,
    }
    if error:
        summary["error"] = error
    return summary


def job_goodput(
    wall_s: float,
    startup_s: dict[str, float],
    ledger: CommitLedger,
    recoveries: list[Recovery],
    checkpoint_copy_s: list[float],
    finishing_s: float = 0.0,
) -> Goodput:
    """The goodput account (``policies/goodput.py``) of a job ``wall_s`` seconds after launch:
    start-up is launch to the group formed (all of the wall time while it forms)."""
    # Spans measured against other clocks (a death time from another node) can come out
    # negative by clock skew: clamped. A recovery with nothing to redo redid nothing.
    spans = [
        RecoverySpans(
            max(0.0, r.detect_s), max(0.0, r.reform_s), max(0.0, r.transfer_s), max(0.0, r.waited_s),
            max(0.0, r.redo_s or 0.0) if r.redo_steps else 0.0,
        )
        for r in recoveries
    ]
    return account(
        max(0.0, wall_s),
        startup_s=max(0.0, startup_s.get("group_formed", wall_s)),
        checkpoint_stall_s=max(0.0, sum(checkpoint_copy_s)),
        recoveries=spans,
        straggler_wait_s=max(0.0, ledger.straggler_wait_s),
        finishing_s=max(0.0, finishing_s),
    )
