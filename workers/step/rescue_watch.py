"""The rescue watch: while a rank waits for a step's all-reduce, it watches a few peers and opens
the block of one that is late, so that the peer's shards go to the rescue pass.

A peer whose planned shards all still sit unstarted long after they were expected (it is
stalled before it sealed its block, e.g. reading its data) holds the whole group up: the
watcher opens its block (``ShardClaims.open_block``); the peer, seeing that while it waits for
its data, stops waiting and brings nothing to the all-reduce, and every rank runs its shards
in the rescue pass after it (``StepRunner.rescue``, ``workers/step/runner.py``; docs/architecture.md,
"Rescue"). The reducer calls the watch between its waits (``GradientReducer.finish``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from policies.work_stealing import FREE, RESCUE_AFTER_MIN_S, ClaimKind, block_late, watched_peers
from workers.runtime.abortable import ABORT_POLL_S
from workers.step.records import ClaimedStep, StepWork

# How often a rank waiting for the all-reduce looks at the step's claims (a store round trip).
WATCH_POLL_S = 0.002


def rescue_watch(ctx: ClaimedStep, work: StepWork) -> Callable[[], float | None]:
    """What this rank does while it waits for the step's all-reduce: open the block of any
    peer it watches (``watched_peers``) whose shards all still sit unstarted after
    ``late_factor`` x their expected time (``block_late``). The peer, seeing it while it
    waits for its data, stops waiting and brings nothing to the all-reduce; its shards go
    to the rescue pass. The returned callable does one look and says when to look again
    (seconds; None: no more), as ``GradientReducer.finish`` asks: while some watched peer has
    not sealed its block or had it opened, and neither the driver's abort nor the deadline
    came first. A look reads the watched peers' keys only (one store round trip), and on a
    clean step nothing (``clean_look``)."""
    until = time.monotonic() + ctx.deadline_s
    plan, claims = ctx.plan, ctx.claims
    peers = watched_peers(plan, claims.me)
    if plan.clean:
        return clean_look(ctx, work, peers, until)

    def look() -> float | None:
        if not peers or _stopped(ctx, until):
            return None
        states, blocks = claims.read(peers)
        ages = work.ages(states, time.monotonic())
        undecided = [rank for rank in peers if blocks[rank] == FREE.encode()]
        for rank in undecided:
            if block_late(plan, rank, states, ages):
                claims.open_block(rank)
        return WATCH_POLL_S if undecided else None

    return look


def _stopped(ctx: ClaimedStep, until: float) -> bool:
    """Whether a watch has nothing more to do: nobody can be rescued on its plan
    (``StepPlan.rescues``), the driver aborted the step, or its deadline passed."""
    return not ctx.plan.rescues or ctx.abort.is_set() or time.monotonic() > until


def clean_look(ctx: ClaimedStep, work: StepWork, peers: list[int], until: float) -> Callable[[], float | None]:
    """The watch of a clean step (``StepPlan.clean``): nobody seals, so there is nothing to
    read; a watched peer's shards count as unstarted from this rank's first look, and it opens
    the peer's block (one compare-and-set) once ``block_late`` says so. It looks again when the
    next peer could be late (at most every ``abortable.ABORT_POLL_S``, for the abort flag),
    at no cost: a step where nobody is late sends the store nothing."""
    plan, claims = ctx.plan, ctx.claims
    unopened = list(peers)
    unstarted = {s: FREE for rank in peers for s in plan.shards_by_rank[rank]}

    def look() -> float | None:
        if not unopened or _stopped(ctx, until):
            return None
        ages = work.ages(unstarted, time.monotonic())
        for rank in list(unopened):
            if block_late(plan, rank, unstarted, ages):
                claims.open_block(rank)
                unopened.remove(rank)
        if not unopened:
            return None
        due = min(
            max(plan.late_after_s(rank, ClaimKind.FREE), RESCUE_AFTER_MIN_S) - ages[plan.shards_by_rank[rank][0]]
            for rank in unopened
        )
        return min(ABORT_POLL_S, max(WATCH_POLL_S, due))

    return look
