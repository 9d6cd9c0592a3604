"""The recovery core: after a death or an eviction, who is alive and what each applied
(settle), which steps are committed and which to redo, who carries the state on (the new
rank 0), and re-forming the group, retried when someone dies meanwhile
(docs/architecture.md, "Recovery").

The decisions are pure functions over the survivors' ``Progress``; the procedures drive a
``WorkerGroup`` (``orchestrator/group/interface.py``), so ``tests/pure/test_recovery.py`` runs them against an
in-process fake group in milliseconds. ``orchestrator/recovery/procedure.py`` carries them out
in the ``Recovering`` state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from jobspec.runtime import ScalingConfig, ShardingConfig
from jobspec.wire import Progress
from orchestrator.errors import JobFailed
from orchestrator.group.interface import CallFailed, WorkerGroup, WorkerGroupError
from orchestrator.group.membership import JoinerPool
from orchestrator.steps.pipeline import InFlight, calls_of
from orchestrator.store.rendezvous import RendezvousStore
from policies.elasticity import after_failure, pick_root
from policies.sharding import ShardingLayout, Span, first_gap

# How long the driver waits for every member's progress() when it looks for the dead: the
# control group answers in milliseconds even mid-step, so silence this long means a dead
# process (or a node Ray has not declared dead yet).
PROBE_S = 3.0
# Re-forming attempts in a row (each after a further failure) before the job gives up.
MAX_REFORMS = 5


# Pure decisions over the survivors' progress.


def sharding_of(sharding: ShardingConfig, workers: int) -> dict[str, int] | None:
    """For an event: the sharding groups ``workers`` form (``group_size`` as raised to divide
    them, ``replicas``: copies of every slice; at 1 a death there rolls back to a checkpoint),
    or None without sharding."""
    if not sharding.enabled:
        return None
    layout = ShardingLayout.plan(workers, sharding.group_size, 0)
    return {"group_size": layout.group_size, "replicas": layout.replicas}


def state_holders(alive: Mapping[int, Progress], steps_done: int, without_state: frozenset[int] = frozenset()) -> dict[int, int]:
    """Survivors that hold the training state (worker id -> next step): only a member that
    applied every committed step does (a worker still joining holds none)."""
    return {w: p.next_step for w, p in alive.items() if p.next_step >= steps_done and w not in without_state}


@dataclass(frozen=True)
class Settled:
    """The survivors that stay (their progress by worker id) and the workers that are dead,
    silent or did not settle (removed with the dead)."""

    alive: dict[int, Progress]
    lost: list[int]


def settle(group: WorkerGroup, generation: int, in_flight: Sequence[InFlight], leaving: frozenset[int], stuck_s: float) -> Settled:
    """Abort every member's pending steps of ``generation`` and wait (up to ``stuck_s``) until
    the survivors' (not ``leaving`` ones') have ended, so what each survivor applied can no
    longer change."""
    calls = calls_of(in_flight)
    group.abort_all(generation, calls, PROBE_S)
    alive, silent = group.probe(PROBE_S)
    # Dead workers' calls may take a while to fail (a lost node); the survivors' end within
    # the abort poll, and only they matter now.
    theirs = [c for c in calls if c.worker in alive and c.worker not in leaving]
    _, stuck = group.wait(theirs, len(theirs), stuck_s)
    stuck_workers = {c.worker for c in stuck}
    alive, more = group.probe(PROBE_S)
    staying = {w: p for w, p in alive.items() if w not in stuck_workers and w not in leaving}
    return Settled(staying, sorted(set(silent) | set(more) | stuck_workers))


@dataclass(frozen=True)
class Reformed:
    """The group formed again, holding the state to apply ``next_step`` (its root's: steps
    before it are committed, the rest of those in flight are redone); ``transfer_s`` of state
    broadcast, ``reform_s`` the rest of the last attempt; ``waited_s`` waiting for workers
    (below ``min_workers``) over all attempts;
    ``joined``: new workers admitted to it (those that died in a failed attempt included);
    ``lost``: workers that died while it re-formed (removed)."""

    transfer_s: float
    reform_s: float
    next_step: int
    joined: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    waited_s: float = 0.0


@dataclass(frozen=True)
class GiveUp:
    """Too few workers: the job ends with ``reason`` after saving ``holders``' state (worker
    id -> next step; may be empty)."""

    holders: dict[int, int]
    reason: str


@dataclass(frozen=True)
class StateLost:
    """Sharded optimizer state that no survivor holds at the step the group would start from:
    entries ``span`` (None: all of it) for job step ``step``. The group was not formed."""

    step: int
    span: Span | None


def sharded_gap(alive: Mapping[int, Progress], step: int, without_state: frozenset[int] = frozenset()) -> Span | None:
    """With sharded optimizer state (``Progress.held``), the first entries no survivor in
    ``alive`` (less ``without_state``) holds for job step ``step``: (0, 0) if nobody holds
    any; None if the state is whole, at step 0 (nothing to hold yet), or not sharded."""
    if step == 0:
        return None
    held = [span for w, p in alive.items() if w not in without_state for span in p.held]
    if not held:
        return (0, 0)
    return first_gap([(lo, hi) for lo, hi, _, at in held if at == step], held[0][2])


@dataclass(frozen=True)
class ShardedStart:
    """Where a group of sharded state starts: rank 0 ``root`` and job step ``step``."""

    root: int
    step: int


def sharded_start(
    alive: Mapping[int, Progress], root: int, step: int, without_state: frozenset[int] = frozenset()
) -> ShardedStart | StateLost:
    """Where a group of sharded state starts, given ``pick_root``'s ``root`` and ``step``: there,
    when the survivors hold every slice at ``step``; else, if every slice was stepped once more
    (an all-gather that no group finished: ``state_step`` past the parameters' step), after it,
    led by a holder of that step (each slice's parameters come with its state from its
    holders); else StateLost, naming the first entries nobody holds at ``step``."""
    gap = sharded_gap(alive, step, without_state)
    if gap is None:
        return ShardedStart(root, step)
    if sharded_gap(alive, step + 1, without_state) is None:
        # Led by a rank that stepped its own slice (its first): its loss scale and buffers are at step + 1.
        ahead = sorted(w for w, p in alive.items() if w not in without_state and p.held and p.held[0][3] == step + 1)
        return ShardedStart(ahead[0], step + 1)
    return StateLost(step, None if gap == (0, 0) else gap)


@dataclass(frozen=True)
class Reformer:
    """Forms ``group`` again after its membership changed, meeting at ``store``, with
    ``joiners`` joining; ``scaling`` gives min_workers and how long to wait for them;
    ``collective_s`` bounds an abort. ``on_failed_join(lost, error)`` is told of each failed
    attempt (events, counters)."""

    group: WorkerGroup
    store: RendezvousStore
    joiners: JoinerPool
    scaling: ScalingConfig
    collective_s: float
    on_failed_join: Callable[[list[int], str], None]
    sharded: bool = False

    def reform(
        self, alive: Mapping[int, Progress], steps_done: int, without_state: frozenset[int] = frozenset()
    ) -> Reformed | GiveUp | StateLost:
        """Bring the group to ``min_workers`` or more (waiting up to ``wait_for_workers_s`` for
        replacements) and form it with the survivor that applied the most steps as rank 0,
        ready joiners joining. A further death meanwhile starts this over, ``MAX_REFORMS``
        times at most (then raises JobFailed). ``alive``: the members' progress. With
        sharded state (``sharded``) that the survivors no longer hold whole at that step, it
        forms nothing and returns StateLost."""
        waited_since = time.monotonic()
        lost: list[int] = []
        joined: list[int] = []
        waited_s = 0.0
        for _ in range(MAX_REFORMS):
            holders = state_holders(alive, steps_done, without_state)
            self.joiners.fill(force=True)
            while True:
                self.joiners.collect()
                newcomers = self.group.size - len(holders) + len(self.joiners.ready)
                decision = after_failure(
                    len(holders), newcomers, self.scaling.min_workers, time.monotonic() - waited_since,
                    self.scaling.wait_for_workers_s,
                )
                if decision.action == "continue":
                    break
                if decision.action == "fail":
                    return GiveUp(holders, decision.reason)
                waiting = time.monotonic()
                self.joiners.collect(timeout_s=1.0)
                self.joiners.fill()
                waited_s += time.monotonic() - waiting
            root, next_step = pick_root(holders)
            named = -1  # the join's step: the root's own
            if self.sharded:
                start = sharded_start(alive, root, next_step, without_state)
                if isinstance(start, StateLost):
                    return start
                if start.step != next_step:  # every slice stepped past the parameters: start after it
                    root, next_step, named = start.root, start.step, start.step
            self.group.lead_with(root)
            admitted = self.joiners.admit()
            joined += admitted
            started = time.time()
            try:
                transfer_s = self.group.form_group(self.store, named)
                return Reformed(
                    transfer_s, time.time() - started - transfer_s, next_step, tuple(joined), tuple(lost), waited_s
                )
            except (CallFailed, WorkerGroupError) as err:
                alive, silent = self.after_failed_join(err)
                lost += silent
                without_state = without_state | frozenset(admitted)
        raise JobFailed(f"the group could not be re-formed after {MAX_REFORMS} attempts")

    def after_failed_join(self, err: BaseException) -> tuple[dict[int, Progress], list[int]]:
        """A rendezvous failed (a member died while the group formed): abort it everywhere,
        remove whoever does not answer; returns the others' progress and the removed ids.
        Raises StoreProcessError if the store has died: no attempt could succeed then."""
        self.store.check_alive()
        self.group.abort_all(self.store.generation, [], self.collective_s)
        alive, silent = self.group.probe(PROBE_S)
        self.on_failed_join(silent, str(err))
        self.group.remove(silent)
        return alive, silent
