"""Within-step work choice: run own shards, steal unstarted ones, back up late ones. Pure.

Every shard of a step has one claim state, shared by all workers (kept in the driver-hosted
store, changed only by compare-and-set; see ``workers/step/claims.py``):

* ``free``: nobody has started it;
* ``run`` by R: R claimed it and is computing it; another worker may still back it up;
* ``sealed`` by R: R is computing it in its final, overlapped pass: no backup may start;
* ``race`` R vs B: B is running a backup of R's shard; whoever commits first wins;
* ``done`` by X: X's gradient for it counts; nobody else's does.

A worker that is idle asks ``pick_work`` what to do next, given the states and how long each
shard has sat in its current state (as the asking worker observed it: no clock is shared).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import cached_property


class ClaimKind(str, Enum):
    FREE = "free"
    RUN = "run"
    SEALED = "sealed"
    RACE = "race"
    DONE = "done"


@dataclass(frozen=True)
class ClaimState:
    kind: ClaimKind
    owner: int = -1  # who claimed it (run/sealed/race) or whose gradient counts (done)
    backup: int = -1  # the backup runner, in a race

    def encode(self) -> str:
        if self.kind is ClaimKind.FREE:
            return "free"
        if self.kind is ClaimKind.RACE:
            return f"race:{self.owner}:{self.backup}"
        return f"{self.kind.value}:{self.owner}"

    @classmethod
    def decode(cls, text: str) -> "ClaimState":
        """The state a store value stands for."""
        if text in ("", "free"):
            return FREE
        kind, _, rest = text.partition(":")
        if kind == ClaimKind.RACE.value:
            owner, _, backup = rest.partition(":")
            return cls(ClaimKind.RACE, int(owner), int(backup))
        return cls(ClaimKind(kind), int(rest))


FREE = ClaimState(ClaimKind.FREE)


@dataclass(frozen=True)
class StepPlan:
    """The driver's starting assignment for one step, as every worker sees it.

    ``shards_by_rank[r]``: rank r's shards in run order. ``suspects``: ranks the detector
    flagged (late or persistently slow) in recent steps; their unstarted shards may be stolen
    at once and they never seal. ``expected_shard_s``: typical compute seconds per shard.
    ``late_factor``: a shard is late once it has sat in one state longer than this many times
    what its owner should need for it. ``steal``/``speculate``: which mitigations are on.
    """

    shards_by_rank: tuple[tuple[int, ...], ...]
    suspects: frozenset[int] = frozenset()
    expected_shard_s: float = 0.0
    late_factor: float = 3.0
    steal: bool = True
    speculate: bool = True

    @property
    def num_shards(self) -> int:
        return sum(len(s) for s in self.shards_by_rank)

    @cached_property
    def owners(self) -> dict[int, int]:
        """Each shard's planned rank."""
        return {shard: rank for rank, shards in enumerate(self.shards_by_rank) for shard in shards}

    def owner_of(self, shard: int) -> int:
        """Raises KeyError for a shard not in the plan."""
        return self.owners[shard]

    def pass_size(self, rank: int) -> int:
        """With laggards about, own shards run in two passes: the second stays stealable."""
        return max(1, math.ceil(len(self.shards_by_rank[rank]) / 2))

    def late_after_s(self, rank: int, kind: ClaimKind) -> float:
        """How long a shard of ``rank`` may sit ``free`` (whole queue) or ``run`` (one pass)."""
        shards = len(self.shards_by_rank[rank]) if kind is ClaimKind.FREE else self.pass_size(rank)
        return self.late_factor * max(1, shards) * self.expected_shard_s

    @property
    def mitigating(self) -> bool:
        return self.steal or self.speculate

    @property
    def rescues(self) -> bool:
        """Whether a peer found late can be rescued (its block opened by a watcher): stealing
        on, and the shards' expected time known (nothing is late before the driver knows what
        to expect)."""
        return self.steal and self.expected_shard_s > 0

    @property
    def clean(self) -> bool:
        """Mitigating with nobody suspected: every rank runs its own shards at once, and the
        step needs no claims unless someone turns out late (``workers/step/claims.py``)."""
        return self.mitigating and not self.suspects


@dataclass(frozen=True)
class RunShards:
    """Claim ``shards`` (all free) and run them in one pass; ``seal``: as the final,
    overlapped pass; ``stolen_from``: their planned owner when stealing, else -1."""

    shards: tuple[int, ...]
    seal: bool
    stolen_from: int = -1


@dataclass(frozen=True)
class Backup:
    """Start a backup of ``shard``, now run by ``owner``."""

    shard: int
    owner: int


@dataclass(frozen=True)
class Wait:
    """Nothing to do yet; shards of others are still being computed."""


@dataclass(frozen=True)
class Finished:
    """Every shard is done or sealed: go to the all-reduce."""


WorkDecision = RunShards | Backup | Wait | Finished


def _late(plan: StepPlan, shard: int, state: ClaimState, age_s: float) -> bool:
    owner = plan.owner_of(shard) if state.kind is ClaimKind.FREE else state.owner
    return plan.expected_shard_s > 0 and age_s > plan.late_after_s(owner, state.kind)


