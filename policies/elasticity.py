"""Elasticity: what to do with the group after a failure, and when to let workers join.
Pure: no Ray, no torch.

A synchronous data-parallel step needs every member, so a death ends the step for everyone;
what remains is choosing who carries the state on and whether the job can go on at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class AfterFailure:
    """``continue`` with the survivors (and any replacements that are ready), ``wait`` for more
    workers, or ``fail``; ``reason`` is for the events and the error message."""

    action: Literal["continue", "wait", "fail"]
    reason: str


def after_failure(survivors: int, ready: int, min_workers: int, waited_s: float, wait_limit_s: float) -> AfterFailure:
    """Decide after removing the dead: ``survivors`` hold the training state, ``ready`` new
    workers have loaded and can join; the job needs ``min_workers``. Below it, wait up to
    ``wait_limit_s`` (``waited_s`` so far) for resources, then fail. With no survivor nothing
    holds the state in memory: fail (the last checkpoint can be resumed)."""
    if survivors == 0:
        return AfterFailure("fail", "no worker survived, so no replica holds the training state")
    have = survivors + ready
    if have >= min_workers:
        return AfterFailure("continue", f"{survivors} survivor(s) + {ready} new >= min_workers {min_workers}")
    if waited_s < wait_limit_s:
        return AfterFailure("wait", f"{have} worker(s) < min_workers {min_workers}; waiting for resources")
    return AfterFailure(
        "fail",
        f"only {have} worker(s) left, below scaling.min_workers ({min_workers}), "
        f"and none came back within scaling.wait_for_workers_s ({wait_limit_s:.0f}s)",
    )


def pick_root(next_steps: dict[int, int]) -> tuple[int, int]:
    """The worker whose state the next generation takes, and its next step: the survivor that
    applied the most steps (an aborted all-reduce can end on some ranks and not others, so
    survivors may be one step apart; the furthest one is the truth), lowest id on ties.
    ``next_steps`` maps worker id to the next step it would apply; must not be empty."""
    if not next_steps:
        raise ValueError("no survivors to take the state from")
    worker = min(next_steps, key=lambda w: (-next_steps[w], w))
    return worker, next_steps[worker]


def admit_count(size: int, ready: int, max_workers: int) -> int:
    """How many ready workers join now: all of them, up to ``max_workers`` in the group."""
    return max(0, min(ready, max_workers - size))
