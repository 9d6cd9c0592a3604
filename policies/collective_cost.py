"""What an all-reduce costs at any scale: the latency-bandwidth (alpha-beta) model per link,
within a node and between nodes, for our ring and hierarchical algorithms and the native
baseline, bucketed and overlapped with backward. Pure: no Ray, no torch.

One hop over a link costs ``alpha + bytes / beta``. An all-reduce of ``S`` bytes over ``n``
ranks on ``m`` nodes (``g = n / m`` per node):

* **ring** (ours, and NCCL's or gloo's native ring): ``2 (n - 1)`` hops of ``S / n`` bytes, of
  which ``2 (m - 1)`` cross nodes (as the NCCL version we read counts its ring's latency in
  ``src/graph/tuning.cc``; newer ones count ``2 m``); every hop waits for the slowest link of
  the ring, so the bandwidth term is ``2 (n - 1) / n x S / beta_slowest``;
* **hierarchical** (ours, ``workers/comm/ring.py``): a reduce-scatter within each node
  (``g - 1`` hops of ``S / g`` over the intra link), a ring all-reduce of each rank's
  ``S / g`` across the ``m`` nodes (inter link), an all-gather within the node.

``fit_link`` calibrates one link from measured all-reduces (``ringleader bench allreduce``);
``policies/collective_choice.py`` fits the same model per algorithm at one world size, from
the probe a group runs when it forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class Link:
    """One hop: ``alpha_s`` seconds of latency, ``beta_bytes_s`` bytes per second."""

    alpha_s: float
    beta_bytes_s: float

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.beta_bytes_s <= 0:
            raise ValueError(f"need alpha >= 0 and beta > 0, got {self.alpha_s}, {self.beta_bytes_s}")


@dataclass(frozen=True)
class Fabric:
    """The links of a cluster: ``intra`` within a node, ``inter`` between nodes; ``call_s`` the
    fixed cost of one collective call (launch, NCCL's base latency). ``cores_per_node``: where
    the reduction runs on CPU cores the ranks of a node share (gloo on CPU workers), more ranks
    than cores time-share them and every term stretches by ranks / cores; None: every rank has
    its own engine (a GPU)."""

    intra: Link
    inter: Link
    call_s: float = 0.0
    cores_per_node: float | None = None

    def sharing(self, ranks: int, nodes: int) -> float:
        """How much slower than alone each rank runs for sharing its node's cores."""
        if self.cores_per_node is None:
            return 1.0
        return max(1.0, ranks / max(1, nodes) / self.cores_per_node)  # (simulated nodes: a share of the cores)


def ring_s(nbytes: float, ranks: int, nodes: int, fabric: Fabric) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``ranks`` spread over ``nodes``."""
    if ranks < 2:
        return 0.0
    hops = 2 * (ranks - 1)
    inter_hops = 2 * (nodes - 1) if nodes > 1 else 0
    slowest = fabric.inter if nodes > 1 else fabric.intra
    latency = (hops - inter_hops) * fabric.intra.alpha_s + inter_hops * fabric.inter.alpha_s
    return fabric.call_s + fabric.sharing(ranks, nodes) * (latency + hops * (nbytes / ranks) / slowest.beta_bytes_s)


def hierarchical_s(nbytes: float, ranks: int, nodes: int, fabric: Fabric) -> float:
    """Seconds for our hierarchical all-reduce (intra reduce-scatter, inter ring, intra
    all-gather); one node is a plain ring."""
    if nodes <= 1 or ranks <= nodes:
        return ring_s(nbytes, ranks, nodes, fabric)
    per_node = ranks / nodes  # (uneven nodes, after a loss: the mean)
    intra = 2 * (per_node - 1) * (fabric.intra.alpha_s + nbytes / per_node / fabric.intra.beta_bytes_s)
    inter = 2 * (nodes - 1) * (fabric.inter.alpha_s + nbytes / per_node / nodes / fabric.inter.beta_bytes_s)
    return fabric.call_s + fabric.sharing(ranks, nodes) * (intra + inter)


ALGORITHMS = {"ring": ring_s, "hierarchical": hierarchical_s, "native": ring_s}


def allreduce_s(algorithm: str, nbytes: float, ranks: int, nodes: int, fabric: Fabric) -> float:
    """One all-reduce by ``algorithm`` (``ring``, ``hierarchical`` or ``native``: a ring with
    the native library's own calibrated links). Raises ValueError for another name."""
    try:
        model = ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(f"unknown algorithm {algorithm!r}: one of {', '.join(ALGORITHMS)}") from None
    return model(nbytes, ranks, nodes, fabric)


def bucket_sizes(total_bytes: float, bucket_bytes: float) -> list[float]:
    """A gradient of ``total_bytes`` cut into buckets of ``bucket_bytes`` (the last smaller)."""
    if total_bytes <= 0 or bucket_bytes <= 0:
        raise ValueError(f"need positive sizes, got {total_bytes}, {bucket_bytes}")
    full, rest = divmod(total_bytes, bucket_bytes)
    return [bucket_bytes] * int(full) + ([rest] if rest else [])


def exposed_s(bucket_s: Sequence[float], backward_s: float) -> float:
    """Communication left after backward when each bucket is reduced as soon as backward has
    produced it (buckets ready at even intervals over ``backward_s``) and the previous one is
    done: the last bucket's finish minus ``backward_s``, at least its own time (0 buckets: 0)."""
    finish = 0.0
    for i, seconds in enumerate(bucket_s):
        ready = backward_s * (i + 1) / len(bucket_s)
        finish = max(finish, ready) + seconds
    return max(0.0, finish - backward_s)


def fit_link(rows: Iterable[tuple[int, float, float]], cores_per_node: float | None = None) -> Link:
    """The one-link ring model that best fits measured all-reduces on one node, ``(ranks, bytes,
    seconds)`` each (``cores_per_node`` as in ``Fabric``): least squares on relative error of
    ``sharing x (2 (n - 1) alpha + 2 (n - 1) / n x bytes / beta)``. Raises ValueError with
    fewer than two distinct points."""
    points = [(n, s, t) for n, s, t in rows]
    if len({(n, s) for n, s, _ in points}) < 2:
        raise ValueError("fitting a link needs at least two distinct (ranks, bytes) points")
    probe = Fabric(Link(0.0, 1.0), Link(0.0, 1.0), cores_per_node=cores_per_node)
    design = np.array([[2.0 * (n - 1), 2.0 * (n - 1) / n * s] for n, s, _ in points])
    design *= np.array([probe.sharing(n, 1) for n, _, _ in points])[:, None]
    seconds = np.array([t for _, _, t in points])
    weights = 1.0 / seconds  # relative error: every point counts alike, whatever its size
    solution, *_ = np.linalg.lstsq(design * weights[:, None], seconds * weights, rcond=None)
    alpha, inverse_beta = (float(v) for v in solution)
    if alpha < 0:  # all bandwidth: refit through zero latency
        alpha = 0.0
        inverse_beta = float(np.sum(design[:, 1] * seconds * weights**2) / np.sum((design[:, 1] * weights) ** 2))
    return Link(alpha, 1.0 / max(inverse_beta, 1e-15))
