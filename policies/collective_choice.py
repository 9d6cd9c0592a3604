"""Which all-reduce algorithm each gradient bucket uses, and how large buckets are, chosen from
a probe of the links the group actually has (``collective.algorithm: auto``). Pure.

At every group formation the workers time each candidate algorithm (``native``: gloo's or
NCCL's own; ``ring`` and ``hierarchical``: ours) on buffers of a few sizes, and every rank
takes the slowest rank's time (so all ranks hold the same numbers and make the same choice,
which keeps their sequences of collectives identical). From those times:

* **per size, the fastest algorithm**: a bucket uses the algorithm measured fastest at the
  smallest probed size that holds it (the largest probed size beyond that). Ours must beat
  ``native`` by ``NATIVE_MARGIN``: the probe runs on idle workers, but in training our
  algorithms' Python loop shares the interpreter lock with backward while the native one runs
  in C++ threads, a cost the probe cannot see (and its measurements carry noise);
* **the bucket size**, from the best algorithm's bandwidth at each size. Where the collective
  runs on the cores the compute needs (gloo, CPU workers), every call's work is taken from
  backward, so overlap hides little and fewer, larger calls cost least: the largest probed
  size within ``BANDWIDTH_SHARE`` of the best bandwidth (measured on digits, 2 CPU workers:
  4 MB buckets 44 ms per step, 25 MB 40 ms). Where it runs beside the compute (NCCL on GPUs),
  overlap is what hides it: the smallest such size, so reduction starts early and little is
  left for after backward. Never below ``MIN_BUCKET_BYTES``, whose per-call costs outside the
  collective (a hook, a queued call) the probe does not see.
* **compression**: stays the user's choice; the probe also times our int8 ring at the largest
  size and says when it would have been faster (fewer bytes beat its quantizing cost only on
  slow links).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# A bucket size is good enough once it reaches this share of the best bandwidth measured.
BANDWIDTH_SHARE = 0.8
MIN_BUCKET_BYTES = 1 << 20
# Our (Python-driven) algorithms are chosen over native only when this much faster.
NATIVE_MARGIN = 0.15
# Compression is reported as worth trying when it would cut the reduction time by this share.
COMPRESSION_GAIN = 0.2


@dataclass(frozen=True)
class LinkMeasurements:
    """Seconds per all-reduce as the slowest rank measured them.

    ``sizes``: buffer bytes, ascending. ``seconds[algorithm][i]``: one all-reduce of
    ``sizes[i]`` bytes. ``int8_seconds``: our int8 ring on ``sizes[-1]`` bytes, if measured.
    """

    sizes: tuple[int, ...]
    seconds: Mapping[str, tuple[float, ...]]
    int8_seconds: float | None = None

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] <= 0:
            raise ValueError(f"probe sizes must be positive and ascending, got {self.sizes}")
        if not self.seconds:
            raise ValueError("no algorithm was measured")
        for algorithm, times in self.seconds.items():
            if len(times) != len(self.sizes) or any(not t > 0 for t in times):
                raise ValueError(f"{algorithm}: need a positive time for each of {len(self.sizes)} sizes, got {times}")


@dataclass(frozen=True)
class CollectiveChoice:
    """What ``auto`` chose: ``by_size`` as ``(bytes, algorithm)``, ascending: a bucket of ``n``
    bytes runs the algorithm of the first entry with ``bytes >= n`` (the last entry's beyond);
    ``bucket_bytes``; ``bandwidth_mb_s[algorithm][i]``: measured at ``sizes[i]``;
    ``compression``: advice, or None."""

    by_size: tuple[tuple[int, str], ...]
    bucket_bytes: int
    sizes: tuple[int, ...]
    bandwidth_mb_s: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    compression: str | None = None

    def algorithm_for(self, nbytes: int) -> str:
        for limit, algorithm in self.by_size:
            if nbytes <= limit:
                return algorithm
        return self.by_size[-1][1]

    @property
    def algorithms(self) -> tuple[str, ...]:
        """The algorithms some bucket size uses, without repeats."""
        return tuple(dict.fromkeys(a for _, a in self.by_size))

    def to_json(self) -> dict[str, Any]:
        return {
            "by_size": [{"up_to_bytes": size, "algorithm": algorithm} for size, algorithm in self.by_size],
            "bucket_mb": round(self.bucket_bytes / 2**20, 3),
            "probe_bytes": list(self.sizes),
            "bandwidth_mb_s": {a: [round(b, 1) for b in bws] for a, bws in self.bandwidth_mb_s.items()},
            "compression": self.compression,
        }


def choose_collective(
    measured: LinkMeasurements, gradient_bytes: int, *, shares_cores: bool, bucket_bytes: int | None = None
) -> CollectiveChoice:
    """The choice for a gradient of ``gradient_bytes``; ``shares_cores``: the collective's work
    runs on the compute's cores (CPU workers). ``bucket_bytes`` set by the user is kept, else
    chosen (see module doc)."""
    sizes = measured.sizes
    best = [_fastest(measured.seconds, i) for i in range(len(sizes))]
    by_size = tuple((size, algorithm) for size, algorithm in zip(sizes, best))
    bandwidth = {a: tuple(s / t / 1e6 for s, t in zip(sizes, times)) for a, times in measured.seconds.items()}
    if bucket_bytes is None:
        achieved = [bandwidth[best[i]][i] for i in range(len(sizes))]
        good = [s for s, bw in zip(sizes, achieved) if bw >= BANDWIDTH_SHARE * max(achieved)]
        bucket_bytes = max(MIN_BUCKET_BYTES, good[-1] if shares_cores else good[0])
    return CollectiveChoice(
        by_size=by_size,
        bucket_bytes=bucket_bytes,
        sizes=sizes,
        bandwidth_mb_s=bandwidth,
        compression=_compression_advice(measured, best[-1], gradient_bytes),
    )


def _fastest(seconds: Mapping[str, tuple[float, ...]], i: int) -> str:
    ours = min((a for a in seconds if a != "native"), key=lambda a: seconds[a][i], default=None)
    if "native" not in seconds:
        assert ours is not None
        return ours
    if ours is not None and seconds[ours][i] < (1 - NATIVE_MARGIN) * seconds["native"][i]:
        return ours
    return "native"


def _compression_advice(measured: LinkMeasurements, fastest: str, gradient_bytes: int) -> str | None:
    if measured.int8_seconds is None:
        return None
    exact = measured.seconds[fastest][-1]
    if measured.int8_seconds > (1 - COMPRESSION_GAIN) * exact:
        return None
    per_step = gradient_bytes / measured.sizes[-1]
    return (
        f"int8 compression would pay on these links: {measured.sizes[-1] / 2**20:.1f} MB reduce in "
        f"{measured.int8_seconds * 1e3:.1f} ms instead of {exact * 1e3:.1f} ms ({fastest}), about "
        f"{(exact - measured.int8_seconds) * per_step * 1e3:.1f} ms less per step for this gradient; "
        "it is inexact (set collective.compression: int8 to use it)"
    )