#: A block counts as late only after this long, whatever it should need: on a busy host a
#: worker can start a step tens of ms after its peers (scheduling, not a stall), and each
#: rescue costs the step one more all-reduce.
RESCUE_AFTER_MIN_S = 0.05


def block_late(plan: StepPlan, rank: int, states: dict[int, ClaimState], ages_s: dict[int, float]) -> bool:
    """Whether ``rank`` has shards and all of them still sit ``free`` (its block unsealed: it
    has not started) after ``late_factor`` x the time it should need for them all (and at
    least RESCUE_AFTER_MIN_S). A peer that has finished its own shards and waits in the
    all-reduce rescues such a rank (opens its block), though it was never a suspect: a
    transient stall nobody predicted."""
    shards = plan.shards_by_rank[rank]
    return bool(shards) and all(
        states[s].kind is ClaimKind.FREE
        and _late(plan, s, states[s], ages_s.get(s, 0.0))
        and ages_s.get(s, 0.0) > RESCUE_AFTER_MIN_S
        for s in shards
    )


# Peers each rank watches while it waits for the all-reduce: the next rank with shards and the
# one half the ring away (on another node, where ranks are dealt node by node, so a node whose
# ranks all stall together is still watched from outside). Each rank is watched by two when
# every rank has shards, so a step's watch traffic grows with N, not N^2 (every rank reading every key).
WATCHED_PEERS = 2


def watched_peers(plan: StepPlan, me: int) -> list[int]:
    """The ranks ``me`` watches, at most ``WATCHED_PEERS``, each with planned shards: the next
    rank, then the first ones from half the ring on (wrapping round to me + 2)."""
    ranks = len(plan.shards_by_rank)
    half = max(2, ranks // 2)
    order = [1, *range(half, ranks), *range(2, half)]
    peers: list[int] = []
    for offset in order:
        rank = (me + offset) % ranks
        if rank != me and plan.shards_by_rank[rank] and rank not in peers:
            peers.append(rank)
            if len(peers) == WATCHED_PEERS:
                break
    return peers


def claim_focus(plan: StepPlan, me: int) -> list[int]:
    """The ranks whose claims rank ``me`` reads in a step with suspects: itself, the suspects
    (its victims: shards to steal, runs to back up) and the peers it watches
    (``watched_peers``), in rank order; every other rank's shards it takes for done. Each rank
    is watched by two, so a peer that falls behind unannounced is still seen and helped by
    somebody; the rest of the group goes to the all-reduce, where the rescue watch looks again
    (docs/architecture.md, "Rescue"). So an idle rank reads O(suspects) keys a poll, not the
    whole step: O(N) per poll, O(N^2) across the group."""
    return sorted({me, *plan.suspects, *watched_peers(plan, me)})


def pick_work(me: int, plan: StepPlan, states: dict[int, ClaimState], ages_s: dict[int, float]) -> WorkDecision:
    """What rank ``me`` does next. ``states[s]``: shard s's claim state, for the shards ``me``
    reads (a shard missing from it counts as done: a rank reading only its focus,
    ``claim_focus``, or a rescue pass the missing shards' owners); ``ages_s[s]``: seconds ``me``
    has seen it in that state. Without mitigation: own shards in one pass, then finish.
    """

    def free(shard: int) -> bool:
        state = states.get(shard)
        return state is not None and state.kind is ClaimKind.FREE

    mine = plan.shards_by_rank[me]
    own_free = [s for s in mine if free(s)]
    if not plan.mitigating:
        return RunShards(tuple(own_free), seal=True) if own_free else Finished()
    late = {s for s, st in states.items() if st.kind in (ClaimKind.FREE, ClaimKind.RUN) and _late(plan, s, st, ages_s.get(s, 0.0))}
    laggards = set(plan.suspects) | {
        states[s].owner if states[s].kind is ClaimKind.RUN else plan.owner_of(s) for s in late
    }
    laggards.discard(me)
    if own_free:
        if not laggards and me not in plan.suspects:  # the common case: all at once, overlapped
            return RunShards(tuple(own_free), seal=True)
        group = tuple(own_free[: plan.pass_size(me)])
        last = len(group) == len(own_free)
        stealable = any(free(s) for r in laggards for s in plan.shards_by_rank[r])
        return RunShards(group, seal=last and me not in plan.suspects and not stealable)
    if plan.steal:
        victims = {
            r: [s for s in plan.shards_by_rank[r] if free(s)] for r in laggards
        }
        victims = {r: free for r, free in victims.items() if free}
        if victims:
            victim = max(victims, key=lambda r: (len(victims[r]), -r))
            free = victims[victim]
            return RunShards(tuple(free[-math.ceil(len(free) / 2) :]), seal=False, stolen_from=victim)
    if plan.speculate:
        running = [s for s in late if states[s].kind is ClaimKind.RUN and states[s].owner != me]
        if running:
            shard = max(running, key=lambda s: (ages_s.get(s, 0.0), -s))
            return Backup(shard, states[shard].owner)
    if all(st.kind in (ClaimKind.DONE, ClaimKind.SEALED) for st in states.values()):
        return Finished()
    return Wait()
