"""``collective.algorithm: auto``: time the all-reduce algorithms on this group's links at its
formation, and sum each bucket with the one measured fastest for its size.

The probe runs on the communication thread like any collective (so it keeps the abort and
timeout guarantees), on a scratch buffer of the gradient's dtype and device: for each probe
size, one warm-up all-reduce per algorithm (it also synchronises the ranks), then a few more
in turns, each timed, of which the fastest counts. The slowest rank's times are agreed on by
a MAX all-reduce after each size, so every rank makes the same choice
(``policies/collective_choice.py``) and issues the same sequence of collectives afterwards;
past ``PROBE_BUDGET_S`` (slow links) the larger sizes are skipped, on every rank alike. Its
traffic is not counted in the group's ``bytes_sent``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from policies.collective_choice import CollectiveChoice, LinkMeasurements, choose_collective
from workers.comm.comm_group import CommGroup, PendingOp
from workers.comm.communicator import Communicator, NativeAllReduce, make_communicator
from workers.comm.compression import Int8RingAllReduce
from workers.comm.gradient_reducer import default_bucket_bytes
from workers.comm.ring import is_flat, node_groups

PROBE_SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
# Timed all-reduces per algorithm and size, after one warm-up. The fastest counts: on a shared
# machine interference only ever adds time, so the minimum is the steadiest estimate of what
# an algorithm costs (timeit's reasoning).
REPEATS = 5
# A probe that has spent this long stops after the size it is on (slow links: the state
# transfer and the rendezvous deadline come after it).
PROBE_BUDGET_S = 2.0


class AutoAllReduce:
    """Sums each tensor with the algorithm ``choice`` picked for its size in bytes."""

    def __init__(self, choice: CollectiveChoice, communicators: Mapping[str, Communicator]) -> None:
        missing = set(choice.algorithms) - set(communicators)
        if missing:
            raise ValueError(f"no communicator for {sorted(missing)}")
        self.choice = choice
        self._communicators = dict(communicators)

    def start_sum(self, tensor: torch.Tensor) -> PendingOp:
        algorithm = self.choice.algorithm_for(tensor.numel() * tensor.element_size())
        return self._communicators[algorithm].start_sum(tensor)


def candidate_algorithms(nodes: Sequence[str]) -> tuple[str, ...]:
    """``native`` and ``ring``, and ``hierarchical`` where it differs from the ring: several
    nodes, some with several ranks."""
    flat = is_flat(node_groups(nodes), len(nodes))
    return ("native", "ring") if flat else ("native", "ring", "hierarchical")


def probe_sizes(gradient_bytes: int, element_size: int) -> tuple[int, ...]:
    """The probe sizes below the gradient's, then the gradient's own size (at most the largest
    probe size), in whole elements."""
    top = min(gradient_bytes, PROBE_SIZES[-1]) // element_size * element_size
    return tuple(s for s in PROBE_SIZES if s < top) + ((top,) if top > 0 else ())


def measure_links(
    group: CommGroup,
    communicators: Mapping[str, Communicator],
    sizes: Sequence[int],
    like: torch.Tensor,
    *,
    int8: Communicator | None = None,
    budget_s: float = PROBE_BUDGET_S,
) -> LinkMeasurements:
    """Seconds per all-reduce of each algorithm in ``communicators`` at each of ``sizes``
    (bytes, ascending), the slowest rank's; ``int8`` (if given) is timed at the largest size
    measured. ``like``: the dtype and device to probe with. Sizes are measured smallest first
    until one ends past ``budget_s`` on some rank (the ranks agree on that too), so slow links
    cost a bounded probe. Raises CollectiveAborted/CollectiveTimeout."""
    element = like.element_size()
    scratch = torch.zeros(max(sizes) // element, dtype=like.dtype, device=like.device)
    bytes_before = group.bytes_sent
    exact = list(communicators.values())
    started = time.perf_counter()
    measured: list[list[float]] = []
    int8_seconds = None
    for size in sizes:
        last = size == sizes[-1]
        timed = exact + ([int8] if int8 is not None and last else [])
        local = _time_sums(timed, scratch[: size // element])
        agreed = _agree_on_max(group, [*local, time.perf_counter() - started], like.device)
        measured.append(agreed[: len(exact)])
        if last and int8 is not None:
            int8_seconds = agreed[len(exact)]
        if agreed[-1] > budget_s:
            break
    group.bytes_sent = bytes_before
    seconds = {name: tuple(row[k] for row in measured) for k, name in enumerate(communicators)}
    return LinkMeasurements(tuple(sizes[: len(measured)]), seconds, int8_seconds=int8_seconds)


def _agree_on_max(group: CommGroup, values: list[float], device: torch.device) -> list[float]:
    """Every rank's ``values``, element-wise maximum over the ranks (one small all-reduce)."""
    agreed = torch.tensor(values, dtype=torch.float64, device=device)
    NativeAllReduce(group, dist.ReduceOp.MAX).start_sum(agreed).wait()
    return agreed.tolist()


def _time_sums(communicators: list[Communicator], buffer: torch.Tensor) -> list[float]:
    """The fastest of ``REPEATS`` timed sums of ``buffer`` by each communicator, taken in turns
    (a disturbance then hits all alike), after one warm-up each (connections, scratch buffers;
    it also lines the ranks up)."""
    for communicator in communicators:
        communicator.start_sum(buffer).wait()
    times: list[list[float]] = [[] for _ in communicators]
    for _ in range(REPEATS):
        for k, communicator in enumerate(communicators):
            started = time.perf_counter()
            communicator.start_sum(buffer).wait()
            times[k].append(time.perf_counter() - started)
    return [max(min(t), 1e-9) for t in times]


def auto_communicator(
    group: CommGroup, nodes: Sequence[str], grads: torch.Tensor, bucket_bytes: int | None
) -> tuple[AutoAllReduce, CollectiveChoice]:
    """Probe this group's links (every rank calls this at the same point) and return the
    communicator and the choice for the gradient buffer ``grads``; ``bucket_bytes`` set by the
    user is kept. A group of one rank has nothing to measure: the ring (a no-op there)."""
    gradient_bytes = grads.numel() * grads.element_size()
    if group.size == 1:
        ring = make_communicator("ring", group, nodes)
        choice = CollectiveChoice(
            ((gradient_bytes, "ring"),), bucket_bytes or default_bucket_bytes(grads.device), sizes=()
        )
        return AutoAllReduce(choice, {"ring": ring}), choice
    communicators = {name: make_communicator(name, group, nodes) for name in candidate_algorithms(nodes)}
    sizes = probe_sizes(gradient_bytes, grads.element_size())
    measured = measure_links(group, communicators, sizes, grads, int8=Int8RingAllReduce(group))
    choice = choose_collective(
        measured, gradient_bytes, shares_cores=grads.device.type == "cpu", bucket_bytes=bucket_bytes
    )
    return AutoAllReduce(choice, communicators), choice
