"""Sharded optimizer state: which rank owns which slice, and how state moves when that changes.
Pure: no Ray, no torch (docs/architecture.md, "Sharded optimizer state").

Ranks form **sharding groups** of ``group_size`` consecutive ranks; each rank of a group owns
one contiguous slice of the flat parameter vector (``policies.split.even_bounds``: position
``i`` of a group owns the ``i``-th slice) and holds the optimizer state of that slice only.
The groups are **replicas** of one another: rank ``i`` of every group owns the same slice, and
those ranks (its *peers*) sum that slice's gradient across the groups.

A group size must divide the world. The job asks for a size; ``effective_group_size`` takes the
smallest divisor of the world that is at least that (capped at the world), so that a rank never
holds more state than the job planned for, whatever the number of workers left after a death
or reached by growth.

When the layout changes (a group re-formed with other ranks or another size), ``plan_moves``
says which bytes go where: every rank names the slices it holds (none, one, or more while a
regroup is unconfirmed) and the one it must hold next; each wanted range not already held by its owner is cut where the holders' slices
begin and end and taken from one holder, so each byte moves once, from a holder to its owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.split import even_bounds

Span = tuple[int, int]


def effective_group_size(world: int, configured: int) -> int:
    """The sharding group size for ``world`` ranks when the job asks for ``configured``: the
    smallest divisor of ``world`` that is at least ``min(configured, world)``. Raises ValueError
    if either is below 1."""
    if world < 1 or configured < 1:
        raise ValueError(f"need world >= 1 and group_size >= 1, got {world} and {configured}")
    wanted = min(configured, world)
    return next(size for size in range(wanted, world + 1) if world % size == 0)


def clip_span(span: Span, lo: int, hi: int) -> Span:
    """``span`` cut to ``[lo, hi)`` and shifted so that ``lo`` is 0; (0, 0) where they miss."""
    a, b = max(span[0], lo), min(span[1], hi)
    return (a - lo, b - lo) if a < b else (0, 0)


@dataclass(frozen=True)
class ShardingLayout:
    """``world`` ranks in groups of ``group_size`` (which divides it) sharing ``numel`` values."""

    world: int
    group_size: int
    numel: int

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.world % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide {self.world} ranks")
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")

    @classmethod
    def plan(cls, world: int, configured: int, numel: int) -> "ShardingLayout":
        """The layout for ``world`` ranks when the job asks for groups of ``configured``."""
        return cls(world, effective_group_size(world, configured), numel)

    @property
    def replicas(self) -> int:
        """How many groups (copies of the whole state) there are."""
        return self.world // self.group_size

    def position(self, rank: int) -> int:
        """Which slice ``rank`` owns (its place in its group)."""
        return rank % self.group_size

    def group(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s sharding group, in slice order."""
        first = rank - self.position(rank)
        return list(range(first, first + self.group_size))

    def peers(self, rank: int) -> list[int]:
        """The ranks owning ``rank``'s slice (itself among them), one per group, in group order."""
        return list(range(self.position(rank), self.world, self.group_size))

    def slices(self) -> list[Span]:
        """Each position's ``[lo, hi)`` of the flat vector."""
        return even_bounds(self.numel, self.group_size)

    def slice_of(self, rank: int) -> Span:
        """``[lo, hi)`` of the flat vector that ``rank`` owns."""
        return self.slices()[self.position(rank)]


@dataclass(frozen=True)
class Move:
    """State entries ``[lo, hi)`` (of the flat vector) sent from rank ``source`` to ``target``."""

    source: int
    target: int
    lo: int
    hi: int


class LostState(ValueError):
    """No rank holds part of the state some rank needs: ``span`` (the first such range)."""

    def __init__(self, span: Span) -> None:
        super().__init__(f"no rank holds the optimizer state of entries [{span[0]}, {span[1]})")
        self.span = span


def plan_moves(held: Sequence[Sequence[Span]], wanted: Sequence[Span]) -> list[Move]:
    """The transfers that give every rank ``r`` the state of ``wanted[r]`` from what the ranks
    hold (``held[r]``: the spans rank ``r`` holds, none or several: a rank keeps the slice it
    held before a regroup until every rank has confirmed the new one), sorted by (source,
    target, lo): the same list on every rank that computes it from the same inputs. A rank
    keeps what it holds of its own range; the rest is cut at the holders' boundaries, each
    piece taken from the holder that has been given the fewest entries to send so far (lowest
    rank on ties), adjacent pieces from one span of one source merged (so that a move lies in
    one span its source holds). Raises ValueError if the lists differ in length, LostState if
    some wanted entry is held by no one."""
    if len(held) != len(wanted):
        raise ValueError(f"held names {len(held)} ranks, wanted {len(wanted)}")
    holders = [(rank, span) for rank, spans in enumerate(held) for span in spans if span[0] < span[1]]
    sending = {rank: 0 for rank, _ in holders}
    moves: list[Move] = []
    for target, (lo, hi) in enumerate(wanted):
        cuts = {lo, hi}
        for _, (a, b) in holders:
            cuts.update(x for x in (a, b) if lo < x < hi)
        points = sorted(cuts)
        pieces: list[tuple[Move, Span]] = []  # with the span of its source's it lies in
        for a, b in zip(points, points[1:]):
            if any(x <= a and b <= y for x, y in held[target]):
                continue  # already here
            covering = [(rank, (x, y)) for rank, (x, y) in holders if x <= a and b <= y]
            if not covering:
                raise LostState((a, b))
            source, span = min(covering, key=lambda holder: (sending[holder[0]], holder[0], holder[1]))
            sending[source] += b - a
            last = pieces[-1] if pieces else None
            if last is not None and last[0].source == source and last[0].hi == a and last[1] == span:
                pieces[-1] = (Move(source, target, last[0].lo, b), span)
            else:
                pieces.append((Move(source, target, a, b), span))
        moves += [move for move, _ in pieces]
    return sorted(moves, key=lambda move: (move.source, move.target, move.lo))


def first_gap(spans: Sequence[Span], numel: int) -> Span | None:
    """The first range of ``[0, numel)`` that none of ``spans`` covers (None: they cover it)."""
    cursor = 0
    for lo, hi in sorted(spans):
        if lo > cursor:
            return (cursor, min(lo, numel))
        cursor = max(cursor, hi)
        if cursor >= numel:
            return None
    return (cursor, numel) if cursor < numel else None


def slices_kept(world: int, configured: int, leaving: Sequence[int]) -> bool:
    """Whether, of ``world`` ranks in groups for a job asking ``configured``
    (``effective_group_size``), those that stay when ranks ``leaving`` go still hold every slice
    (some peer of each position stays)."""
    size = effective_group_size(world, configured)
    staying = set(range(world)) - set(leaving)
    return all(any(peer in staying for peer in range(position, world, size)) for position in range(size))
