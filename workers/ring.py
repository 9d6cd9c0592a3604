"""Our all-reduce algorithms over point-to-point sends and receives: ring and hierarchical.

Ring (docs/architecture.md, "The step protocol"): the buffer is cut into one chunk per rank; n−1 reduce-scatter steps leave
each rank with one fully summed chunk, n−1 all-gather steps hand those around, so every rank
sends 2(n−1)/n of the buffer. Each step's chunk is further cut into segments, each sent and
received as one group (``CommGroup.exchange``), so summing one segment overlaps receiving the
next, and nothing waits on a receive posted after it (NCCL).

Hierarchical: ranks on one Ray node first sum into their node's leader, leaders run the ring,
and each leader sends the result back to its node's ranks; the slow inter-node links carry
2(n_nodes−1)/n_nodes of the buffer per leader instead of every rank crossing them.

These functions block and run on a ``CommGroup``'s communication thread; ``RingAllReduce`` and
``HierarchicalAllReduce`` queue them there and are what the worker uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from policies.split import even_bounds
from workers.comm_group import CommGroup, Exchange, PendingOp

# Segments: about SEGMENTS_PER_CHUNK per chunk so the pipeline has depth, within bounds that
# keep per-message overhead (small) and pipeline fill time (large) down; measured on gloo.
SEGMENTS_PER_CHUNK = 8
MIN_SEGMENT_BYTES = 256 << 10
MAX_SEGMENT_BYTES = 2 << 20


def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """The ring's chunks: ``range(length)`` cut into ``parts`` contiguous pieces whose sizes
    differ by at most 1, the first ones larger (``policies.split.even_bounds``; the name stays
    for the compressed ring, which cuts its buffer the same way). Raises ValueError if
    ``parts < 1``."""
    return even_bounds(length, parts)


class _Scratch:
    """A receive buffer reused across calls (only the communication thread touches it)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def get(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.dtype != like.dtype or buffer.device != like.device or buffer.numel() < numel:
            buffer = self._buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel]


def _segments(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, end)) for lo in range(start, end, size)]


def ring_sum(group: CommGroup, flat: torch.Tensor, ranks: Sequence[int], scratch: _Scratch) -> None:
    """Sum the 1-D ``flat`` in place over ``ranks`` (group ranks, in ring order; this rank
    among them). Blocking; every rank in ``ranks`` must make the same call.

    Every exchange is one group (``CommGroup.exchange``): segment j of step t, this rank's
    send of it to the right and its receive from the left, ``(t, j)`` for short. The 2(n-1)
    steps run as one pipeline: the segment received in (t, j) is the one sent in (t + 1, j),
    so (t + 1, j) is posted as soon as (t, j) is complete (and, in the reduce-scatter, summed),
    while (t, j + 1), ... are still on the wire.

    Why it cannot deadlock under NCCL's semantics (a group starts once those posted before it
    on this rank ended, and completes once each peer has posted the matching group): every
    rank posts its groups in increasing (t, j) order, and its send in (t, j) is the receive
    in (t, j) of its right neighbour, so the lowest (t, j) not yet complete anywhere is first
    in line on every rank that has it, and completes. The same order makes messages match
    without tags: between two neighbours, segments go in (t, j) order on both sides.
    """
    n = len(ranks)
    if n == 1 or flat.numel() == 0:
        return
    _pipeline(group, flat, ranks, chunk_bounds(flat.numel(), n), 2 * (n - 1), scratch)


def ring_reduce_scatter(
    group: CommGroup, flat: torch.Tensor, ranks: Sequence[int], owned: Sequence[tuple[int, int]], scratch: _Scratch
) -> None:
    """Sum ``flat`` over ``ranks`` into the ranges ``owned``: on return ``flat[slice(*owned[k])]``
    on ``ranks[k]`` holds the sum of every rank's (the rest of ``flat`` is partial sums: garbage).
    ``owned`` tiles ``flat`` in order (ranges may be empty). Blocking; every rank in ``ranks``
    makes the same call. The ring's first n - 1 steps (``ring_sum``'s pipeline and its argument
    against deadlock), its chunks placed so that each rank ends on its own range: after them
    ring position ``me`` has summed chunk ``me + 1``."""
    n = len(ranks)
    if len(owned) != n:
        raise ValueError(f"need one owned range per rank, got {len(owned)} for {n}")
    if n == 1 or flat.numel() == 0:
        return
    _pipeline(group, flat, ranks, [owned[(c - 1) % n] for c in range(n)], n - 1, scratch)


