"""Goodput: the share of a job's wall time spent on steps that committed, and where the rest
went. Pure arithmetic over what the driver measured (no Ray, no torch), so the same account
serves ``summary.json``, the live metrics and the report.

The causes of lost time, in seconds:

* ``startup``: from launch to the group formed (Ray, actors, data, rendezvous);
* ``checkpoint_stalls``: training held up by checkpoint snapshots (the copy to memory; the
  write runs in the background);
* ``detection``: from a death to knowing who died;
* ``reforming``: re-forming the group (rendezvous, state transfer to joiners), less
  ``waiting_for_workers``: below ``min_workers``, waiting for replacements;
* ``redone_steps``: re-running steps that were in flight when a worker died;
* ``stragglers``: in committed steps, the mean over workers of how long each waited for the
  slowest (``orchestrator.accounting.ledger.straggler_wait``: in the all-reduce, or idle for others'
  shards);
* ``finishing``: after the last step (final checkpoint, eval, saving the model).

What is left of the wall time is productive: committed steps, less their straggler waits.
Spans are measured separately and could overlap (a checkpoint stall inside a step that was
later redone); the account clamps so the parts never exceed the wall time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CAUSES = (
    "startup",
    "checkpoint_stalls",
    "detection",
    "reforming",
    "waiting_for_workers",
    "redone_steps",
    "stragglers",
    "finishing",
)


@dataclass(frozen=True)
class RecoverySpans:
    """One recovery's measured spans, in seconds (``redo_s`` 0 while its steps still run)."""

    detect_s: float
    reform_s: float
    transfer_s: float
    waited_s: float
    redo_s: float


@dataclass(frozen=True)
class Goodput:
    """``wall_s`` split into ``lost_s`` by cause (``CAUSES``) and ``productive_s``."""

    wall_s: float
    lost_s: Mapping[str, float] = field(default_factory=dict)

    @property
    def productive_s(self) -> float:
        return max(0.0, self.wall_s - sum(self.lost_s.values()))

    @property
    def share(self) -> float:
        """Productive seconds over wall seconds (0 for an empty wall)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "goodput": self.share, "wall_s": self.wall_s, "productive_s": self.productive_s,
            "lost_s": dict(self.lost_s),
        }


def account(
    wall_s: float,
    *,
    startup_s: float,
    checkpoint_stall_s: float,
    recoveries: Iterable[RecoverySpans],
    straggler_wait_s: float,
    finishing_s: float = 0.0,
) -> Goodput:
    """The goodput of ``wall_s`` seconds given the measured spans (seconds, each >= 0).
    Causes are charged in ``CAUSES`` order, each clamped to the wall time not yet charged.
    Raises ValueError for a negative input."""
    recoveries = list(recoveries)
    spans = {
        "startup": startup_s,
        "checkpoint_stalls": checkpoint_stall_s,
        "detection": sum(r.detect_s for r in recoveries),
        "reforming": sum(max(0.0, r.reform_s - r.waited_s) + r.transfer_s for r in recoveries),
        "waiting_for_workers": sum(r.waited_s for r in recoveries),
        "redone_steps": sum(r.redo_s for r in recoveries),
        "stragglers": straggler_wait_s,
        "finishing": finishing_s,
    }
    for cause, seconds in {"wall": wall_s, **spans}.items():
        if seconds < 0:
            raise ValueError(f"{cause} seconds must be >= 0, got {seconds}")
    left = wall_s
    lost: dict[str, float] = {}
    for cause in CAUSES:
        lost[cause] = min(spans[cause], left)
        left -= lost[cause]
    return Goodput(wall_s, lost)
