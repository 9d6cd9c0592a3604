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

What a caller's tensors see: an operation whose caller gave up (an abort, a timeout) may go on,
its steps completing late once a stalled peer sends (a broken gloo group is left alive, its
waits blind to the abort), while the next generation uses the same tensors (the gradient
buffer, the parameters). So no receive lands in a caller's tensor: the backend writes a receive
whenever its send arrives, beyond our control. Every segment lands in scratch (two segments'
worth per stream of segments, reused) and is added or copied into place inside
``CommGroup.writing``, which refuses once the group is broken or the abort flag is up. Once a
caller's wait has raised, nothing of the operation writes its tensors; what it wrote before is
partial sums (garbage). Per segment rather than the whole reduction into scratch and one copy
at the end: no buffer the size of what is summed (a bucket, or the whole gradient in a rescue
pass), and no extra pass over it but the all-gather's copy out of scratch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from policies.split import even_bounds
from workers.comm.comm_group import CommGroup, Exchange, PendingOp

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
                if j < len(into):
                    lo, hi = into[j]
                    with group.writing():  # reduce-scatter: summed in; all-gather: copied into place
                        (flat[lo:hi].add_ if t < n - 1 else flat[lo:hi].copy_)(landing(t, lo, hi))
            if j < following:
                posted.append(post(t + 1, j))
        pending = posted


# How a received segment goes into its target: (target, landed) -> the target changed in place.
Merge = Callable[[torch.Tensor, torch.Tensor], object]


def _relay(
    group: CommGroup,
    sends: Sequence[tuple[torch.Tensor, int]] = (),
    receives: Sequence[tuple[torch.Tensor, int]] = (),
    merge: Merge = torch.Tensor.copy_,
) -> None:
    """Send each contiguous tensor of ``sends`` ((tensor, group rank)) and receive into each of
    ``receives`` ((target, group rank)), every tensor cut into segments of at most
    ``MAX_SEGMENT_BYTES``. Exchange j holds segment j of every tensor that has one, in list
    order, two exchanges in flight; each received segment lands in scratch of this call and
    is merged into its target (``merge``, in list order) inside ``CommGroup.writing``.
    Blocking; the peers make the matching calls (shapes and dtypes alike, so cut alike).

    Under NCCL's semantics it cannot deadlock: every rank posts its exchanges in increasing j,
    and exchange j matches only exchanges j of its peers, so the lowest j not complete is
    first in line on every rank that has it."""

    def cut(tensor: torch.Tensor) -> list[torch.Tensor]:
        flat = tensor.view(-1)
        return [flat[lo:hi] for lo, hi in _segments(0, flat.numel(), max(1, MAX_SEGMENT_BYTES // flat.element_size()))]

    outgoing = [(cut(tensor), peer) for tensor, peer in sends]
    incoming = []
    for tensor, peer in receives:
        segments = cut(tensor)  # two landing slots, each as large as the first (largest) segment
        incoming.append((segments, peer, [torch.empty_like(segments[0]) for _ in range(min(2, len(segments)))]))
    width = max([len(segments) for segments, _ in outgoing] + [len(segments) for segments, _, _ in incoming], default=0)

    def arriving(j: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:  # exchange j's (target, landing, peer)
        return [(s[j], slots[j % 2][: s[j].numel()], peer) for s, peer, slots in incoming if j < len(s)]

    def post(j: int) -> Exchange:
        sent = [(segments[j], peer) for segments, peer in outgoing if j < len(segments)]
        return group.exchange(sent, [(landing, peer) for _, landing, peer in arriving(j)])

    in_flight = deque(post(j) for j in range(min(2, width)))
    for j in range(width):
        in_flight.popleft().complete()
        arrived = arriving(j)
        if arrived:
            with group.writing():
                for target, landing, _ in arrived:
                    merge(target, landing)
        if j + 2 < width:
            in_flight.append(post(j + 2))


def ring_all_gather(
    group: CommGroup, pieces: Sequence[tuple[torch.Tensor, ...]], ranks: Sequence[int], own: int
) -> None:
    """Hand pieces around the ring until every rank holds all of them.

    ``pieces[i]`` is a tuple of contiguous tensors (shapes alike on every rank); on entry this
    rank holds ``pieces[own]``, on exit all of them. Blocking; every rank in ``ranks`` makes
    the call. Each step is one ``_relay``: its tensors in segments, matched in tuple order (no
    tags), each landing in scratch and copied into place (the module doc: what callers see).
    """
    n = len(ranks)
    me = ranks.index(group.rank)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    for step in range(n - 1):
        outgoing, incoming = pieces[(own - step) % n], pieces[(own - step - 1) % n]
        _relay(group, [(t, right) for t in outgoing], [(t, left) for t in incoming])


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
    a ``_relay``, posted in the same order on both of its sides: a member sends, then
    receives; its leader receives from its members at once, summing their segments in in rank
    order, rings, then sends to all of them."""
    mine = next(ranks for ranks in nodes if group.rank in ranks)
    leader = mine[0]
    if group.rank != leader:
        _relay(group, sends=[(flat, leader)])
        _relay(group, receives=[(flat, leader)])
        return
    _relay(group, receives=[(flat, member) for member in mine[1:]], merge=torch.Tensor.add_)
    ring_sum(group, flat, [ranks[0] for ranks in nodes], scratch)
    _relay(group, sends=[(flat, member) for member in mine[1:]])


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