def _pipeline(
    group: CommGroup,
    flat: torch.Tensor,
    ranks: Sequence[int],
    bounds: Sequence[tuple[int, int]],
    steps: int,
    scratch: _Scratch,
) -> None:
    """The ring's segment pipeline over chunks ``bounds`` (one per ring position): the first
    ``steps`` of its 2(n-1) steps (n - 1 of them: the reduce-scatter alone)."""
    n = len(ranks)
    me = ranks.index(group.rank)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    longest = max(end - start for start, end in bounds)
    size = flat.element_size()
    segment = max(1, min(MAX_SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, longest * size // SEGMENTS_PER_CHUNK)) // size)
    # Two receive buffers: (t + 1, j) receives while (t, j + 1) is still being received.
    buffers = scratch.get(flat, 2 * longest)

    def sent(t: int) -> list[tuple[int, int]]:  # the segments sent in step t
        return _segments(*bounds[(me - t) % n], segment)

    def received(t: int) -> list[tuple[int, int]]:  # the segments arriving in step t (sent on in t + 1)
        return _segments(*bounds[(me - t - 1) % n], segment)

    def landing(t: int, lo: int, hi: int) -> torch.Tensor:  # where segment [lo, hi) of step t arrives
        if t >= n - 1:  # all-gather: straight into place
            return flat[lo:hi]
        first = bounds[(me - t - 1) % n][0]
        return buffers[(t % 2) * longest + lo - first :][: hi - lo]

    def post(t: int, j: int) -> Exchange:
        out, into = sent(t), received(t)
        sends = [(flat[slice(*out[j])], right)] if j < len(out) else []
        receives = [(landing(t, *into[j]), left)] if j < len(into) else []
        return group.exchange(sends, receives)

    def width(t: int) -> int:  # segments in step t: its chunks differ by at most one element
        return max(len(sent(t)), len(received(t)))

    pending = [post(0, j) for j in range(width(0))]
    for t in range(steps):
        into = received(t)
        following = width(t + 1) if t + 1 < steps else 0
        posted = []
        for j in range(max(len(pending), following)):
            if j < len(pending):
                pending[j].complete()
                if t < n - 1 and j < len(into):
                    lo, hi = into[j]
                    flat[lo:hi].add_(landing(t, lo, hi))
            if j < following:
                posted.append(post(t + 1, j))
        pending = posted


def ring_all_gather(
    group: CommGroup, pieces: Sequence[tuple[torch.Tensor, ...]], ranks: Sequence[int], own: int
) -> None:
    """Hand pieces around the ring until every rank holds all of them.

    ``pieces[i]`` is a tuple of tensors (shapes alike on every rank); on entry this rank holds
    ``pieces[own]``, on exit all of them. Blocking; every rank in ``ranks`` makes the call.
    Each step is one exchange; its tensors match in tuple order (no tags).
    """
    n = len(ranks)
    me = ranks.index(group.rank)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    for step in range(n - 1):
        outgoing, incoming = pieces[(own - step) % n], pieces[(own - step - 1) % n]
        group.exchange([(t, right) for t in outgoing], [(t, left) for t in incoming]).complete()


class RingAllReduce:
    """The ring over every rank of ``group``, in rank order."""

    def __init__(self, group: CommGroup) -> None:
        self.group = group
        self._ranks = list(range(group.size))
        self._scratch = _Scratch()

    def start_sum(self, tensor: torch.Tensor) -> PendingOp:
        flat = tensor.view(-1)
        return self.group.submit(lambda: ring_sum(self.group, flat, self._ranks, self._scratch), "ring all-reduce")


def node_groups(nodes: Sequence[str]) -> list[list[int]]:
    """Ranks grouped by node id (``nodes[rank]``), nodes in order of their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


def is_flat(groups: Sequence[Sequence[int]], size: int) -> bool:
    """Whether ``groups`` (``node_groups``) of ``size`` ranks leave the hierarchical all-reduce
    nothing to gain over the flat ring: one node, or one rank per node."""
    return len(groups) in (1, size)


def hierarchical_sum(group: CommGroup, flat: torch.Tensor, nodes: list[list[int]], scratch: _Scratch) -> None:
    """Sum ``flat`` in place: into each node's leader (its first rank), ring across leaders,
    back out to each node's ranks. Blocking; every rank makes the same call. Each transfer is
    its own exchange, posted in the same order on both of its sides: a member sends, then
    receives; its leader receives from each member in rank order, rings, then sends to all."""
    mine = next(ranks for ranks in nodes if group.rank in ranks)
    leader = mine[0]
    if group.rank != leader:
        group.exchange(sends=[(flat, leader)]).complete()
        group.exchange(receives=[(flat, leader)]).complete()
        return
    incoming = scratch.get(flat, flat.numel())
    for member in mine[1:]:
        group.exchange(receives=[(incoming, member)]).complete()
        flat.add_(incoming)
    ring_sum(group, flat, [ranks[0] for ranks in nodes], scratch)
    group.exchange(sends=[(flat, member) for member in mine[1:]]).complete()


class HierarchicalAllReduce:
    """Node-aware all-reduce; ``nodes[rank]`` is the Ray node id of each rank of ``group``.

    With one node, or one rank per node, there is nothing to gain: it runs the flat ring.
    """

    def __init__(self, group: CommGroup, nodes: Sequence[str]) -> None:
        if len(nodes) != group.size:
            raise ValueError(f"need a node id for each of {group.size} ranks, got {len(nodes)}")
        self.group = group
        self._nodes = node_groups(nodes)
        self.flat_ring = is_flat(self._nodes, group.size)
        self._scratch = _Scratch()

    def start_sum(self, tensor: torch.Tensor) -> PendingOp:
        flat = tensor.view(-1)
        if self.flat_ring:
            ranks = list(range(self.group.size))
            return self.group.submit(lambda: ring_sum(self.group, flat, ranks, self._scratch), "ring all-reduce")
        return self.group.submit(
            lambda: hierarchical_sum(self.group, flat, self._nodes, self._scratch), "hierarchical all-reduce"
        )
